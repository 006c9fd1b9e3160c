"""Built-in tiny models: deterministic offline builds cached in the data dir, loaded like any checkpoint.

Each model has a recipe in ``assets/models/<name>.yaml`` and a builder here. The cache folder's name
carries a fingerprint of the recipe and the library versions, so a changed recipe (or an upgraded
library whose save format changed) builds afresh instead of loading something stale.

A trained model has no builder: its files ship in ``assets/models/<name>/`` (an HF-format folder) and
are used in place; its fingerprint is a hash of those files.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import yaml

from engine.paths import MODEL_RECIPES_DIR

COMPLETE_MARKER = ".omni-studio-complete"


@dataclass(frozen=True)
class BuiltinModel:
    name: str
    family: str
    description: str
    builder: str | None  # module in engine.tiny with a build(recipe, out_dir) function; None: shipped files

    @property
    def shipped(self) -> bool:
        """True for a trained model whose files ship in ``assets/models/<name>/`` instead of being built."""
        return self.builder is None

    @property
    def shipped_path(self) -> Path:
        return MODEL_RECIPES_DIR / self.name

    @property
    def recipe_path(self) -> Path:
        return MODEL_RECIPES_DIR / f"{self.name}.yaml"

    def recipe(self) -> dict[str, Any]:
        return yaml.safe_load(self.recipe_path.read_text())

    def fingerprint(self) -> str:
        """Recipe text + library versions: what decides the built bytes (shipped files: their hash)."""
        if self.shipped:
            return _folder_digest(self.shipped_path)
        import diffusers
        import torch
        import transformers

        digest = hashlib.sha256(self.recipe_path.read_bytes())
        digest.update(f"{torch.__version__}|{transformers.__version__}|{diffusers.__version__}".encode())
        return digest.hexdigest()[:12]

    @property
    def identity(self) -> str:
        return f"builtin:{self.name}:{self.fingerprint()}"


BUILTIN_MODELS: dict[str, BuiltinModel] = {
    m.name: m
    for m in (
        BuiltinModel(
            "tiny-glm-image",
            "glm-image",
            "GLM-Image architecture, AR -> DiT -> VAE (random weights)",
            "glm_image",
        ),
        BuiltinModel("tiny-chat", "chat", "Llama-architecture chat LM, AR only (random weights)", "chat"),
        BuiltinModel(
            "tiny-diffusion",
            "diffusion",
            "Stable Diffusion 3 architecture, diffusion only (random weights)",
            "diffusion",
        ),
        BuiltinModel(
            "tiny-qwen-omni",
            "qwen-omni",
            "Qwen2.5-Omni architecture, thinker -> talker -> code2wav, speaks (random weights)",
            "qwen_omni",
        ),
        BuiltinModel(
            "tiny-glm-shapes",
            "glm-image",
            "GLM-Image architecture trained on a world of coloured shapes (draws what you ask)",
            None,
        ),
        BuiltinModel(
            "tiny-qwen-omni-dtmf",
            "qwen-omni",
            "Qwen2.5-Omni architecture trained to dial: `dial 4 1 7` replies the keys and speaks their DTMF tones",
            None,
        ),
    )
}
DEFAULT_MODEL = "tiny-glm-image"


@lru_cache(maxsize=16)
def _folder_digest(folder: Path) -> str:
    """Hash of every file's relative path and bytes (shipped folders are read-only, so cached)."""
    if not folder.is_dir():
        raise FileNotFoundError(f"the shipped model folder {folder} is missing")
    digest = hashlib.sha256()
    for file in sorted(p for p in folder.rglob("*") if p.is_file()):
        digest.update(str(file.relative_to(folder)).encode() + b"\0")
        digest.update(file.read_bytes())
    return digest.hexdigest()[:12]


def _builder(model: BuiltinModel) -> Callable[[dict[str, Any], Path], None]:
    import importlib

    return importlib.import_module(f"engine.tiny.{model.builder}").build


def build_builtin_model(name: str, out_dir: Path) -> Path:
    """Build ``name`` into ``out_dir`` (which must not exist yet)."""
    model = BUILTIN_MODELS[name]
    out_dir = Path(out_dir)
    if model.shipped:  # a copy of the shipped files
        shutil.copytree(model.shipped_path, out_dir)
        return out_dir
    out_dir.mkdir(parents=True)
    _builder(model)(model.recipe(), out_dir)
    return out_dir


def ensure_builtin_model(name: str, cache_dir: Path) -> Path:
    """The cached build of ``name``, building it first if needed (atomically: concurrent builders are safe).

    A shipped model is used in place: its folder in the assets, nothing cached.
    """
    model = BUILTIN_MODELS[name]
    if model.shipped:
        model.fingerprint()  # fails clearly if the folder is missing
        return model.shipped_path
    cache_dir = Path(cache_dir)
    target = cache_dir / f"{name}-{model.fingerprint()}"
    if (target / COMPLETE_MARKER).exists():
        return target
    cache_dir.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=cache_dir))
    try:
        build_builtin_model(name, staging / "model")
        (staging / "model" / COMPLETE_MARKER).write_text(model.identity + "\n")
        try:
            os.replace(staging / "model", target)
        except OSError:
            if not (target / COMPLETE_MARKER).exists():  # a half-built leftover: replace it
                shutil.rmtree(target, ignore_errors=True)
                os.replace(staging / "model", target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target
