"""``omni-studio run``: one request in this process, with progress bars, written to files."""

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


def cmd_run(args: argparse.Namespace, settings: StudioSettings) -> int:
    from engine import GenerationParams, GenerationRequest, RequestError
    from engine.environment import StartupCollection
    from engine.events import RunFailed
    from engine.modality import OutputModality
    from studio.cli.progress import StageProgressBars
    from studio.media.images import png_bytes
    from studio.runs.service import RunService
    from studio.startup.launch import close_recorder, open_recorder, start_engine

    if args.recipe:
        from studio.cli.recipe import apply_recipe

        settings = apply_recipe(args, settings)
    if args.prompt is None:
        raise UserError("give a PROMPT, or --recipe FILE.png to re-run a PNG's recipe")
    image = load_image_source(args.image) if args.image else None
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
            ),
            image=image,
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
        # Recorded like a run from the UI or the API (no fingerprint: nothing is served).
        recorder = open_recorder(settings)
        runs = RunService(recorder, "cli", recorder.store.files, limits=settings.limits)
        cli_request = {k: v for k, v in vars(args).items() if v is not None and k in RUN_REQUEST_FIELDS}
        tracker = runs.start(
            engine, resolved, settings.served_model_name or engine.config.model_name, None, cli_request
        )
        names = {s.stage_id: s.kind for s in engine.config.stages}
        bars = StageProgressBars(names, show_text=not makes_images and not args.quiet)
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
        written = write_outputs(result, args.out, makes_images)
        for line in written:
            print(line)
        if args.recipe:
            from studio.cli.recipe import report_rerun

            report_rerun(args, resolved, engine.config.config_hash(), [png_bytes(i) for i in result.images])
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
