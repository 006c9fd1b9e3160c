"""The Chat tab: multimodal prompt, generation parameters, streamed text, per-stage progress, live
diffusion previews, the final image in the conversation, Stop, and "send to source image"."""

from __future__ import annotations

import html
import time
from pathlib import Path
from typing import Any

import gradio as gr
from PIL import Image

from engine import ChatTurn, GenerationRequest, RequestError
from engine.events import (
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
from studio.controller import Studio
from studio.runs.service import Queued, RunRejected
from studio.ui.recipe import build_recipe_drop, connect_recipe_drop

# The UI coalesces progress: every yield costs the (GIL-sharing) server a diff and a message, and the tiny
# models make thousands of tokens a second.
UI_UPDATE_INTERVAL_S = 0.2


def render_progress(stages: dict[int, dict[str, Any]]) -> str:
    """One bar per stage: what it is, how far, how long."""
    if not stages:
        return "<div class='omni-progress idle'>Idle</div>"
    rows = []
    for sid in sorted(stages):
        s = stages[sid]
        unit = "tokens" if s["kind"] == "ar" else "steps"
        total = max(int(s.get("total") or 0), 1)
        step = min(int(s.get("step") or 0), total)
        status = s.get("status", "running")
        seconds = f" · {s['seconds']:.2f} s" if s.get("seconds") is not None else ""
        rows.append(
            f"<div class='omni-stage {status}' data-stage='{sid}' data-status='{status}'>"
            f"<span class='omni-stage-label'>stage {sid} · {html.escape(s['kind'])}</span>"
            f"<progress max='{total}' value='{step}'></progress>"
            f"<span class='omni-stage-count'>{step}/{total} {unit} · {status}{seconds}</span></div>"
        )
    return "<div class='omni-progress'>" + "".join(rows) + "</div>"


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
) -> GenerationRequest:
    """The engine request for the UI's current inputs (the same params the API builds)."""
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
    with gr.Row(equal_height=False):
        with gr.Column(scale=3):
            chatbot = gr.Chatbot(label="Conversation", height=460, elem_id="omni-chatbot", buttons=["copy"])
            message = gr.MultimodalTextbox(
                placeholder="Describe an image (attach a source image for image-to-image) and press Enter",
                file_types=["image"],
                file_count="single",
                sources=["upload"],
                show_label=False,
                elem_id="omni-message",
            )
            with gr.Row():
                stop = gr.Button("Stop", variant="stop", elem_id="omni-stop")
                to_source = gr.Button("Send result to source image", elem_id="omni-to-source")
                clear = gr.Button("Clear conversation", elem_id="omni-clear")
            status = gr.Markdown("", elem_id="omni-chat-status")
        with gr.Column(scale=2):
            progress = gr.HTML(render_progress({}), label="Progress", elem_id="omni-progress")
            preview = gr.Image(
                label="Diffusion preview", type="pil", interactive=False, height=256, elem_id="omni-preview"
            )
            recipe_drop = build_recipe_drop()  # "Load recipe from PNG" (studio/ui/recipe.py)
            with gr.Accordion("Parameters", open=True):
                model = gr.Dropdown(
                    studio.builtin_models(),
                    value=studio.model.name,
                    label="Model",
                    allow_custom_value=True,
                    elem_id="omni-model",
                )
                seed = gr.Number(value=-1, precision=0, label="Seed (-1: random)", elem_id="omni-seed")
                with gr.Row():
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
                negative = gr.Textbox(label="Negative prompt", lines=1)
                with gr.Row():
                    max_tokens = gr.Slider(1, 1024, value=64, step=1, label="Max tokens (text models)")
                    temperature = gr.Slider(0, 2, value=0.8, step=0.05, label="Temperature (text models)")
                modalities = gr.CheckboxGroup(
                    ["text", "image", "token_ids"],
                    label="Output modalities (empty: what the pipeline's final stage produces)",
                    elem_id="omni-modalities",
                )
                preview_every = gr.Slider(0, 10, value=1, step=1, label="Preview every k steps (0: none)")
    run_id = gr.State(None)
    last_image = gr.State(None)

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
        request: gr.Request,
    ):
        history = list(history or [])
        text = (message_value or {}).get("text", "") or ""
        files = (message_value or {}).get("files") or []
        user_content: list[Any] = []
        if files:
            user_content.append({"path": files[-1]["path"] if isinstance(files[-1], dict) else files[-1]})
        if text:
            user_content.append(text)
        if not user_content:
            yield history, gr.skip(), render_progress({}), gr.skip(), None, gr.skip(), "Type a prompt first."
            return
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
            )
            resolved = studio.resolve(engine_request)
        except RequestError as exc:
            history += [
                {"role": "user", "content": user_content},
                {"role": "assistant", "content": f"⚠️ {exc.field}: {exc.message}"},
            ]
            yield history, None, render_progress({}), None, None, gr.skip(), f"**Error** — {exc}"
            return
        history += [{"role": "user", "content": user_content}, {"role": "assistant", "content": ""}]
        stages: dict[int, dict[str, Any]] = {}
        streamed = ""
        last_update = 0.0
        yield (
            history,
            None,
            render_progress(stages),
            None,
            resolved.request_id,
            gr.skip(),
            f"Running… seed {resolved.seed}",
        )
        runs = studio.run(
            resolved,
            {"source": "studio chat", "prompt": text, "parameters": resolved.parameters},
            session=getattr(request, "session_hash", None),
        )
        try:
            async for rid, event in runs:
                if isinstance(event, Queued):
                    ahead = f"{event.ahead} ahead of you" if event.ahead else "next in line"
                    note = f"Queued… {ahead} · seed {resolved.seed}"
                    yield gr.skip(), gr.skip(), gr.skip(), gr.skip(), rid, gr.skip(), note
                elif isinstance(event, StageStarted):
                    stages[event.stage_id] = {
                        "kind": event.kind,
                        "step": 0,
                        "total": event.total,
                        "status": "running",
                    }
                    running = f"Running… seed {resolved.seed}"
                    yield gr.skip(), gr.skip(), render_progress(stages), gr.skip(), rid, gr.skip(), running
                elif isinstance(event, (TokenProgress, DiffusionStep)):
                    stage = stages.setdefault(event.stage_id, {"kind": "", "status": "running"})
                    stage.update(step=event.step, total=event.total)
                    preview = event.preview if isinstance(event, DiffusionStep) else None
                    has_preview = preview is not None
                    now = time.monotonic()
                    if has_preview or now - last_update >= UI_UPDATE_INTERVAL_S:
                        last_update = now
                        preview_update = preview if has_preview else gr.skip()
                        yield (
                            gr.skip(),
                            gr.skip(),
                            render_progress(stages),
                            preview_update,
                            rid,
                            gr.skip(),
                            gr.skip(),
                        )
                elif isinstance(event, TextDelta):
                    streamed += event.text
                    history[-1] = {"role": "assistant", "content": streamed}
                    now = time.monotonic()
                    if now - last_update >= UI_UPDATE_INTERVAL_S / 4:
                        last_update = now
                        yield history, gr.skip(), gr.skip(), gr.skip(), rid, gr.skip(), gr.skip()
                elif isinstance(event, StageFinished):
                    stage = stages.setdefault(event.stage_id, {"kind": event.kind})
                    stage.update(status=event.status, seconds=event.seconds)
                    if event.status == "succeeded":
                        stage["step"] = stage.get("total", 0)
                    yield gr.skip(), gr.skip(), render_progress(stages), gr.skip(), rid, gr.skip(), gr.skip()
                elif isinstance(event, RunFinished):
                    content: list[Any] = []
                    if event.text:
                        content.append(event.text)
                    image_path = None
                    for image in event.images:
                        image_path = studio.keep_image(image)
                        content.append({"path": image_path, "alt_text": f"seed {event.outputs[0].seed}"})
                    history[-1] = {"role": "assistant", "content": content or "(no output)"}
                    seconds = sum(s.get("seconds") or 0 for s in stages.values())
                    yield (
                        history,
                        gr.skip(),
                        render_progress(stages),
                        gr.skip(),
                        None,
                        image_path,
                        f"Done in {seconds:.2f} s · seed {resolved.seed} · run `{rid[:12]}`",
                    )
                elif isinstance(event, RunFailed):
                    note = "⏹ Stopped." if event.cancelled else f"⚠️ {event.message}"
                    history[-1] = {"role": "assistant", "content": note}
                    yield history, gr.skip(), render_progress(stages), gr.skip(), None, gr.skip(), note

        except RunRejected as exc:
            history[-1] = {"role": "assistant", "content": f"⚠️ {exc.message}"}
            yield (
                history,
                gr.skip(),
                render_progress({}),
                gr.skip(),
                None,
                gr.skip(),
                f"**Busy** — {exc.message}",
            )
        finally:
            await runs.aclose()

    inputs = [
        message,
        chatbot,
        seed,
        width,
        height,
        steps,
        guidance,
        negative,
        max_tokens,
        temperature,
        modalities,
        preview_every,
    ]
    outputs = [chatbot, message, progress, preview, run_id, last_image, status]
    message.submit(send, inputs, outputs, api_name="chat", show_progress="hidden", concurrency_id="generate")

    def stop_run(current: str | None) -> str:
        # Cancelling the engine request (not the Gradio event) lets the run end on its own terms: the
        # conversation shows "Stopped" and the run is recorded as cancelled.
        return "⏹ Stopping…" if studio.cancel(current) else "Nothing is running."

    stop.click(stop_run, [run_id], [status], api_name="stop")

    def source_from_result(path: str | None, message_value: dict[str, Any] | None):
        if not path or not Path(path).exists():
            return gr.skip(), "No result image yet."
        text = (message_value or {}).get("text", "")
        return {"text": text, "files": [path]}, "The last result is the source image of the next prompt."

    to_source.click(source_from_result, [last_image, message], [message, status], api_name="send_to_source")
    recipe_fields = {"message": message, "seed": seed, "width": width, "height": height, "steps": steps}
    recipe_fields.update(guidance=guidance, negative=negative, modalities=modalities, model=model)
    connect_recipe_drop(studio, recipe_drop, recipe_fields)
    clear.click(
        lambda: ([], render_progress({}), None), None, [chatbot, progress, preview], api_visibility="private"
    )

    def change_model(name: str):
        if not name or name == studio.model.name:
            return gr.skip()
        report = studio.switch_model(name)
        if not report.ok:
            return "**Model not switched** — " + "; ".join(str(p) for p in report.problems)
        return f"Now serving **{studio.model.name}** ({studio.config.family}), config `{studio.config.hash8}`"

    def sync_defaults():
        """The running pipeline's defaults (after Apply or a model switch): the next run uses them."""
        stage = next((s for s in studio.config.stages if s.kind == "diffusion"), None)
        params = stage.default_sampling_params if stage else {}
        return (
            gr.update(value=params.get("width", 64)),
            gr.update(value=params.get("height", 64)),
            gr.update(value=params.get("num_inference_steps", 4)),
            gr.update(value=params.get("guidance_scale", 1.5)),
            gr.update(value=studio.model.name),
        )

    def note(width_v: float, height_v: float, steps_v: float) -> str:
        """What the model supports, with a visible warning when the size or steps are outside it."""
        return studio.support_note(width_v, height_v, steps_v)

    for slider in (width, height, steps):
        slider.change(note, [width, height, steps], [size_note], api_visibility="private")

    defaults_outputs = [width, height, steps, guidance, model]
    switch_event = model.input(change_model, [model], [status], api_name="switch_model").then(
        sync_defaults, None, defaults_outputs, api_visibility="private"
    )
    return {
        "chatbot": chatbot,
        "message": message,
        "progress": progress,
        "preview": preview,
        "status": status,
        "model": model,
        "sync_defaults": sync_defaults,
        "defaults_outputs": defaults_outputs,
        "switch_event": switch_event,
    }
