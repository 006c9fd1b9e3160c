"""The Chat tab: multimodal prompt, generation parameters, streamed text, per-stage progress, live
diffusion previews, the final image in the conversation, Stop, and "send to source image".

With a model that speaks (docs/speech.md "In the studio"): speech in (a recording or an audio file), a
voice and what to reply with, the reply played as it streams (the live speaker below), its transcript
streamed, and the finished reply's WAV in the conversation.
"""

from __future__ import annotations

import html
import time
from pathlib import Path
from typing import Any

import gradio as gr
from PIL import Image

from engine import ChatTurn, GenerationRequest, RequestError
from engine.events import (
    AudioDelta,
    DiffusionStep,
    RunFailed,
    RunFinished,
    StageFinished,
    StageStarted,
    TextDelta,
    TokenProgress,
)
from engine.modality import OutputModality
from studio.api.inputs import params_from_fields
from studio.cli.progress import stage_labels
from studio.controller import Studio
from studio.media.audio import AudioError, decode_input_audio
from studio.runs.service import Queued, RunRejected
from studio.ui.recipe import build_recipe_drop, connect_recipe_drop
from studio.ui.speaker import SPEAKER_IDLE, SPEAKER_JS, speaker_chunk, speaker_end, speaker_start

# The UI coalesces progress: every yield costs the (GIL-sharing) server a diff and a message, and the tiny
# models make thousands of tokens a second.
UI_UPDATE_INTERVAL_S = 0.2


UNITS = {"tok": "tokens", "code": "codes", "step": "steps"}


def speech_labels(studio: Studio) -> dict[int, tuple[str, str]] | None:
    """Each stage's name and unit when the model speaks (thinker tokens, talker codes, code2wav steps: the
    names of its hand-offs, as the CLI's bars show them); ``None`` keeps the image families' bars as they are."""
    if not studio.speaks:
        return None
    names, units = stage_labels(studio.config.stages)
    return {sid: (names[sid], UNITS.get(units[sid], units[sid])) for sid in names}


def render_progress(
    stages: dict[int, dict[str, Any]], labels: dict[int, tuple[str, str]] | None = None
) -> str:
    """One bar per stage: what it is, how far, how long."""
    if not stages:
        return "<div class='omni-progress idle'>Idle</div>"
    rows = []
    for sid in sorted(stages):
        s = stages[sid]
        name, unit = (labels or {}).get(sid) or (s["kind"], "tokens" if s["kind"] == "ar" else "steps")
        # A streamed code2wav counts chunks and learns their number at the last one (total 0 until then).
        open_ended = labels is not None and not s.get("total") and s.get("status", "running") == "running"
        total = max(int(s.get("total") or 0), 1)
        step = int(s.get("step") or 0) if open_ended else min(int(s.get("step") or 0), total)
        status = s.get("status", "running")
        seconds = f" · {s['seconds']:.2f} s" if s.get("seconds") is not None else ""
        bar = "<progress></progress>" if open_ended else f"<progress max='{total}' value='{step}'></progress>"
        count = f"{step} {unit}" if open_ended else f"{step}/{total} {unit}"
        rows.append(
            f"<div class='omni-stage {status}' data-stage='{sid}' data-status='{status}'>"
            f"<span class='omni-stage-label'>stage {sid} · {html.escape(str(name))}</span>"
            f"{bar}<span class='omni-stage-count'>{count} · {status}{seconds}</span></div>"
        )
    return "<div class='omni-progress'>" + "".join(rows) + "</div>"


def track_stages(stages: dict[int, dict[str, Any]], event: Any) -> bool:
    """Fold a stage's start, progress or finish into ``stages`` (what :func:`render_progress` draws);
    False for any other event."""
    if isinstance(event, StageStarted):
        stages[event.stage_id] = {"kind": event.kind, "step": 0, "total": event.total, "status": "running"}
    elif isinstance(event, (TokenProgress, DiffusionStep)):
        stage = stages.setdefault(event.stage_id, {"kind": "", "status": "running"})
        stage.update(step=event.step, total=event.total)
    elif isinstance(event, StageFinished):
        stage = stages.setdefault(event.stage_id, {"kind": event.kind})
        stage.update(status=event.status, seconds=event.seconds)
        if event.status == "succeeded":
            stage["step"] = stage.get("total") or stage.get("step", 0)
    else:
        return False
    return True


