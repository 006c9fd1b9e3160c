"""One stage's memory: the components it loads, its KV cache (an AR stage), its margin and its devices
(docs/memory.md)."""

from __future__ import annotations

import math
import types
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from engine.config import ResolvedStage
from engine.kv_cache import kv_bytes_per_token
from engine.memory_estimate.activations import (
    DiffusionWork,
    diffusion_work,
    vllm_cpu_copies,
    vllm_token_buffers,
)
from engine.memory_estimate.checkpoints import ComponentWeights, component_weights, read_json
from engine.memory_estimate.devices import DeviceBudget

# The margin for what no term models (an AR stage's activations, the loaders' leftovers), per stage: a
# fraction of its weights + copies + KV cache, at least a floor per device kind. docs/memory.md says where
# these numbers come from.
MARGIN_FRACTION = 0.20
MARGIN_FLOOR = {"cpu": 256 << 20, "cuda": 512 << 20}


def stage_components(family: str, stage: ResolvedStage, model_path: Path) -> list[str]:
    """The component folders ``stage`` loads, as each family's runners load them (engine/pipelines/)."""
    if family == "chat":
        return ["."]
    from engine.pipelines.glm_image import AR_COMPONENT, PROCESSOR_COMPONENT

    if family == "glm-image" and stage.kind == "ar":
        return [AR_COMPONENT]
    skip = {AR_COMPONENT, PROCESSOR_COMPONENT} if family == "glm-image" else set()
    index = read_json(Path(model_path) / "model_index.json")
    # A component saved as [null, null] is absent (e.g. SD3 without its T5); keys with "_" are metadata.
    return [
        name
        for name, spec in index.items()
        if not name.startswith("_") and name not in skip and isinstance(spec, list) and spec != [None, None]
    ]


# -- the KV cache ----------------------------------------------------------------------------------


def text_config(component_config: Mapping[str, Any]) -> types.SimpleNamespace:
    """The text model's config from a component's ``config.json``: nested under ``text_config`` in
    multimodal models (GLM-Image's AR model), else the config itself; as attributes, like the
    ``get_text_config()`` of transformers that the vLLM stage reads."""
    nested = component_config.get("text_config")
    return types.SimpleNamespace(**(nested if isinstance(nested, dict) else component_config))


@dataclass(frozen=True)
class KvCache:
    bytes_per_token: int
    max_model_len: int
    max_num_seqs: int
    length_from: str  # "max_model_len", or where the length came from when the config leaves it out
    fixed_bytes: int | None = None  # kv_cache_memory_bytes: the cache is exactly this

    @property
    def bytes(self) -> int:
        if self.fixed_bytes is not None:
            return self.fixed_bytes
        return self.bytes_per_token * self.max_model_len * self.max_num_seqs


# -- the estimate of a stage -----------------------------------------------------------------------


@dataclass(frozen=True)
class StageMemory:
    stage: ResolvedStage
    backend: str  # transformers | vllm | diffusers
    dtype: torch.dtype
    components: tuple[ComponentWeights, ...]
    unreadable: tuple[str, ...]  # component folders with weights that are not safetensors (not counted)
    kv: KvCache | None
    devices: tuple[str, ...]  # where its memory goes: one device, or vLLM's tensor/pipeline workers' GPUs
    copies: int = 0  # vLLM on a CPU: the packed copies its loader keeps beside the weights
    buffers: int = 0  # vLLM: its input-embeddings buffer of max_num_batched_tokens
    work: DiffusionWork | None = None  # a diffusion stage's working memory at its image size

    @property
    def stage_id(self) -> int:
        return self.stage.stage_id

    @property
    def weights(self) -> int:
        return sum(c.loaded_bytes(self.dtype) for c in self.components)

    @property
    def kv_bytes(self) -> int:
        return self.kv.bytes if self.kv is not None else 0

    @property
    def work_bytes(self) -> int:
        return self.work.bytes if self.work is not None else 0

    @property
    def extra(self) -> int:
        """What the stage holds beyond weights and KV cache: loader copies and working memory."""
        return self.copies + self.buffers + self.work_bytes

    def total_if(self, *, kv_bytes: int | None = None, weights: int | None = None) -> int:
        """The total with another KV cache size or weights (what a changed deploy key would give: another
        dtype scales the copies and the working memory with the weights)."""
        scale = weights / self.weights if weights is not None and self.weights else 1.0
        weights = self.weights if weights is None else weights
        kv_bytes = self.kv_bytes if kv_bytes is None else kv_bytes
        copies, work = int(self.copies * scale), int(self.work_bytes * scale)
        floor = MARGIN_FLOOR["cpu" if self.devices[0] == "cpu" else "cuda"] * len(self.devices)
        held = weights + copies + int(self.buffers * scale) + kv_bytes
        return held + work + max(int(MARGIN_FRACTION * held), floor)

    @property
    def margin(self) -> int:
        return self.total - self.weights - self.kv_bytes - self.extra

    @property
    def total(self) -> int:
        return self.total_if()

    @property
    def share(self) -> int:
        """What the stage needs on each of its devices."""
        return math.ceil(self.total / len(self.devices))

    @property
    def vllm_on_gpu(self) -> bool:
        return self.backend == "vllm" and self.devices[0] != "cpu"

    def claim(self, budget: DeviceBudget | None) -> int:
        """What the stage takes from each of its devices: its share of the total, or for vLLM on a GPU
        (without kv_cache_memory_bytes) ``gpu_memory_utilization`` of the GPU, which vLLM takes at start."""
        share = self.share
        utilization = self.stage.engine_args.gpu_memory_utilization
        if self.vllm_on_gpu and self.stage.engine_args.kv_cache_memory_bytes is None and budget is not None:
            return max(share, int((utilization or 0.9) * budget.total))
        return share


