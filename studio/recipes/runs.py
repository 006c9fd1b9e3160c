"""From a PNG's recipe back to runs: the recorded run(s) it came from, and what re-running it takes.

Used by ``omni-studio history show --png`` and ``omni-studio run --recipe`` (``studio/cli/history.py``, ``studio/cli/run.py``) and by the
Chat tab's "Load recipe" (``studio/ui/recipe.py``); the format itself is ``studio/recipes/recipe.py``.
A PNG is matched to runs by its sha256 first (the run store keeps outputs content-addressed, so an
untouched file is exactly one output of the run(s) that made it); a re-saved or edited PNG by its recipe
(config hash, prompt, seed and parameters), since the recipe carries no run id (docs/recipes.md says why).
"""

from __future__ import annotations

import hashlib
import io
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from PIL import Image

from engine.config import DeployConfig, StageConfig
from studio.recipes.recipe import A1111, Recipe, RecipeError, is_audio_file
from studio.store.files import OutputFiles
from studio.store.records import RunFilter

# Matched by: the file's bytes are a recorded output, or only its recipe matches a recorded run.
BY_FILE = "file"
BY_RECIPE = "recipe"
MAX_CANDIDATES = 500  # runs with the recipe's prompt and config looked at (newest first)

# Parameters that differ between the outputs of one run (output i has seed + i) or say how many there are.
_PER_OUTPUT = ("seed", "n")


@dataclass(frozen=True)
class FileRuns:
    """The runs a PNG, WAV or FLAC came from (newest first) and how they were matched (:data:`BY_FILE` or
    :data:`BY_RECIPE`); no runs: ``run_ids`` is empty."""

    sha256: str
    matched_by: str | None
    run_ids: list[str] = field(default_factory=list)


def runs_for_file(store: Any, data: bytes, recipe: Recipe | None) -> FileRuns:
    """The recorded runs ``data`` (a PNG's, WAV's or FLAC's bytes, its ``recipe`` if it has one) came from,
    in ``store``.

    By the file's sha256 first; failing that by the recipe: same prompt and config hash (A1111 recipes:
    the prompt), a seed within the run's outputs, and the same parameters otherwise.
    """
    sha256 = hashlib.sha256(data).hexdigest()
    ids = store.runs_with_output(sha256, "audio" if is_audio_file(data) else "image")
    if ids:
        return FileRuns(sha256, BY_FILE, ids)
    if recipe is None or recipe.seed is None:
        return FileRuns(sha256, None)
    selection = RunFilter(
        search=recipe.prompt or None,
        status="succeeded",
        config_hash=recipe.config_hash if recipe.origin != A1111 else None,
    )
    matches = []
    for summary in store.list_runs(selection, limit=MAX_CANDIDATES):
        if summary.prompt != recipe.prompt or summary.seed is None or summary.seed > recipe.seed:
            continue
        if recipe.config_hash and summary.config_hash != recipe.config_hash:
            continue
        if recipe_matches(recipe, store.get_run(summary.id).parameters):
            matches.append(summary.id)
    return FileRuns(sha256, BY_RECIPE if matches else None, matches)


def recipe_matches(recipe: Recipe, parameters: dict[str, Any]) -> bool:
    """Whether a run recorded with ``parameters`` made the picture ``recipe`` describes.

    Output ``i`` of a run has seed ``seed + i``; our recipes must agree on every other parameter, A1111
    recipes on the ones they carry (steps, CFG scale, size, negative prompt).
    """
    seed, first, count = recipe.seed, parameters.get("seed"), parameters.get("n") or 1
    if seed is None or not isinstance(first, int) or not first <= seed < first + int(count):
        return False
    keys = set(recipe.parameters) | (set(parameters) if recipe.origin != A1111 else set())
    return all(recipe.parameters.get(key) == parameters.get(key) for key in keys - set(_PER_OUTPUT))


# -- re-running ---------------------------------------------------------------------------------

# Recipe parameter -> `omni-studio run` field (``--steps``, ...). ``max_tokens`` is left out: for image
# models it follows the size, so a size given on the command line must not be held to the old budget.
RUN_FIELDS = {
    "seed": "seed",
    "height": "height",
    "width": "width",
    "num_inference_steps": "steps",
    "guidance_scale": "guidance",
    "negative_prompt": "negative_prompt",
    "temperature": "temperature",
    "voice": "voice",  # speech (docs/speech.md): the speaker, the tempo, the words given to say
    "speed": "speed",
    "speak_text": "speak_text",
}


