"""Resolving ``--model`` (a built-in name or a local HF-format folder) to a folder, a family and an identity."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

from engine.paths import DEPLOY_PRESETS_DIR
from engine.pipelines import PipelineFamily, detect_family, get_family
from engine.tiny import BUILTIN_MODELS, DEFAULT_MODEL, ensure_builtin_model


class ModelNotFound(ValueError):
    pass


@dataclass(frozen=True)
class ModelSource:
    """A model to serve: where its files are and what it is."""

    name: str  # the built-in name or the folder's name: the default served model name
    path: Path | None  # None until a built-in model is built (see :func:`materialize`)
    family: PipelineFamily
    identity: str  # enters the config hash: stable across machines
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
    """What ``model`` is, without building anything (for validation and listings)."""
    name = model or DEFAULT_MODEL
    if name in BUILTIN_MODELS:
        builtin = BUILTIN_MODELS[name]
        return ModelSource(name, None, get_family(builtin.family), builtin.identity, True)
    path = Path(name).expanduser()
    if not path.is_dir():
        raise ModelNotFound(
            f"model {name!r} is neither a built-in model ({', '.join(BUILTIN_MODELS)}) nor a local folder"
        )
    path = path.resolve()
    return ModelSource(path.name, path, detect_family(path), _folder_identity(path), False)


def materialize(source: ModelSource, cache_dir: Path) -> ModelSource:
    """Make sure the model's files exist (building a built-in model into ``cache_dir`` once)."""
    if source.path is not None:
        return source
    path = ensure_builtin_model(source.name, cache_dir)
    return ModelSource(source.name, path, source.family, source.identity, True)
