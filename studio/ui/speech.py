"""The Speech tab: text in, a voice, a format, a speed and a seed; the speech played as it is made, then
the file to play and download, its waveform and its figures (docs/speech.md "In the studio").

It makes the request ``POST /v1/audio/speech`` makes (``studio.runs.speech``: the thinker says the text,
the talker and code2wav voice it) and records it the same way, in the API's field names, with source
``studio speech``. A model that does not speak gets a note naming the models that do.
"""

from __future__ import annotations

import hashlib
import tempfile
import time
from pathlib import Path
from typing import Any

import gradio as gr

from engine import RequestError
from engine.events import PROGRESS_EVENTS, AudioDelta, RunFailed, RunFinished
from engine.modality import format_output_modalities
from engine.tempo import MAX_SPEED, MIN_SPEED
from studio.controller import Studio
from studio.media.audio import AUDIO_FORMATS, AudioError, encode_audio, waveform_png
from studio.recipes.recipe import audio_recipe
from studio.runs.service import Queued, RunRejected
from studio.runs.speech import speech_input_problem, speech_payload, speech_request
from studio.ui.chat import (
    UI_UPDATE_INTERVAL_S,
    queued_status,
    render_progress,
    speech_labels,
    track_stages,
)
from studio.ui.speaker import SPEAKER_IDLE, speaker_chunk, speaker_end, speaker_js, speaker_start

FORMATS = ("wav", "flac", "mp3", "opus")  # what a browser plays and a person downloads (pcm is for programs)
WAVEFORM_SIZE = (720, 120)


def not_speaking_note(studio: Studio) -> str:
    if studio.speaks:
        return ""
    speakers = [m for m in studio.builtin_models() if "omni" in m] or ["tiny-qwen-omni"]
    return (
        f"**{studio.model.name}** does not speak (it makes "
        f"{format_output_modalities(studio.engine.family.final_modalities(studio.config))}). "
        f"Switch to a model that does in the Chat tab's model picker: {', '.join(speakers)}."
    )


def figures(
    seconds: float, fmt: str, first_audio: float | None, elapsed: float, run_id: str, seed: int
) -> str:
    """The status line of a finished utterance: length, format, TTFP and real-time factor as measured here
    (the run's recorded figures are History's), seed and run."""
    parts = [f"**{seconds:.2f} s** of audio · {fmt}"]
    if first_audio is not None:
        parts.append(f"first audio after {first_audio:.2f} s")
    if seconds:
        parts.append(f"real-time factor {elapsed / seconds:.2f}")
    parts += [f"seed {seed}", f"run `{run_id[:12]}`"]
    return " · ".join(parts)


