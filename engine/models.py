"""Resolving ``--model`` (a built-in name, a local HF-format folder or a Hugging Face Hub id) to a folder, a
family and an identity."""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from pathlib import Path

import yaml

from engine.hub import HubModel, HubModelUnavailable, cached_snapshot, parse_hub_id, resolve_hub_model
from engine.paths import DEPLOY_PRESETS_DIR, MODEL_RECIPES_DIR
from engine.pipelines import PipelineFamily, detect_family, get_family
from engine.tiny import BUILTIN_MODELS, DEFAULT_MODEL, ensure_builtin_model


class ModelNotFound(ValueError):
    pass


@dataclass(frozen=True)
class ModelSource:
    """A model to serve: where its files are and what it is."""

    name: str  # the built-in name, the folder's name or the hub id ORG/NAME: the default served model name
    path: Path | None  # None until a built-in model is built (see :func:`materialize`)
    family: PipelineFamily
    identity: str  # enters the config hash: stable across machines (a hub model's names its commit)
    builtin: bool

    @property
    def default_deploy_path(self) -> Path | None:
        """The deploy config used when none is given (built-in models ship one sized for a CPU)."""
        path = DEPLOY_PRESETS_DIR / f"{self.name}.yaml"
        return path if self.builtin and path.exists() else None


def _folder_identity(path: Path) -> str:
    """Hash of the folder's JSON configs: the same checkpoint hashes the same on any machine."""
    digest = hashlib.sha256()
    for file in sorted(path.rglob("*.json")):
        digest.update(str(file.relative_to(path)).encode())
        digest.update(file.read_bytes())
    return f"local:{path.name}:{digest.hexdigest()[:12]}"


def describe_model(model: str | None) -> ModelSource:
    """What ``model`` is: a built-in name, else a local folder, else a Hub id ``ORG/NAME[@REVISION]``.

    Nothing is built, but a hub model must be in the Hugging Face cache to be described (its family is
    read from its files): one that is not is downloaded here, unless HF_HUB_OFFLINE is set (engine/hub.py).
    """
    name = model or DEFAULT_MODEL
    if name in BUILTIN_MODELS:
        builtin = BUILTIN_MODELS[name]
        return ModelSource(name, None, get_family(builtin.family), builtin.identity, True)
    path = Path(name).expanduser()
    if path.is_dir():
        path = path.resolve()
        snapshot = cached_snapshot(path)  # a hub snapshot handed on by path keeps its id and commit
        if snapshot is not None:
            return _hub_source(snapshot)
        return ModelSource(path.name, path, detect_family(path), _folder_identity(path), False)
    neither = f"model {name!r} is neither a built-in model ({', '.join(BUILTIN_MODELS)}) nor a local folder"
    hub_id = parse_hub_id(name)
    if hub_id is None:
        raise ModelNotFound(f"{neither}, nor a Hugging Face model id ORG/NAME[@REVISION]")
    try:
        return _hub_source(resolve_hub_model(*hub_id))
    except HubModelUnavailable as exc:
        raise ModelNotFound(f"{neither}, and {exc}") from exc


def _hub_source(model: HubModel) -> ModelSource:
    return ModelSource(model.repo_id, model.path, detect_family(model.path), model.identity, False)


def materialize(source: ModelSource, cache_dir: Path) -> ModelSource:
    """Make sure the model's files exist (building a built-in model into ``cache_dir`` once; a folder or a
    hub snapshot is already there: :func:`describe_model` found or downloaded it)."""
    if source.path is not None:
        return source
    path = ensure_builtin_model(source.name, cache_dir)
    return ModelSource(source.name, path, source.family, source.identity, True)


# -- what a model supports ------------------------------------------------------------------------

CARD_FILE = (
    "omni-studio.card.yaml"  # in a local model folder; built-in models: assets/models/<name>.card.yaml
)
CARD_KEYS = ("sizes", "num_inference_steps", "example_prompt", "prompt_pattern", "speech_pattern")