def _stage_dtype(stage: ResolvedStage) -> torch.dtype:
    from engine.stages.base import StageRunner

    # The dtype a runner loads with (StageRunner.torch_dtype: auto is float32), read off its own property.
    return StageRunner.torch_dtype.fget(types.SimpleNamespace(stage=stage))  # type: ignore[attr-defined]


def _stage_backend(stage: ResolvedStage) -> str:
    if stage.kind != "ar":
        return "diffusers"
    if stage.backend in ("vllm", "transformers"):
        return stage.backend
    from engine.stages.backends import vllm_importable

    # auto: vLLM when it is installed (select_ar_backend also imports it to be sure; too slow for here).
    return "vllm" if vllm_importable() else "transformers"


def _stage_devices(stage: ResolvedStage, backend: str) -> tuple[str, ...]:
    from engine.building import resolve_device

    args = stage.engine_args
    workers = args.tensor_parallel * args.pipeline_parallel
    if backend == "vllm" and args.placement.gpus and workers > 1:
        return tuple(f"cuda:{g}" for g in args.placement.gpus[:workers])
    return (str(resolve_device(args.placement)),)


def _kv_cache(stage: ResolvedStage, model_path: Path, components: list[str], dtype: torch.dtype) -> KvCache:
    config = read_json(Path(model_path) / (components[0] if components else ".") / "config.json")
    if "thinker_config" in config:  # Qwen2.5-Omni: one folder, each AR stage's model nested (docs/speech.md)
        thinker = config.get("thinker_config") or {}
        config = (
            (thinker.get("text_config") or {}) if stage.stage_id == 0 else config.get("talker_config") or {}
        )
    text = text_config(config)
    args = stage.engine_args
    per_token = kv_bytes_per_token(text, dtype)
    length, source = args.max_model_len, "max_model_len"
    if not length:  # the stages then use the model's positions (engine._context_length, vLLM)
        length = int(getattr(text, "max_position_embeddings", 0) or 4096)
        source = "max_position_embeddings"
    return KvCache(per_token, int(length), args.batch_size, source, args.kv_cache_memory_bytes)


def _has_other_weights(folder: Path) -> bool:
    return any(folder.glob("*.bin")) or any(folder.glob("*.pt")) or any(folder.glob("*.pth"))


def estimate_stage(family: str, stage: ResolvedStage, model_path: Path) -> StageMemory:
    names = stage_components(family, stage, model_path)
    components, unreadable = [], []
    for name in names:
        weights = component_weights(model_path, name)
        if weights is not None:
            components.append(weights)
        elif (Path(model_path) / name).is_dir() and _has_other_weights(Path(model_path) / name):
            unreadable.append(name)
    dtype = _stage_dtype(stage)
    backend = _stage_backend(stage)
    kv = _kv_cache(stage, model_path, names, dtype) if stage.kind == "ar" else None
    devices = _stage_devices(stage, backend)
    element = torch.tensor([], dtype=dtype).element_size()
    copies = buffers = 0
    if backend == "vllm" and names:
        config = read_json(Path(model_path) / names[0] / "config.json")
        text = text_config(config)
        buffers = vllm_token_buffers(text, stage.engine_args.max_num_batched_tokens, element)
        if devices[0] == "cpu" and components:
            tied = bool(config.get("tie_word_embeddings", getattr(text, "tie_word_embeddings", False)))
            copies = vllm_cpu_copies(components[0], tied, element)
    work = None
    if stage.kind == "diffusion" and "transformer" in names and "vae" in names:
        transformer = read_json(Path(model_path) / "transformer" / "config.json")
        vae = read_json(Path(model_path) / "vae" / "config.json")
        work = diffusion_work(
            transformer,
            vae,
            stage.default_sampling_params,
            stage.engine_args.batch_size,
            element,
            image_to_image=family == "glm-image",
        )
    return StageMemory(
        stage, backend, dtype, tuple(components), tuple(unreadable), kv, devices, copies, buffers, work
    )