@dataclass(frozen=True)
class RerunPlan:
    """What ``omni-studio run --recipe`` runs: the run fields the recipe fills, the model and deploy
    config to start, the source image (image-to-image), and notes for the user."""

    fields: dict[str, Any]
    model: str | None
    deploy_config: str | None
    image: str | None
    notes: list[str]


def plan_rerun(
    recipe: Recipe,
    given: dict[str, Any],
    model: str | None,
    deploy_config: str | None,
    data_dir: Path,
    builtin_models: tuple[str, ...] | list[str],
) -> RerunPlan:
    """How to re-run ``recipe``; what the user ``given`` explicitly (run fields, ``model``,
    ``deploy_config``; ``None``: not given) wins over the recipe.

    The recipe's model is used when it is built in (another model needs ``--model``); its pipeline config
    is written as a deploy file in ``data_dir/recipes/`` and used when the model is the recipe's and no
    ``--deploy-config`` is given. Raises :class:`RecipeError` when the model cannot be known or the source
    image of an image-to-image recipe is missing.
    """
    notes: list[str] = list(recipe.notes)
    fields: dict[str, Any] = {}
    if given.get("prompt") is None:
        fields["prompt"] = recipe.prompt
    for key, name in RUN_FIELDS.items():
        if given.get(name) is None and recipe.parameters.get(key) is not None:
            fields[name] = recipe.parameters[key]
    speaks = "audio" in (recipe.parameters.get("modalities") or ())
    # A spoken run's text budget is its own (the thinker's max_tokens; an image's follows its size).
    if speaks and given.get("max_tokens") is None and recipe.parameters.get("max_tokens") is not None:
        fields["max_tokens"] = recipe.parameters["max_tokens"]
    modalities = recipe.parameters.get("modalities")
    if speaks and given.get("modalities") is None and isinstance(modalities, list):
        fields["modalities"] = "+".join(str(m) for m in modalities)
    if recipe.history:
        notes.append(
            f"the recipe continues a conversation of {len(recipe.history)} turn(s); `run` sends the prompt alone"
        )
    if recipe.origin == A1111 and recipe.unmapped:
        notes.append("A1111 settings with no counterpart here were left out: " + "; ".join(recipe.unmapped))

    if model is None and recipe.model is not None:
        if recipe.model in builtin_models:
            model = recipe.model
        elif recipe.origin == A1111:
            notes.append(
                f"the A1111 model {recipe.model!r} is not one of this studio's; running the default model"
            )
        else:
            raise RecipeError(
                f"the recipe's model {recipe.model!r} is not built in; give the folder it was loaded from with --model PATH"
            )

    if deploy_config is None and recipe.config is not None and (model or "") == (recipe.model or ""):
        deploy_config = str(write_recipe_deploy(recipe, data_dir))

    image = given.get("image")
    if image is None and recipe.source_image_sha256:
        found = OutputFiles.in_data_dir(data_dir).find(recipe.source_image_sha256)
        if found is None:
            raise RecipeError(
                f"the recipe is image-to-image and its source image (sha256 {recipe.source_image_sha256[:12]}…) "
                "is not in this data dir; give it with --image SRC"
            )
        image = str(found)
    return RerunPlan(fields, model, deploy_config, image, notes)


def deploy_from_config(config: dict[str, Any]) -> dict[str, Any]:
    """A deploy document that resolves to the pipeline-config snapshot ``config`` (PipelineConfig.to_dict()):
    every stage spelled out (topology, engine args, sampling defaults), unknown keys left out."""
    stage_keys = set(StageConfig.model_fields)
    stages = []
    for snapshot in config.get("stages") or []:
        stage: dict[str, Any] = {}
        for key, value in snapshot.items():
            if key == "engine_args" and isinstance(value, dict):
                stage.update({k: v for k, v in value.items() if k in stage_keys and v is not None})
            elif key in stage_keys and value is not None and value != {}:
                stage[key] = value
        stages.append(stage)
    deploy: dict[str, Any] = {
        k: v for k, v in config.items() if k in DeployConfig.model_fields and k != "stages"
    }
    deploy["stages"] = stages
    return deploy


