"""Built-in model families and their topologies: GLM-Image (AR -> DiT), Qwen2.5-Omni (AR -> AR -> audio),
AR-only chat, diffusion-only."""

from __future__ import annotations

from pathlib import Path

from engine.pipelines.base import PipelineFamily
from engine.pipelines.chat import ChatFamily
from engine.pipelines.diffusion import DiffusionFamily
from engine.pipelines.glm_image import GlmImageFamily
from engine.pipelines.qwen_omni import QwenOmniFamily

FAMILIES: dict[str, PipelineFamily] = {
    f.name: f for f in (GlmImageFamily(), QwenOmniFamily(), ChatFamily(), DiffusionFamily())
}


class UnknownModelFamily(ValueError):
    pass


def get_family(name: str) -> PipelineFamily:
    try:
        return FAMILIES[name]
    except KeyError:
        raise UnknownModelFamily(f"unknown model family {name!r}; known: {', '.join(FAMILIES)}") from None


def detect_family(path: Path) -> PipelineFamily:
    """The family of the HF-format model folder ``path``."""
    for family in FAMILIES.values():
        if family.detect(path):
            return family
    raise UnknownModelFamily(
        f"{path} is not a model folder omni-studio can serve: expected a GlmImagePipeline or other diffusers "
        "pipeline (model_index.json), a Qwen2.5-Omni checkpoint (config.json + spk_dict.pt) or a causal LM "
        "with a tokenizer (config.json + tokenizer_config.json)"
    )


__all__ = ["FAMILIES", "PipelineFamily", "UnknownModelFamily", "detect_family", "get_family"]