def build_speech_tab(studio: Studio) -> dict[str, Any]:
    voices = studio.voices()
    code2wav = next((s for s in studio.config.stages if s.kind == "diffusion"), None)
    default_steps = int((code2wav.default_sampling_params if code2wav else {}).get("num_inference_steps", 10))
    note = gr.Markdown(not_speaking_note(studio), elem_id="omni-speech-note")
    with gr.Row(equal_height=False):
        with gr.Column(scale=3):
            text = gr.Textbox(
                label="Text to speak",
                lines=4,
                placeholder="What the voice says, word for word",
                elem_id="omni-speech-input",
            )
            instructions = gr.Textbox(
                label="Instructions (optional: how to say it, before the text)",
                lines=1,
                elem_id="omni-speech-instructions",
            )
            with gr.Row():
                voice = gr.Dropdown(
                    voices, value=voices[0] if voices else None, label="Voice", elem_id="omni-speech-voice"
                )
                fmt = gr.Dropdown(list(FORMATS), value="wav", label="Format", elem_id="omni-speech-format")
                seed = gr.Number(value=-1, precision=0, label="Seed (-1: random)", elem_id="omni-speech-seed")
            with gr.Row():
                speed = gr.Slider(
                    MIN_SPEED,
                    MAX_SPEED,
                    value=1.0,
                    step=0.05,
                    label="Speed (the pitch kept)",
                    elem_id="omni-speech-speed",
                )
                steps = gr.Slider(
                    2, 100, value=default_steps, step=1, label="code2wav steps", elem_id="omni-speech-steps"
                )
            with gr.Row():
                go = gr.Button("Speak", variant="primary", elem_id="omni-speech-go")
                stop = gr.Button("Stop", variant="stop", elem_id="omni-speech-stop")
            status = gr.Markdown("", elem_id="omni-speech-status")
        with gr.Column(scale=2):
            progress = gr.HTML(render_progress({}), label="Progress", elem_id="omni-speech-progress")
            speaker = gr.HTML(
                SPEAKER_IDLE, js_on_load=speaker_js("omni-speech-stop"), elem_id="omni-speech-live"
            )
            audio = gr.Audio(
                label="Speech",
                type="filepath",
                interactive=False,
                buttons=["download"],
                elem_id="omni-speech-audio",
            )
            download = gr.File(label="Download", interactive=False, elem_id="omni-speech-file")
            waveform = gr.Image(
                label="Waveform",
                type="filepath",
                interactive=False,
                height=140,
                elem_id="omni-speech-waveform",
            )
    run_id = gr.State(None)

    def out(**changes: Any) -> tuple[Any, ...]:
        names = ("progress", "speaker", "audio", "download", "waveform", "run_id", "status")
        return tuple(changes.get(name, gr.skip()) for name in names)

    async def speak(
        text_v: str,
        instructions_v: str,
        voice_v: str | None,
        fmt_v: str,
        seed_v: float | None,
        speed_v: float,
        steps_v: float,
        request: gr.Request,
    ):
        text_v = text_v or ""
        problem = (
            not_speaking_note(studio)
            or speech_input_problem(text_v, studio.serving.options.limits.max_speech_chars)
            or (None if fmt_v in FORMATS else f"format must be one of {', '.join(FORMATS)}, got {fmt_v!r}")
        )
        if problem:
            yield out(progress=render_progress({}), run_id=None, status=f"**Error** — {problem}")
            return
        seed_i = None if seed_v is None or seed_v < 0 else int(seed_v)
        try:
            resolved = studio.resolve(
                speech_request(
                    text_v,
                    voice=voice_v or None,
                    speed=float(speed_v),
                    seed=seed_i,
                    instructions=instructions_v or None,
                    num_inference_steps=int(steps_v),
                )
            )
        except RequestError as exc:
            yield out(progress=render_progress({}), run_id=None, status=f"**Error** — {exc}")
            return
        payload = speech_payload(
            text_v,
            voice=resolved.parameters.get("voice"),
            response_format=fmt_v,
            speed=float(speed_v),
            seed=seed_i,
            instructions=instructions_v or None,
        )
        labels = speech_labels(studio)
        stages: dict[int, dict[str, Any]] = {}
        spoken, chunks, last_update = speaker_start(resolved.request_id), 0, 0.0
        started, first_audio = time.monotonic(), None
        yield out(
            progress=render_progress(stages, labels),
            speaker=spoken,
            audio=None,
            download=None,
            waveform=None,
            run_id=resolved.request_id,
            status=f"Speaking… seed {resolved.seed}",
        )
        runs = studio.run(
            resolved,
            {"source": "studio speech", "prompt": resolved.request.prompt, **payload},
            session=getattr(request, "session_hash", None),
        )
        try:
            async for rid, event in runs:
                if isinstance(event, Queued):
                    yield out(run_id=rid, status=queued_status(event, resolved.seed))
                elif track_stages(stages, event):
                    now = time.monotonic()
                    if not isinstance(event, PROGRESS_EVENTS) or now - last_update >= UI_UPDATE_INTERVAL_S:
                        last_update = now
                        yield out(progress=render_progress(stages, labels), run_id=rid)
                elif isinstance(event, AudioDelta):
                    if event.samples.size:
                        first_audio = first_audio if first_audio is not None else time.monotonic() - started
                        spoken += speaker_chunk(chunks, event)
                        chunks += 1
                        yield out(speaker=spoken, run_id=rid)
                elif isinstance(event, RunFinished):
                    elapsed = time.monotonic() - started
                    output = event.outputs[0]
                    if output.audio is None or not output.audio.size:
                        yield out(
                            speaker=spoken + speaker_end("done"),
                            run_id=None,
                            status="The model said nothing (0 samples): try another seed.",
                        )
                        continue
                    path = keep_file(studio, output, fmt_v)
                    picture = keep_waveform(output)
                    seconds = output.audio.size / output.sample_rate
                    yield out(
                        progress=render_progress(stages, labels),
                        speaker=spoken + speaker_end("done"),
                        audio=path,
                        download=path,
                        waveform=picture,
                        run_id=None,
                        status=figures(seconds, fmt_v, first_audio, elapsed, rid, output.seed),
                    )
                elif isinstance(event, RunFailed):
                    message = "⏹ Stopped." if event.cancelled else f"⚠️ {event.message}"
                    yield out(
                        progress=render_progress(stages, labels),
                        speaker=spoken + speaker_end("stopped"),
                        run_id=None,
                        status=message,
                    )
        except RunRejected as exc:
            yield out(progress=render_progress({}), run_id=None, status=f"**Busy** — {exc.message}")
        finally:
            await runs.aclose()

    inputs = [text, instructions, voice, fmt, seed, speed, steps]
    outputs = [progress, speaker, audio, download, waveform, run_id, status]
    go.click(speak, inputs, outputs, api_name="speak", show_progress="hidden", concurrency_id="generate")
    text.submit(
        speak, inputs, outputs, api_visibility="private", show_progress="hidden", concurrency_id="generate"
    )

    def stop_run(current: str | None) -> Any:
        # The run's own stream then says "Stopped"; a "Stopping…" from here could reach the page after it
        # (two events, one status line) and stay, so a cancel that took writes nothing.
        return gr.skip() if studio.cancel(current) else "Nothing is running."

    stop.click(stop_run, [run_id], [status], api_name="speech_stop")

    def sync() -> tuple[Any, ...]:
        """After a model switch or Apply: the running model's voices, and the note when it does not speak."""
        voices_now = studio.voices()
        return gr.update(value=not_speaking_note(studio)), gr.update(
            choices=voices_now, value=voices_now[0] if voices_now else None
        )

    return {"sync": sync, "sync_outputs": [note, voice], "status": status}


