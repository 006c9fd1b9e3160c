"""The command line's side of recipes (PNGs, and WAV/FLAC files of spoken runs): ``omni-studio run --recipe
FILE`` and ``omni-studio history show --file FILE`` (hooked into ``studio/cli/run.py`` and ``studio/cli/history.py``; docs/recipes.md).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

from engine.tiny import BUILTIN_MODELS
from studio.errors import UserError
from studio.recipes.recipe import Recipe, RecipeError, is_audio_file, read_recipe
from studio.recipes.runs import (
    BY_FILE,
    compare_audio_with_original,
    compare_with_original,
    parameter_changes,
    plan_rerun,
    runs_for_file,
)
from studio.startup.settings import StudioSettings

# `run` flags a recipe fills when they are not given on the command line, and their recipe parameter
# names (for "what the user changed on purpose").
_PARAMETER_OF = {
    "seed": "seed",
    "height": "height",
    "width": "width",
    "steps": "num_inference_steps",
    "guidance": "guidance_scale",
    "negative_prompt": "negative_prompt",
    "temperature": "temperature",
    "voice": "voice",
    "speed": "speed",
    "speak_text": "speak_text",
    "max_tokens": "max_tokens",
    "modalities": "modalities",
}
RECIPE_RUN_FIELDS = ("prompt", "image", *_PARAMETER_OF)


def read_file(path: str, flag: str) -> bytes:
    """The bytes of the file ``path`` names (``flag`` names the option in errors)."""
    file = Path(path).expanduser()
    if not file.is_file():
        raise UserError(f"{flag}: no such file: {path}")
    return file.read_bytes()


def load_recipe(path: str, flag: str) -> tuple[bytes, Recipe]:
    """The file's bytes and its recipe; a file that is not a PNG, WAV or FLAC or has no recipe is a usage
    error."""
    data = read_file(path, flag)
    try:
        return data, read_recipe(data, path)
    except RecipeError as exc:
        raise UserError(f"{flag}: {exc}") from None


def apply_recipe(args: argparse.Namespace, settings: StudioSettings) -> StudioSettings:
    """Fill the `run` fields the command line left out from ``args.recipe``; returns the settings with the
    recipe's model and deploy config (unless ``--model`` / ``--deploy-config`` were given)."""
    _, recipe = load_recipe(args.recipe, "--recipe")
    given = {name: getattr(args, name, None) for name in RECIPE_RUN_FIELDS}
    args.recipe_given = {name for name, value in given.items() if value is not None}
    try:
        plan = plan_rerun(
            recipe,
            given,
            settings.model,
            settings.deploy_config,
            settings.data_dir,
            tuple(BUILTIN_MODELS),
        )
    except RecipeError as exc:
        raise UserError(f"--recipe: {exc}") from None
    for name, value in plan.fields.items():
        setattr(args, name, value)
    if plan.image is not None:
        args.image = plan.image
    for note in plan.notes:
        print(f"omni-studio run: note: {note}", file=sys.stderr)
    return replace(settings, model=plan.model, deploy_config=plan.deploy_config)


def report_rerun(args: argparse.Namespace, resolved: Any, config_hash: str, result: Any) -> None:
    """After ``run --recipe``: what differs from the recipe (parameters, config) and how the new output
    compares with the recipe's file (a PNG's pixels, a WAV's or FLAC's samples)."""
    from studio.media.images import png_bytes

    original, recipe = load_recipe(args.recipe, "--recipe")
    overridden = {
        _PARAMETER_OF[name] for name in getattr(args, "recipe_given", set()) if name in _PARAMETER_OF
    }
    for change in parameter_changes(recipe, resolved.parameters, overridden):
        print(f"omni-studio run: differs from the recipe: {change}", file=sys.stderr)
    if recipe.config_hash and recipe.config_hash != config_hash:
        print(
            f"omni-studio run: the recipe was made with config {recipe.config_hash[:8]}, this run used {config_hash[:8]}",
            file=sys.stderr,
        )
    if is_audio_file(original):
        spoken = [o for o in result.outputs if o.audio is not None]
        if len(spoken) == 1:
            line = compare_audio_with_original(original, spoken[0].audio, spoken[0].sample_rate)
            print(f"omni-studio run: {line}", file=sys.stderr)
    elif len(result.images) == 1:
        print(
            f"omni-studio run: {compare_with_original(original, png_bytes(result.images[0]))}",
            file=sys.stderr,
        )


def show_file_runs(args: argparse.Namespace, store: Any) -> int:
    """``history show --file FILE`` (or ``--png``): the run(s) a PNG, WAV or FLAC came from, as ``history
    show ID`` prints them."""
    from studio.store.terminal import format_run_detail

    data = read_file(args.png, "--file")
    try:
        recipe: Recipe | None = read_recipe(data, args.png)
    except RecipeError as exc:
        if not (data.startswith(b"\x89PNG") or is_audio_file(data)):
            raise UserError(f"--file: {exc}") from None
        recipe = None  # a file without a recipe can still be a recorded output (by its sha256)
    found = runs_for_file(store, data, recipe)
    if not found.run_ids:
        why = "" if recipe is not None else " (it carries no recipe, and its sha256 is no recorded output)"
        raise UserError(f"no run recorded for this file: {args.png}{why}")
    details = [store.get_run(run_id) for run_id in found.run_ids]
    runs = "this run" if len(details) == 1 else "each of these runs"
    how = (
        f"the file is an output of {runs} (sha256 {found.sha256[:12]}…)"
        if found.matched_by == BY_FILE
        else f"its recipe matches {runs} (the file itself was changed or re-saved)"
    )
    if args.json:
        print(
            json.dumps(
                {
                    "matched_by": found.matched_by,
                    "sha256": found.sha256,
                    "runs": [d.to_dict() for d in details],
                },
                indent=2,
                default=str,
            )
        )
        return 0
    count = len(details)
    print(f"{args.png}: {count} run{'s' if count != 1 else ''} — {how}")
    for detail in details:
        print()
        print(format_run_detail(detail))
    return 0
