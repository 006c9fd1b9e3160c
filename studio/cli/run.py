"""``omni-studio run``: one request in this process, with progress bars, written to files.

Pictures are written as PNG, speech in the format the ``--out`` file's extension names (docs/speech.md
"Runs, files and the CLI"), text to ``--out`` or the terminal; every file carries the run's recipe where
its format can hold one, and the run is recorded in the history like one from the UI or the API.
"""

from __future__ import annotations

import argparse
import base64
import io
import sys
from pathlib import Path
from typing import Any

from studio.errors import UserError
from studio.startup.limits import InputLimits
from studio.startup.settings import StudioSettings


def load_image_source(source: str):
    """A PIL image from a file path or a ``data:image/...;base64,`` URL."""
    from PIL import Image, UnidentifiedImageError

    try:
        if source.startswith("data:"):
            header, _, payload = source.partition(",")
            if ";base64" not in header:
                raise UserError("--image: data URLs must be base64 encoded (data:image/png;base64,...)")
            data = base64.b64decode(payload, validate=True)
            image = Image.open(io.BytesIO(data))
        else:
            path = Path(source).expanduser()
            if not path.is_file():
                raise UserError(f"--image: no such file: {source}")
            image = Image.open(path)
        image.load()
        return image
    except (UnidentifiedImageError, ValueError, OSError) as exc:
        raise UserError(f"--image: not a readable image ({exc})") from exc


RUN_REQUEST_FIELDS = (
    "prompt",
    "image",
    "seed",
    "height",
    "width",
    "steps",
    "guidance",
    "negative_prompt",
    "max_tokens",
    "temperature",
    "voice",
    "speed",
    "speak_text",
    "modalities",
    "n",
    "model",
    "deploy_config",
    "ar_backend",
    "devices",
)


def check_run_limits(parameters: dict[str, Any], limits: InputLimits) -> None:
    """``n``, steps and image sides of a CLI run against ``--max-n``, ``--max-steps``, ``--max-image-side``."""
    for key, limit, flag in (
        ("n", limits.max_n, "--max-n"),
        ("num_inference_steps", limits.max_steps, "--max-steps"),
        ("height", limits.max_image_side, "--max-image-side"),
        ("width", limits.max_image_side, "--max-image-side"),
    ):
        value = parameters.get(key)
        if isinstance(value, int) and value > limit:
            raise UserError(f"{key} is {value}; the limit is {limit} ({flag})")


# What --modalities takes: the output kinds a person asks for (latent and token_ids are the stages' own).
CLI_MODALITIES = ("text", "image", "audio")


def parse_modalities(value: str | None) -> tuple[Any, ...] | None:
    """``--modalities`` as engine modalities (``None``: the model's default); :class:`UserError` naming the
    flag and the allowed values for anything else."""
    from engine.modality import ModalityError, OutputModality, parse_output_modalities

    if value is None:
        return None
    allowed = f"use {', '.join(CLI_MODALITIES)} or a combination joined by '+' (e.g. text+audio)"
    try:
        modalities = parse_output_modalities(value)
    except ModalityError as exc:
        raise UserError(f"--modalities: {exc}") from None
    extra = [m.value for m in modalities if m.value not in CLI_MODALITIES]
    if extra:
        raise UserError(f"--modalities: {', '.join(extra)} is not an output a run can ask for; {allowed}")
    return tuple(OutputModality(m) for m in modalities)


def audio_out_format(out: str | None, model_name: str) -> str:
    """The audio format ``--out``'s extension picks for a run that speaks (:class:`UserError` when there is
    no ``--out`` or its extension is not an audio format's, naming the allowed ones)."""
    from studio.media.audio import AudioError, format_for_filename

    if not out:
        raise UserError(
            f"--out FILE is required: {model_name} speaks (e.g. --out hi.wav; or --modalities text for "
            "its text alone)"
        )
    try:
        return format_for_filename(out)
    except AudioError as exc:
        raise UserError(str(exc)) from None