@dataclass(frozen=True)
class ModelCard:
    """What a model is for: the image sizes and step counts it supports (empty: anything the family
    takes), a prompt that shows it at its best, and the prompts (``prompt_pattern``) and the texts to
    speak (``speech_pattern``: ``/v1/audio/speech``'s ``input``) it understands, as regular expressions
    a whole prompt must match. Outside them a request still runs, with a warning."""

    sizes: tuple[tuple[int, int], ...] = ()  # (width, height)
    num_inference_steps: tuple[int, ...] = ()
    example_prompt: str | None = None
    source: Path | None = None  # the file it came from
    prompt_pattern: str | None = None
    speech_pattern: str | None = None

    @staticmethod
    def parse(data: object, source: Path | None = None) -> ModelCard:
        where = str(source) if source is not None else "model card"
        if data is None:
            return ModelCard(source=source)
        if not isinstance(data, dict):
            raise ValueError(f"{where}: must be a mapping with {', '.join(CARD_KEYS)}")
        unknown = sorted(set(data) - set(CARD_KEYS))
        if unknown:
            raise ValueError(f"{where}: unknown key(s) {', '.join(unknown)}; allowed: {', '.join(CARD_KEYS)}")
        sizes = []
        for size in data.get("sizes") or ():
            width, sep, height = str(size).partition("x")
            if not sep or not width.isdigit() or not height.isdigit():
                raise ValueError(f"{where}: sizes take WIDTHxHEIGHT (e.g. 128x128), got {size!r}")
            sizes.append((int(width), int(height)))
        steps = data.get("num_inference_steps") or ()
        if not all(isinstance(s, int) and s > 0 for s in steps):
            raise ValueError(f"{where}: num_inference_steps takes positive integers, got {steps!r}")
        prompt = data.get("example_prompt")
        patterns = {}
        for key in ("prompt_pattern", "speech_pattern"):
            pattern = data.get(key)
            if pattern is None:
                continue
            try:
                re.compile(str(pattern))
            except re.error as exc:
                raise ValueError(f"{where}: {key} is not a regular expression ({exc}): {pattern!r}") from exc
            patterns[key] = str(pattern)
        return ModelCard(tuple(sizes), tuple(steps), str(prompt) if prompt else None, source, **patterns)

    def describe(self) -> str:
        """One line: what the model supports ('' when it declares nothing)."""
        parts = []
        if self.sizes:
            parts.append("size " + " or ".join(f"{w}x{h}" for w, h in self.sizes))
        if self.num_inference_steps:
            steps = " or ".join(str(s) for s in self.num_inference_steps)
            parts.append(f"{steps} step{'s' if self.num_inference_steps != (1,) else ''}")
        return ", ".join(parts)

    def check_text(self, model_name: str, prompt: str, speak_text: str | None) -> tuple[str, ...]:
        """Warnings for a prompt (or a text to speak) the model does not understand (empty: it does)."""
        if speak_text is not None:
            if self.speech_pattern and not re.fullmatch(self.speech_pattern, speak_text.strip()):
                return (
                    f"{model_name} speaks texts that match {self.speech_pattern!r}; {_clip(speak_text)} does "
                    "not, so the audio may not say it",
                )
            return ()
        if self.prompt_pattern and not re.fullmatch(self.prompt_pattern, prompt.strip()):
            like = f" (like {self.example_prompt!r})" if self.example_prompt else ""
            return (
                f"{model_name} answers prompts that match {self.prompt_pattern!r}{like}; {_clip(prompt)} does "
                "not, so the result may not show what the prompt asks",
            )
        return ()

    def check(self, model_name: str, parameters: dict[str, object]) -> tuple[str, ...]:
        """Warnings for resolved ``parameters`` outside what the model supports (empty: all supported)."""
        asked = []
        width, height = parameters.get("width"), parameters.get("height")
        if self.sizes and width is not None and height is not None and (width, height) not in self.sizes:
            asked.append(f"{width}x{height}")
        steps = parameters.get("num_inference_steps")
        if self.num_inference_steps and steps is not None and steps not in self.num_inference_steps:
            asked.append(f"{steps} step{'s' if steps != 1 else ''}")
        if not asked:
            return ()
        return (
            f"{model_name} supports {self.describe()}; this request asks for {' and '.join(asked)}, "
            "so the result may not show what the prompt asks",
        )


def _clip(text: str, limit: int = 60) -> str:
    """``text`` quoted for a warning, cut at ``limit`` characters."""
    return repr(text if len(text) <= limit else text[:limit] + "…")


def card_path(source: ModelSource) -> Path | None:
    if source.builtin:
        return MODEL_RECIPES_DIR / f"{source.name}.card.yaml"
    return source.path / CARD_FILE if source.path is not None else None


def model_card(source: ModelSource) -> ModelCard:
    """The model's card (an empty card when it has none). Not part of the config hash: it changes no output."""
    path = card_path(source)
    if path is None or not path.is_file():
        return ModelCard()
    return ModelCard.parse(yaml.safe_load(path.read_text()), path)


def model_sampling_defaults(source: ModelSource) -> dict[int, dict[str, object]]:
    """Per stage id, the sampling parameters the model itself asks for: its card's first size and step
    count (for its diffusion stages), then its deploy preset's ``default_sampling_params``. A deploy
    config that leaves one of these out gets it from here, never the family-wide default the model may
    not be able to draw (a 1024x1024, 50-step GLM-Image default for a model trained at 128x128)."""
    defaults: dict[int, dict[str, object]] = {}
    preset = source.default_deploy_path
    if preset is not None:
        data = yaml.safe_load(preset.read_text()) or {}
        for stage in data.get("stages") or ():
            params = stage.get("default_sampling_params") if isinstance(stage, dict) else None
            if isinstance(params, dict) and isinstance(stage.get("stage_id"), int):
                defaults[stage["stage_id"]] = dict(params)
    try:
        card = model_card(source)
    except ValueError:  # a broken card declares nothing (the engine logs it where it reads the card)
        card = ModelCard()
    from_card: dict[str, object] = {}
    if card.sizes:
        from_card["width"], from_card["height"] = card.sizes[0]
    if card.num_inference_steps:
        from_card["num_inference_steps"] = card.num_inference_steps[0]
    if from_card:
        for template in source.family.templates:
            if template.kind == "diffusion":
                defaults[template.stage_id] = {**defaults.get(template.stage_id, {}), **from_card}
    return defaults