def queued_status(event: Queued, seed: int) -> str:
    ahead = f"{event.ahead} ahead of you" if event.ahead else "next in line"
    return f"Queued… {ahead} · seed {seed}"


def history_turns(history: list[dict[str, Any]]) -> tuple[ChatTurn, ...]:
    """Earlier text turns of the conversation (images are shown, not sent back to the model)."""
    turns = []
    for message in history:
        content = message.get("content")
        parts = content if isinstance(content, list) else [content]
        texts = []
        for part in parts:
            if isinstance(part, str):
                texts.append(part)
            elif isinstance(part, dict) and part.get("type") == "text":
                texts.append(part.get("text", ""))
        text = "\n".join(t for t in texts if t)
        if text and message.get("role") in ("user", "assistant"):
            turns.append(ChatTurn(message["role"], text))
    return tuple(turns)


PLACEHOLDERS = {
    False: "Describe an image (attach a source image for image-to-image) and press Enter",
    True: "Say something (or add a recording below) and press Enter",
}


def heard_audio(studio: Studio, path: str | None) -> tuple[Any, ...]:
    """An uploaded or recorded clip as the model hears it (float32 mono 16 kHz), within the API's limits."""
    if not path:
        return ()
    data, limits = Path(path).read_bytes(), studio.serving.options.limits
    fmt = "wav" if data[:4] == b"RIFF" else "mp3"  # by what the bytes are (a recording's name says .wav)
    return (
        decode_input_audio(data, fmt, max_bytes=limits.max_audio_bytes, max_seconds=limits.max_audio_seconds),
    )


def build_request(
    studio: Studio,
    message: dict[str, Any],
    history: list[dict[str, Any]],
    seed: float | None,
    width: float,
    height: float,
    steps: float,
    guidance: float,
    negative: str,
    max_tokens: float,
    temperature: float,
    modalities: list[str],
    preview_every: float,
    voice: str | None = None,
    reply_as: str | None = None,
    audio_path: str | None = None,
) -> GenerationRequest:
    """The engine request for the UI's current inputs (the same params the API builds). A model that speaks
    takes the thinker's max tokens and temperature, code2wav's steps and guidance, a voice, what to reply
    with (``text+audio``, ``audio``, ``text``) and a clip to hear (``audio_path``, wav or mp3)."""
    text = (message or {}).get("text", "") or ""
    files = (message or {}).get("files") or []
    image = None
    if files:
        path = files[-1]["path"] if isinstance(files[-1], dict) else files[-1]
        with Image.open(path) as opened:
            image = opened.convert("RGB")
    family = studio.config.family
    fields: dict[str, Any] = {
        "seed": None if seed is None or seed < 0 else int(seed),
        "preview_every": int(preview_every),
    }
    if studio.speaks:
        fields.update(max_tokens=int(max_tokens), temperature=float(temperature), voice=voice or None)
        fields.update(num_inference_steps=int(steps), guidance_scale=float(guidance))
        reply = tuple(OutputModality(m) for m in (reply_as or "text+audio").split("+"))
        return GenerationRequest(
            text,
            params_from_fields(fields),
            image=image,
            history=history_turns(history),
            modalities=reply,
            input_audio=heard_audio(studio, audio_path),
        )
    if family == "chat":
        fields.update(max_tokens=int(max_tokens), temperature=float(temperature))
    else:
        fields.update(
            num_inference_steps=int(steps), guidance_scale=float(guidance), negative_prompt=negative or None
        )
        if image is None or (width and height):
            fields.update(width=int(width), height=int(height))
    wanted = tuple(OutputModality(m) for m in modalities) if modalities else None
    return GenerationRequest(
        text, params_from_fields(fields), image=image, history=history_turns(history), modalities=wanted
    )