def cmd_run(args: argparse.Namespace, settings: StudioSettings) -> int:
    from engine import GenerationParams, GenerationRequest, RequestError
    from engine.environment import StartupCollection
    from engine.events import RunFailed
    from engine.modality import OutputModality
    from studio.cli.progress import StageProgressBars, stage_labels
    from studio.media.audio import EXTENSIONS as AUDIO_EXTENSIONS
    from studio.runs.service import RunService
    from studio.startup.launch import close_recorder, open_recorder, start_engine

    if args.recipe:
        from studio.cli.recipe import apply_recipe

        settings = apply_recipe(args, settings)
    if args.prompt is None:
        raise UserError("give a PROMPT, or --recipe FILE to re-run the recipe of a PNG, WAV or FLAC")
    image = load_image_source(args.image) if args.image else None
    modalities = parse_modalities(args.modalities)
    with StartupCollection():  # engine/environment.py
        engine = start_engine(settings)
    recorder = None
    try:
        request = GenerationRequest(
            args.prompt,
            GenerationParams(
                seed=args.seed,
                height=args.height,
                width=args.width,
                num_inference_steps=args.steps,
                guidance_scale=args.guidance,
                negative_prompt=args.negative_prompt,
                max_tokens=args.max_tokens,
                temperature=args.temperature,
                n=args.n,
                voice=args.voice,
                speed=args.speed,
            ),
            image=image,
            modalities=modalities,
            speak_text=args.speak_text,
        )
        runs = RunService(None, "cli", limits=settings.limits)
        try:
            resolved = runs.resolve(engine, request)
        except RequestError as exc:
            raise UserError(str(exc)) from exc
        check_run_limits(resolved.parameters, settings.limits)
        for warning in resolved.warnings:  # outside what the model supports: it runs, but say so
            print(f"omni-studio run: warning: {warning}", file=sys.stderr)
        makes_images = OutputModality.IMAGE in resolved.modalities
        if makes_images and not args.out:
            raise UserError(f"--out FILE is required: {engine.config.model_name} makes images")
        audio_format = None
        if OutputModality.AUDIO in resolved.modalities:
            audio_format = audio_out_format(args.out, engine.config.model_name)
        elif args.out and Path(args.out).suffix.lower() in AUDIO_EXTENSIONS:
            raise UserError(
                f"--out {args.out}: an audio file, but this run makes no audio "
                f"({'+'.join(m.value for m in resolved.modalities)}); ask for it with --modalities text+audio"
            )
        # Recorded like a run from the UI or the API (no fingerprint: nothing is served).
        recorder = open_recorder(settings)
        runs = RunService(recorder, "cli", recorder.store.files, limits=settings.limits)
        cli_request = {k: v for k, v in vars(args).items() if v is not None and k in RUN_REQUEST_FIELDS}
        tracker = runs.start(
            engine, resolved, settings.served_model_name or engine.config.model_name, None, cli_request
        )
        names, units = stage_labels(engine.config.stages)
        # The reply streams to stdout as it is made, unless the run makes pictures or was not asked for text.
        show_text = not makes_images and OutputModality.TEXT in resolved.modalities and not args.quiet
        bars = StageProgressBars(names, show_text=show_text, units=units)
        try:
            result = runs.run_blocking(
                engine,
                resolved,
                tracker,
                on_event=None if args.quiet else bars,
                stopped="stopped from the terminal (Ctrl-C)",
            )
        finally:
            bars.close()
        if isinstance(result, RunFailed):
            print(f"run failed: {result.message}", file=sys.stderr)
            return 1
        if result is None:
            print("run failed: the engine ended the run without a result", file=sys.stderr)
            return 1
        if audio_format is not None:
            if bars.texted:
                print()  # the streamed reply's line ends
            elif result.text:
                print(result.text)
            written = write_audio_outputs(result, str(args.out), audio_format)
        else:
            written = write_outputs(result, args.out, makes_images)
        for line in written:
            print(line)
        if audio_format is not None and not written:
            print(
                f"run made no audio: the reply had nothing to speak; {args.out} was not written",
                file=sys.stderr,
            )
            return 1
        if args.recipe:
            from studio.cli.recipe import report_rerun

            report_rerun(args, resolved, engine.config.config_hash(), result)
        print(f"seed {resolved.seed}", file=sys.stderr)
        print(
            f"recorded as run {tracker.run_id[:12]} (omni-studio history show {tracker.run_id[:12]})",
            file=sys.stderr,
        )
        return 0
    finally:
        if recorder is not None:
            close_recorder(recorder)  # writes everything queued before the process exits
        engine.close()


def write_outputs(result: Any, out: str | None, makes_images: bool) -> list[str]:
    """Write a finished run's outputs; returns one line per file (or the text when there is no file)."""
    from studio.media.images import png_bytes

    lines = []
    if makes_images:
        if out is None:  # cmd_run refuses an image run without --out before it starts
            raise UserError("--out FILE is required for images")
        images = result.images
        path = Path(out)
        path.parent.mkdir(parents=True, exist_ok=True)
        for i, image in enumerate(images):
            target = path if len(images) == 1 else path.with_name(f"{path.stem}-{i}{path.suffix or '.png'}")
            target.write_bytes(png_bytes(image))  # the run store's bytes, recipe included (docs/recipes.md)
            lines.append(f"{target} ({image.width}x{image.height})")
    else:
        text = "\n\n".join(o.text or "" for o in result.outputs)
        if out:
            Path(out).write_text(text + "\n")
            lines.append(str(out))
        else:
            print()
    return lines


def write_audio_outputs(result: Any, out: str, fmt: str) -> list[str]:
    """Write a finished run's audio to ``out`` in ``fmt`` (``out-1.wav``... for several variants), with the
    run's recipe in WAV and FLAC files (for WAV, the very bytes the run store keeps); one line per file.
    A variant that made no samples (a reply with nothing to speak) writes nothing."""
    from studio.media.audio import audio_summary, encode_audio
    from studio.recipes.recipe import audio_recipe

    spoken = [o for o in result.outputs if o.audio is not None and o.audio.size]
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = []
    for output in spoken:
        target = (
            path if len(result.outputs) == 1 else path.with_name(f"{path.stem}-{output.index}{path.suffix}")
        )
        target.write_bytes(encode_audio(output.audio, output.sample_rate, fmt, audio_recipe(output)))
        seconds = audio_summary(output.audio, output.sample_rate)["duration_s"]
        lines.append(f"{target} ({seconds:.2f}s of audio, {fmt})")
    return lines