def keep_file(studio: Studio, output: Any, fmt: str) -> str:
    """The utterance as a ``fmt`` file (WAV and FLAC with the recipe inside); its path. The WAV is the
    very file the run keeps in the store; other formats are made for the download, beside the waveforms."""
    if fmt == "wav":
        return studio.keep_audio(output)
    spec = AUDIO_FORMATS[fmt]
    recipe = audio_recipe(output) if spec.carries_recipe else None
    try:
        data = encode_audio(output.audio, output.sample_rate, fmt, recipe)
    except AudioError as exc:
        raise gr.Error(f"could not encode the audio as {fmt}: {exc}") from exc
    return write_once(data, f"speech-seed{output.seed}", spec.extension)


def keep_waveform(output: Any) -> str:
    """A PNG of the utterance's waveform; its path."""
    picture = waveform_png(output.audio, output.sample_rate, *WAVEFORM_SIZE)
    return write_once(picture, "waveform", ".png")


def write_once(data: bytes, stem: str, extension: str) -> str:
    """``data`` in the studio's temporary files, named by its stem and hash (written once per content)."""
    digest = hashlib.sha256(data).hexdigest()[:16]
    target = Path(tempfile.gettempdir()) / "omni-studio-speech" / f"{stem}-{digest}{extension}"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)
    return str(target)