def write_recipe_deploy(recipe: Recipe, data_dir: Path) -> Path:
    """The recipe's pipeline config as a deploy YAML file in ``data_dir/recipes/`` (named by its hash)."""
    assert recipe.config is not None
    folder = Path(data_dir) / "recipes"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"deploy-{(recipe.config_hash or 'unknown')[:12]}.yaml"
    text = f"# the deploy config of a PNG recipe (config hash {recipe.config_hash})\n" + yaml.safe_dump(
        deploy_from_config(recipe.config), sort_keys=False
    )
    path.write_text(text)
    return path


def deploy_text(recipe: Recipe) -> str | None:
    """The recipe's pipeline config as deploy YAML (what the Pipeline tab applies), or ``None``."""
    if recipe.config is None:
        return None
    return yaml.safe_dump(deploy_from_config(recipe.config), sort_keys=False)


def parameter_changes(
    recipe: Recipe, parameters: dict[str, Any], overridden: frozenset[str] | set[str] = frozenset()
) -> list[str]:
    """``key: recipe value -> run value`` for each parameter a run resolved differently from the recipe
    (``overridden``: recipe keys the user changed on purpose, not reported)."""
    changes = []
    for key in sorted(set(recipe.parameters) | set(parameters)):
        if key in overridden or key == "n" or key not in recipe.parameters:
            continue
        if recipe.parameters.get(key) != parameters.get(key):
            changes.append(f"{key}: {recipe.parameters.get(key)!r} -> {parameters.get(key)!r}")
    return changes


def compare_audio_with_original(original: bytes, samples: Any, sample_rate: int) -> str:
    """One line on how a re-run's audio compares with the recipe's WAV or FLAC: the same samples or not
    (the largest difference, in 16-bit steps, and the length of each when they differ)."""
    import numpy as np
    import soundfile  # type: ignore[import-untyped]  # ships no type information

    from studio.media.audio import pcm16

    before, rate = soundfile.read(io.BytesIO(original), dtype="int16")
    after = pcm16(samples)
    if rate == sample_rate and before.shape == after.shape and np.array_equal(before, after):
        return "the same samples as the recipe's audio"
    if before.shape != after.shape or rate != sample_rate:
        return (
            f"different audio from the recipe's: {after.size / sample_rate:.2f} s at {sample_rate} Hz now, "
            f"{before.size / rate:.2f} s at {rate} Hz in the file"
        )
    largest = int(np.abs(before.astype(np.int32) - after.astype(np.int32)).max())
    return f"different samples from the recipe's audio (largest difference {largest} of 32767)"


def compare_with_original(original: bytes, new: bytes) -> str:
    """One line on how a re-run's PNG compares with the recipe's file: same bytes, same pixels, or not."""
    if original == new:
        return "identical bytes to the recipe's PNG"
    with Image.open(io.BytesIO(original)) as a, Image.open(io.BytesIO(new)) as b:
        same = a.size == b.size and a.convert("RGB").tobytes() == b.convert("RGB").tobytes()
    if same:
        return "same pixels as the recipe's PNG (the file's text chunks differ, e.g. the fingerprint)"
    return "different pixels from the recipe's PNG"


def restore_pipeline(studio: Any, recipe: Recipe) -> str:
    """Serve the recipe's model and deploy config in the running studio (``studio.controller.Studio``);
    returns what happened, in Markdown. The engine is rebuilt the way the Chat tab's model switch and the
    Pipeline tab's Apply do it; a failure leaves the running engine serving."""
    if recipe.model is None or recipe.config is None:
        return "The recipe names no model and deploy config (an A1111 recipe); nothing to switch."
    if recipe.model != studio.model.name:
        if recipe.model not in studio.builtin_models():
            return f"The recipe's model **{recipe.model}** is not known to this studio; nothing switched."
        report = studio.switch_model(recipe.model)
        if not report.ok:
            return "**Model not switched** — " + "; ".join(str(p) for p in report.problems)
    text = deploy_text(recipe)
    if text is not None and studio.config.config_hash() != recipe.config_hash:
        report = studio.apply_text(text)
        if not report.ok:
            return "**Deploy config not applied** — " + "; ".join(str(p) for p in report.problems)
    running = studio.config.config_hash()
    if running != recipe.config_hash:
        return (
            f"Now serving **{studio.model.name}**, config `{running[:8]}`; the recipe's was "
            f"`{(recipe.config_hash or '?')[:8]}` (the model files differ on this machine?)."
        )
    return f"Now serving **{studio.model.name}** with the recipe's deploy config `{running[:8]}`."