def build_chat_tab(studio: Studio) -> dict[str, Any]:
    dit = next((s for s in studio.config.stages if s.kind == "diffusion"), None)
    defaults = dit.default_sampling_params if dit else {}
    speaks, voices = studio.speaks, studio.voices()
    with gr.Row(equal_height=False):
        with gr.Column(scale=3):
            chatbot = gr.Chatbot(label="Conversation", height=460, elem_id="omni-chatbot", buttons=["copy"])
            message = gr.MultimodalTextbox(
                placeholder=PLACEHOLDERS[speaks],
                file_types=["image"],
                file_count="single",
                sources=["upload"],
                show_label=False,
                elem_id="omni-message",
            )
            audio_in = gr.Audio(
                sources=["upload", "microphone"],
                type="filepath",
                label="Speech in: a recording or an audio file (wav or mp3), sent with the next message",
                visible=speaks,
                elem_id="omni-audio-in",
            )
            with gr.Row():
                stop = gr.Button("Stop", variant="stop", elem_id="omni-stop")
                to_source = gr.Button(
                    "Send result to source image", elem_id="omni-to-source", visible=not speaks
                )
                clear = gr.Button("Clear conversation", elem_id="omni-clear")
            status = gr.Markdown("", elem_id="omni-chat-status")
        with gr.Column(scale=2):
            progress = gr.HTML(render_progress({}), label="Progress", elem_id="omni-progress")
            speaker = gr.HTML(SPEAKER_IDLE, js_on_load=SPEAKER_JS, visible=speaks, elem_id="omni-speaker")
            preview = gr.Image(
                label="Diffusion preview",
                type="pil",
                interactive=False,
                height=256,
                visible=not speaks,
                elem_id="omni-preview",
            )
            recipe_drop = build_recipe_drop()  # "Load recipe" (studio/ui/recipe.py)
            with gr.Accordion("Parameters", open=True):
                model = gr.Dropdown(
                    studio.builtin_models(),
                    value=studio.model.name,
                    label="Model",
                    allow_custom_value=True,
                    elem_id="omni-model",
                )
                seed = gr.Number(value=-1, precision=0, label="Seed (-1: random)", elem_id="omni-seed")
                with gr.Row(visible=speaks) as speech_row:
                    voice = gr.Dropdown(
                        voices, value=voices[0] if voices else None, label="Voice", elem_id="omni-voice"
                    )
                    reply_as = gr.Radio(
                        ["text+audio", "audio", "text"],
                        value="text+audio",
                        label="Reply with",
                        elem_id="omni-reply-as",
                    )
                with gr.Row(visible=not speaks) as size_row:
                    width = gr.Slider(
                        32,
                        1024,
                        value=defaults.get("width", 64),
                        step=32,
                        label="Width",
                        elem_id="omni-width",
                    )
                    height = gr.Slider(
                        32,
                        1024,
                        value=defaults.get("height", 64),
                        step=32,
                        label="Height",
                        elem_id="omni-height",
                    )
                with gr.Row():
                    steps = gr.Slider(
                        1,
                        100,
                        value=defaults.get("num_inference_steps", 4),
                        step=1,
                        label="Steps",
                        elem_id="omni-steps",
                    )
                    guidance = gr.Slider(
                        0,
                        20,
                        value=defaults.get("guidance_scale", 1.5),
                        step=0.1,
                        label="Guidance",
                        elem_id="omni-guidance",
                    )
                size_note = gr.Markdown(
                    studio.support_note(
                        defaults.get("width"), defaults.get("height"), defaults.get("num_inference_steps")
                    ),
                    elem_id="omni-size-note",
                )
                negative = gr.Textbox(label="Negative prompt", lines=1, visible=not speaks)
                with gr.Row():
                    max_tokens = gr.Slider(
                        1, 1024, value=64, step=1, label="Max tokens (text models)", elem_id="omni-max-tokens"
                    )
                    temperature = gr.Slider(0, 2, value=0.8, step=0.05, label="Temperature (text models)")
                modalities = gr.CheckboxGroup(
                    ["text", "image", "token_ids"],
                    label="Output modalities (empty: what the pipeline's final stage produces)",
                    visible=not speaks,
                    elem_id="omni-modalities",
                )
                preview_every = gr.Slider(
                    0, 10, value=1, step=1, label="Preview every k steps (0: none)", visible=not speaks
                )
    run_id = gr.State(None)
    # The speech inputs reach send() as state (gr.State is no API parameter): /chat keeps its 12 inputs.
    speech = gr.State({"voice": voices[0] if voices else None, "reply_as": "text+audio", "audio": None})

    def keep_speech(voice_v: str | None, reply_as_v: str, audio_v: str | None) -> dict[str, Any]:
        return {"voice": voice_v, "reply_as": reply_as_v, "audio": audio_v}

    for control in (voice, reply_as, audio_in):
        control.change(keep_speech, [voice, reply_as, audio_in], [speech], api_visibility="private")
    last_image = gr.State(None)

    # What send() updates, in order; out(name=value) leaves the others as they are.
    # (the status stays last: API clients of /chat read it as the last value)
    output_names: tuple[str, ...] = ("chatbot", "message", "progress", "preview", "run_id", "last_image")
    output_names += ("speaker", "audio_in", "status")

    def out(**changes: Any) -> tuple[Any, ...]:
        return tuple(changes.get(name, gr.skip()) for name in output_names)

    async def send(
        message_value,
        history,
        seed_v,
        width_v,
        height_v,
        steps_v,
        guidance_v,
        negative_v,
        max_tokens_v,
        temperature_v,
        modalities_v,
        preview_every_v,
        speech_v,
        request: gr.Request,
    ):
        history = list(history or [])
        speech_v = speech_v or {}
        voice_v, reply_as_v, audio_v = speech_v.get("voice"), speech_v.get("reply_as"), speech_v.get("audio")
        text = (message_value or {}).get("text", "") or ""
        files = (message_value or {}).get("files") or []
        user_content: list[Any] = []
        if files:
            user_content.append({"path": files[-1]["path"] if isinstance(files[-1], dict) else files[-1]})
        speaking = studio.speaks
        if audio_v and speaking:
            user_content.append({"path": audio_v})
        if text:
            user_content.append(text)
        if not user_content:
            yield out(
                chatbot=history, progress=render_progress({}), run_id=None, status="Type a prompt first."
            )
            return
        labels = speech_labels(studio)
        try:
            engine_request = build_request(
                studio,
                message_value,
                history,
                seed_v,
                width_v,
                height_v,
                steps_v,
                guidance_v,
                negative_v,
                max_tokens_v,
                temperature_v,
                modalities_v,
                preview_every_v,
                voice_v,
                reply_as_v,
                audio_v if speaking else None,
            )
            resolved = studio.resolve(engine_request)
        except (RequestError, AudioError) as exc:
            history += [
                {"role": "user", "content": user_content},
                {"role": "assistant", "content": f"⚠️ {exc.field}: {getattr(exc, 'message', exc)}"},
            ]
            note = f"**Error** — {exc}"
            yield out(
                chatbot=history,
                message=None,
                progress=render_progress({}),
                preview=None,
                run_id=None,
                status=note,
            )
            return
        history += [{"role": "user", "content": user_content}, {"role": "assistant", "content": ""}]
        stages: dict[int, dict[str, Any]] = {}
        streamed = ""
        spoken = speaker_start(resolved.request_id)
        chunks = 0
        last_update = 0.0
        yield out(
            chatbot=history,
            message=None,
            progress=render_progress(stages, labels),
            preview=None,
            run_id=resolved.request_id,
            status=f"Running… seed {resolved.seed}",
            **({"speaker": spoken, "audio_in": None} if speaking else {}),
        )
        runs = studio.run(
            resolved,
            {"source": "studio chat", "prompt": text, "parameters": resolved.parameters},
            session=getattr(request, "session_hash", None),
        )
        try:
            async for rid, event in runs:
                if isinstance(event, Queued):
                    yield out(run_id=rid, status=queued_status(event, resolved.seed))
                elif isinstance(event, StageStarted):
                    track_stages(stages, event)
                    running = f"Running… seed {resolved.seed}"
                    yield out(progress=render_progress(stages, labels), run_id=rid, status=running)
                elif isinstance(event, (TokenProgress, DiffusionStep)):
                    track_stages(stages, event)
                    preview = event.preview if isinstance(event, DiffusionStep) else None
                    has_preview = preview is not None
                    now = time.monotonic()
                    if has_preview or now - last_update >= UI_UPDATE_INTERVAL_S:
                        last_update = now
                        preview_update = preview if has_preview else gr.skip()
                        yield out(
                            progress=render_progress(stages, labels), preview=preview_update, run_id=rid
                        )
                elif isinstance(event, AudioDelta):
                    if event.samples.size:  # every chunk goes out at once: it is sound the listener waits for
                        spoken += speaker_chunk(chunks, event)
                        chunks += 1
                        yield out(speaker=spoken, run_id=rid)
                elif isinstance(event, TextDelta):
                    streamed += event.text
                    history[-1] = {"role": "assistant", "content": streamed}
                    now = time.monotonic()
                    if now - last_update >= UI_UPDATE_INTERVAL_S / 4:
                        last_update = now
                        yield out(chatbot=history, run_id=rid)
                elif isinstance(event, StageFinished):
                    track_stages(stages, event)
                    yield out(progress=render_progress(stages, labels), run_id=rid)
                elif isinstance(event, RunFinished):
                    content: list[Any] = []
                    if event.text:
                        content.append(event.text)
                    image_path = None
                    for image in event.images:
                        image_path = studio.keep_image(image)
                        content.append({"path": image_path, "alt_text": f"seed {event.outputs[0].seed}"})
                    for output in event.outputs:
                        if output.audio is not None and output.audio.size:
                            content.append(
                                {"path": studio.keep_audio(output), "alt_text": f"seed {output.seed}"}
                            )
                    history[-1] = {"role": "assistant", "content": content or "(no output)"}
                    seconds = sum(s.get("seconds") or 0 for s in stages.values())
                    yield out(
                        chatbot=history,
                        progress=render_progress(stages, labels),
                        run_id=None,
                        last_image=image_path,
                        status=f"Done in {seconds:.2f} s · seed {resolved.seed} · run `{rid[:12]}`",
                        **({"speaker": spoken + speaker_end("done")} if speaking else {}),
                    )
                elif isinstance(event, RunFailed):
                    note = "⏹ Stopped." if event.cancelled else f"⚠️ {event.message}"
                    history[-1] = {"role": "assistant", "content": note}
                    yield out(
                        chatbot=history,
                        progress=render_progress(stages, labels),
                        run_id=None,
                        status=note,
                        **({"speaker": spoken + speaker_end("stopped")} if speaking else {}),
                    )

        except RunRejected as exc:
            history[-1] = {"role": "assistant", "content": f"⚠️ {exc.message}"}
            yield out(
                chatbot=history, progress=render_progress({}), run_id=None, status=f"**Busy** — {exc.message}"
            )
        finally:
            await runs.aclose()

    inputs = [message, chatbot, seed, width, height, steps, guidance, negative, max_tokens, temperature]
    inputs += [modalities, preview_every, speech]
    outputs = [chatbot, message, progress, preview, run_id, last_image, speaker, audio_in, status]
    message.submit(send, inputs, outputs, api_name="chat", show_progress="hidden", concurrency_id="generate")

    def stop_run(current: str | None) -> Any:
        # Cancelling the engine request (not the Gradio event) lets the run end on its own terms: the
        # conversation shows "Stopped" and the run is recorded as cancelled.
        # The run's own stream then says "Stopped"; a "Stopping…" from here could reach the page after it
        # (two events, one status line) and stay, so a cancel that took writes nothing.
        return gr.skip() if studio.cancel(current) else "Nothing is running."

    stop.click(stop_run, [run_id], [status], api_name="stop")

    def source_from_result(path: str | None, message_value: dict[str, Any] | None):
        if not path or not Path(path).exists():
            return gr.skip(), "No result image yet."
        text = (message_value or {}).get("text", "")
        return {"text": text, "files": [path]}, "The last result is the source image of the next prompt."

    to_source.click(source_from_result, [last_image, message], [message, status], api_name="send_to_source")
    recipe_fields = {"message": message, "seed": seed, "width": width, "height": height, "steps": steps}
    recipe_fields.update(guidance=guidance, negative=negative, modalities=modalities, model=model)
    recipe_fields.update(voice=voice, reply_as=reply_as, max_tokens=max_tokens)
    connect_recipe_drop(studio, recipe_drop, recipe_fields)
    clear.click(
        lambda: ([], render_progress({}), None), None, [chatbot, progress, preview], api_visibility="private"
    )

    def change_model(name: str, request: gr.Request):
        if not name or name == studio.model.name:
            return gr.skip()
        refused = studio.admin_refusal(getattr(request, "username", None), "switch the model")
        if refused:  # with accounts only an admin switches what everyone runs (docs/team.md)
            return f"**Model not switched** — {refused}."
        report = studio.switch_model(name)
        if not report.ok:
            return "**Model not switched** — " + "; ".join(str(p) for p in report.problems)
        return f"Now serving **{studio.model.name}** ({studio.config.family}), config `{studio.config.hash8}`"

    def sync_defaults():
        """The running pipeline's defaults (after Apply or a model switch): the next run uses them; a model
        that speaks shows its speech controls (its voices) instead of the image ones."""
        stage = next((s for s in studio.config.stages if s.kind == "diffusion"), None)
        params = stage.default_sampling_params if stage else {}
        speaks, voices = studio.speaks, studio.voices()
        return (
            gr.update(value=params.get("width", 64)),
            gr.update(value=params.get("height", 64)),
            gr.update(value=params.get("num_inference_steps", 4)),
            gr.update(value=params.get("guidance_scale", 1.5)),
            gr.update(value=studio.model.name),
            gr.update(visible=speaks),  # the voice and "reply with" row
            gr.update(choices=voices, value=voices[0] if voices else None),
            *(gr.update(visible=speaks) for _ in (audio_in, speaker)),
            *(gr.update(visible=not speaks) for _ in (size_row, negative, modalities, preview_every)),
            *(gr.update(visible=not speaks) for _ in (preview, to_source)),
            gr.update(placeholder=PLACEHOLDERS[speaks]),
        )

    def note(width_v: float, height_v: float, steps_v: float) -> str:
        """What the model supports, with a visible warning when the size or steps are outside it."""
        return studio.support_note(width_v, height_v, steps_v)

    for slider in (width, height, steps):
        slider.change(note, [width, height, steps], [size_note], api_visibility="private")

    defaults_outputs = [width, height, steps, guidance, model, speech_row, voice, audio_in, speaker]
    defaults_outputs += [size_row, negative, modalities, preview_every, preview, to_source, message]
    switch_event = model.input(change_model, [model], [status], api_name="switch_model").then(
        sync_defaults, None, defaults_outputs, api_visibility="private"
    )
    return {
        "chatbot": chatbot,
        "message": message,
        "progress": progress,
        "preview": preview,
        "speaker": speaker,
        "status": status,
        "model": model,
        "sync_defaults": sync_defaults,
        "defaults_outputs": defaults_outputs,
        "switch_event": switch_event,
    }
