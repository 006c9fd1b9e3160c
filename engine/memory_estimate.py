"""How much memory each stage will take, from the checkpoint's files, without loading it (docs/memory.md).

For every stage: its components' weights (parameter counts and dtypes from the safetensors headers: the
8-byte little-endian header length and the JSON header of each file, never a tensor), the KV cache of an
AR stage (``max_num_seqs`` sequences of ``max_model_len`` tokens, per token as the AR stages compute it)
and a margin for activations and runtime; summed per device (a stage's ``devices``) against what the
device has free. ``omni-studio validate --check-devices`` and the Pipeline tab's Validate print it and
report a device that cannot hold its stages, with the deploy keys that would make them fit.
"""

from __future__ import annotations

import importlib
import json
import math
import struct
import types
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from engine.config import ConfigProblem, PipelineConfig, ResolvedStage
from engine.kv_cache import kv_bytes_per_token

# The margin for activations and runtime, per stage: a fraction of its weights + KV cache, at least a floor
# per device kind. docs/memory.md says where these numbers come from.
MARGIN_FRACTION = 0.20
MARGIN_FLOOR = {"cpu": 256 << 20, "cuda": 512 << 20}

# safetensors dtype names -> bytes per element
SAFETENSORS_DTYPE_BYTES = {
    "F64": 8,
    "F32": 4,
    "F16": 2,
    "BF16": 2,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "F8_E8M0": 1,
    "I64": 8,
    "I32": 4,
    "I16": 2,
    "I8": 1,
    "U64": 8,
    "U32": 4,
    "U16": 2,
    "U8": 1,
    "BOOL": 1,
}
FLOAT_DTYPES = {"F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2", "F8_E8M0"}
MAX_HEADER_BYTES = 100 << 20  # safetensors' own limit on the JSON header


class CheckpointError(ValueError):
    """A checkpoint file that is not what it claims (a broken safetensors header, a missing shard)."""


# -- reading checkpoints --------------------------------------------------------------------------


@dataclass(frozen=True)
class TensorHeader:
    name: str
    dtype: str  # safetensors' name: F32, BF16, I64...
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * SAFETENSORS_DTYPE_BYTES[self.dtype]


def read_safetensors_header(path: Path) -> list[TensorHeader]:
    """The tensors of a ``.safetensors`` file (name, dtype, shape), read from its header only."""
    path = Path(path)
    with path.open("rb") as file:
        head = file.read(8)
        if len(head) != 8:
            raise CheckpointError(f"{path}: too short for a safetensors file")
        (length,) = struct.unpack("<Q", head)
        if length > MAX_HEADER_BYTES:
            raise CheckpointError(f"{path}: header length {length} is not a safetensors header")
        raw = file.read(length)
    if len(raw) != length:
        raise CheckpointError(f"{path}: the header is cut short ({len(raw)} of {length} bytes)")
    try:
        header = json.loads(raw)
    except ValueError as exc:
        raise CheckpointError(f"{path}: the header is not JSON ({exc})") from exc
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: the header is not a JSON object")
    tensors = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dtype = info.get("dtype") if isinstance(info, dict) else None
        shape = info.get("shape") if isinstance(info, dict) else None
        if dtype not in SAFETENSORS_DTYPE_BYTES or not isinstance(shape, list):
            raise CheckpointError(f"{path}: tensor {name!r} has dtype {dtype!r} and shape {shape!r}")
        tensors.append(TensorHeader(name, dtype, tuple(int(d) for d in shape)))
    return tensors


def checkpoint_files(folder: Path) -> list[Path]:
    """The safetensors files a loader reads from ``folder``: the shards its index names (a sharded
    checkpoint), else its ``*.safetensors`` files; files of a variant (``*.fp16.safetensors``) only when
    the folder has nothing else (transformers and diffusers load the plain files unless asked)."""
    folder = Path(folder)
    indexes = sorted(folder.glob("*.safetensors.index.json"))
    plain_indexes = [p for p in indexes if "." not in p.name.removesuffix(".safetensors.index.json")]
    for index in plain_indexes or indexes:
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise CheckpointError(f"{index}: not a safetensors index ({exc})") from exc
        files = [folder / name for name in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise CheckpointError(f"{index} names shard(s) that are not there: {', '.join(missing)}")
        return files
    files = sorted(folder.glob("*.safetensors"))
    plain = [f for f in files if "." not in f.name.removesuffix(".safetensors")]
    return plain or files


@dataclass(frozen=True)
class ComponentWeights:
    """One component folder's weights, as its safetensors headers describe them."""

    name: str  # the folder inside the model ('.' for the model's own folder)
    files: tuple[Path, ...]
    tensors: tuple[TensorHeader, ...]

    @property
    def params(self) -> int:
        return sum(t.numel for t in self.tensors)

    @property
    def file_dtypes(self) -> tuple[str, ...]:
        return tuple(sorted({t.dtype for t in self.tensors}))

    @property
    def file_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    def loaded_bytes(self, dtype: torch.dtype) -> int:
        """Bytes once loaded with ``dtype``: floating tensors take it, the others keep theirs."""
        size = torch.tensor([], dtype=dtype).element_size()
        return sum(t.numel * size if t.dtype in FLOAT_DTYPES else t.nbytes for t in self.tensors)


def component_weights(model_path: Path, name: str) -> ComponentWeights | None:
    """The weights in ``model_path/name`` (None when it holds no safetensors file)."""
    folder = Path(model_path) / name
    files = checkpoint_files(folder) if folder.is_dir() else []
    if not files:
        return None
    tensors = tuple(t for f in files for t in read_safetensors_header(f))
    return ComponentWeights(name, tuple(files), tensors)


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def stage_components(family: str, stage: ResolvedStage, model_path: Path) -> list[str]:
    """The component folders ``stage`` loads, as each family's runners load them (engine/pipelines/)."""
    if family == "chat":
        return ["."]
    from engine.pipelines.glm_image import AR_COMPONENT, PROCESSOR_COMPONENT

    if family == "glm-image" and stage.kind == "ar":
        return [AR_COMPONENT]
    skip = {AR_COMPONENT, PROCESSOR_COMPONENT} if family == "glm-image" else set()
    index = _read_json(Path(model_path) / "model_index.json")
    # A component saved as [null, null] is absent (e.g. SD3 without its T5); keys with "_" are metadata.
    return [
        name
        for name, spec in index.items()
        if not name.startswith("_") and name not in skip and isinstance(spec, list) and spec != [None, None]
    ]


# -- the KV cache ---------------------------------------------------------------------------------


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


# -- devices --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DeviceBudget:
    """What a device has for the stages: ``free`` bytes now, of ``total``."""

    free: int
    total: int


def machine_ram() -> DeviceBudget:
    """The CPU's budget: MemAvailable of /proc/meminfo (Linux), else psutil's when it is installed."""
    info: dict[str, int] = {}
    try:
        with open("/proc/meminfo") as file:
            for line in file:
                key, _, value = line.partition(":")
                info[key] = int(value.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        info = {}
    if "MemAvailable" in info:
        return DeviceBudget(info["MemAvailable"], info.get("MemTotal", info["MemAvailable"]))
    memory = importlib.import_module("psutil").virtual_memory()  # ImportError: no way to tell
    return DeviceBudget(int(memory.available), int(memory.total))


def device_budget(device: str) -> DeviceBudget | None:
    """``device``'s budget on this machine (None: it does not have that device)."""
    if device == "cpu":
        return machine_ram()
    index = int(device.split(":")[1])
    if not torch.cuda.is_available() or index >= torch.cuda.device_count():
        return None
    free, total = torch.cuda.mem_get_info(index)
    return DeviceBudget(int(free), int(total))


# -- the estimate ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class StageMemory:
    stage: ResolvedStage
    backend: str  # transformers | vllm | diffusers
    dtype: torch.dtype
    components: tuple[ComponentWeights, ...]
    unreadable: tuple[str, ...]  # component folders with weights that are not safetensors (not counted)
    kv: KvCache | None
    devices: tuple[str, ...]  # where its memory goes: one device, or vLLM's tensor/pipeline workers' GPUs

    @property
    def stage_id(self) -> int:
        return self.stage.stage_id

    @property
    def weights(self) -> int:
        return sum(c.loaded_bytes(self.dtype) for c in self.components)

    @property
    def kv_bytes(self) -> int:
        return self.kv.bytes if self.kv is not None else 0

    def total_if(self, *, kv_bytes: int | None = None, weights: int | None = None) -> int:
        """The total with another KV cache size or weights (what a changed deploy key would give)."""
        weights = self.weights if weights is None else weights
        kv_bytes = self.kv_bytes if kv_bytes is None else kv_bytes
        floor = MARGIN_FLOOR["cpu" if self.devices[0] == "cpu" else "cuda"] * len(self.devices)
        return weights + kv_bytes + max(int(MARGIN_FRACTION * (weights + kv_bytes)), floor)

    @property
    def margin(self) -> int:
        return self.total - self.weights - self.kv_bytes

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
    config = _read_json(Path(model_path) / components[0] / "config.json") if components else {}
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
    return StageMemory(
        stage, backend, dtype, tuple(components), tuple(unreadable), kv, _stage_devices(stage, backend)
    )


def estimate_memory(
    config: PipelineConfig,
    model_path: Path,
    budgets: Mapping[str, DeviceBudget] | None = None,
    budget_of: Callable[[str], DeviceBudget | None] = device_budget,
) -> MemoryEstimate:
    """Estimate every stage of ``config`` from the files in ``model_path`` and look up each device's
    budget (``budgets`` first, e.g. a pretend device in a test, then ``budget_of``)."""
    stages = tuple(estimate_stage(config.family, stage, model_path) for stage in config.stages)
    given = dict(budgets or {})
    # The stages' devices, and every other one a stage could move to (the CPU, this machine's GPUs).
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    others = {"cpu", *(f"cuda:{i}" for i in range(gpus)), *given}
    wanted = sorted({d for s in stages for d in s.devices} | others)
    found = {d: given[d] if d in given else budget_of(d) for d in wanted}
    return MemoryEstimate(stages, {d: b for d, b in found.items() if b is not None})


# -- reporting ------------------------------------------------------------------------------------


def format_bytes(n: float) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= size:
            return f"{n / size:.1f} {unit}"
    return f"{int(n)} B"


def format_count(n: int) -> str:
    for unit, size in (("B", 10**9), ("M", 10**6), ("K", 10**3)):
        if n >= size:
            return f"{n / size:.1f}{unit}"
    return str(n)


DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def _dtype_cell(stage: StageMemory, component: ComponentWeights) -> str:
    loaded = DTYPE_NAMES.get(stage.dtype, str(stage.dtype).removeprefix("torch."))
    files = "/".join(component.file_dtypes)
    same = {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}.get(loaded) == files
    return loaded if same else f"{loaded} (file {files})"


@dataclass
class MemoryEstimate:
    stages: tuple[StageMemory, ...]
    budgets: dict[str, DeviceBudget] = field(default_factory=dict)  # devices this machine has

    def on_device(self) -> dict[str, list[StageMemory]]:
        placed: dict[str, list[StageMemory]] = {}
        for stage in self.stages:
            for device in stage.devices:
                placed.setdefault(device, []).append(stage)
        return placed

    def need(self, device: str) -> int:
        budget = self.budgets.get(device)
        return sum(s.claim(budget) for s in self.on_device().get(device, []))

    def table(self) -> str:
        head = ("stage", "component", "params", "dtype", "weights", "KV cache", "margin", "total", "device")
        rows: list[tuple[str, ...]] = []
        for s in self.stages:
            components: list[ComponentWeights | None] = list(s.components) or [None]
            for i, c in enumerate(components):
                first = i == 0
                rows.append(
                    (
                        str(s.stage_id) if first else "",
                        c.name if c is not None else "(no safetensors)",
                        format_count(c.params) if c is not None else "-",
                        _dtype_cell(s, c) if c is not None else "-",
                        format_bytes(c.loaded_bytes(s.dtype)) if c is not None else "-",
                        (format_bytes(s.kv_bytes) if s.kv is not None else "-") if first else "",
                        format_bytes(s.margin) if first else "",
                        format_bytes(s.total) if first else "",
                        ",".join(s.devices) if first else "",
                    )
                )
        widths = [max(len(r[i]) for r in (head, *rows)) for i in range(len(head))]
        lines = [
            "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
            for row in (head, *rows)
        ]
        notes = []
        for s in self.stages:
            if s.kv is not None and s.kv.fixed_bytes is None:
                notes.append(
                    f"stage {s.stage_id} KV cache: {format_bytes(s.kv.bytes_per_token)}/token x max_model_len "
                    f"{s.kv.max_model_len}{'' if s.kv.length_from == 'max_model_len' else ' (unset: the model maximum)'}"
                    f" x max_num_seqs {s.kv.max_num_seqs}"
                )
            elif s.kv is not None:
                notes.append(f"stage {s.stage_id} KV cache: kv_cache_memory_bytes {s.kv.fixed_bytes}")
            if s.unreadable:
                notes.append(
                    f"stage {s.stage_id}: {', '.join(s.unreadable)} hold weights that are not safetensors: not counted"
                )
        notes.append(
            f"margin: {MARGIN_FRACTION:.0%} of weights + KV cache, at least "
            f"{format_bytes(MARGIN_FLOOR['cpu'])} on a CPU and {format_bytes(MARGIN_FLOOR['cuda'])} on a GPU "
            "(docs/memory.md)"
        )
        return "\n".join([*lines, *notes])

    def verdict(self) -> list[str]:
        """One line per device: what its stages need against what it has."""
        lines = []
        for device, stages in self.on_device().items():
            ids = ", ".join(str(s.stage_id) for s in stages)
            budget = self.budgets.get(device)
            need = self.need(device)
            reserved = [s for s in stages if s.claim(budget) > s.share]
            note = "".join(
                f"; stage {s.stage_id} on vLLM takes gpu_memory_utilization "
                f"{s.stage.engine_args.gpu_memory_utilization} of it"
                for s in reserved
            )
            if budget is None:
                lines.append(
                    f"{device}: stage(s) {ids} need {format_bytes(need)}; not on this machine, not checked"
                )
                continue
            kind = "available" if device == "cpu" else "free"
            fits = "fits" if need <= budget.free else "does NOT fit"
            lines.append(
                f"{device}: stage(s) {ids} need {format_bytes(need)} of {format_bytes(budget.free)} {kind}: "
                f"{fits}{note}"
            )
        return lines

    def report(self) -> str:
        return "\n".join([self.table(), *self.verdict()])

    def problems(self) -> list[ConfigProblem]:
        """A problem for each device its stages do not fit, naming the keys to change and by how much."""
        problems = []
        for device, stages in self.on_device().items():
            budget = self.budgets.get(device)
            if budget is None:
                continue  # a GPU this machine lacks: device_problems reports it
            need = self.need(device)
            short = [s for s in stages if s.vllm_on_gpu and self._vllm_short(s, budget)]
            if need <= budget.free and not short:
                continue
            kind = "available" if device == "cpu" else "free"
            for s in short:
                problems.append(self._vllm_problem(s, device, budget))
            if need <= budget.free:
                continue
            ids = [s.stage_id for s in stages]
            who = "needs" if len(ids) == 1 else f"stages {', '.join(map(str, ids))} need"
            detail = (
                ""
                if len(stages) == 1
                else " ("
                + ", ".join(f"stage {s.stage_id}: {format_bytes(s.claim(budget))}" for s in stages)
                + ")"
            )
            head = (
                f"{who} {format_bytes(need)} on {device} which has {format_bytes(budget.free)} {kind}{detail}"
            )
            fixes = self._fixes(device, stages, need - budget.free, budget)
            message = head + ("; " + "; or ".join(fixes) if fixes else "")
            problems.append(ConfigProblem(ids[0] if len(ids) == 1 else None, "memory", message))
        return problems

    @staticmethod
    def _vllm_short(stage: StageMemory, budget: DeviceBudget) -> bool:
        """vLLM on a GPU keeps to gpu_memory_utilization of it: the stage must fit in that."""
        if stage.stage.engine_args.kv_cache_memory_bytes is not None:
            return False
        utilization = stage.stage.engine_args.gpu_memory_utilization or 0.9
        return stage.share > utilization * budget.total

    def _vllm_problem(self, stage: StageMemory, device: str, budget: DeviceBudget) -> ConfigProblem:
        share = stage.share
        utilization = stage.stage.engine_args.gpu_memory_utilization or 0.9
        wanted = math.ceil(share / budget.total * 100) / 100
        fixes = []
        if wanted <= 1.0:
            fixes.append(f"raise gpu_memory_utilization from {utilization} to {wanted:.2f}")
        fixes += self._stage_fixes(stage, share - int(utilization * budget.total))
        return ConfigProblem(
            stage.stage_id,
            "gpu_memory_utilization",
            f"needs {format_bytes(share)} on {device} but vLLM keeps to gpu_memory_utilization {utilization} "
            f"of its {format_bytes(budget.total)} ({format_bytes(utilization * budget.total)})"
            + ("; " + "; or ".join(fixes) if fixes else ""),
        )

    def _fixes(self, device: str, stages: list[StageMemory], deficit: int, budget: DeviceBudget) -> list[str]:
        fixes = []
        for s in stages:
            share = s.share
            claim = s.claim(budget)
            prefix = f"stage {s.stage_id}: " if len(stages) > 1 else ""
            if claim > share:  # vLLM's reservation: a smaller one still holding the stage
                utilization = s.stage.engine_args.gpu_memory_utilization or 0.9
                lower = math.floor((claim - deficit) / budget.total * 100) / 100
                if lower * budget.total >= share and lower > 0:
                    fixes.append(
                        f"{prefix}lower gpu_memory_utilization from {utilization} to {lower:.2f} "
                        f"(saves {format_bytes(claim - lower * budget.total)})"
                    )
                continue
            fixes += [prefix + fix for fix in self._stage_fixes(s, deficit)]
            fixes += [prefix + fix for fix in self._move(s, device)]
        return fixes

    @staticmethod
    def _stage_fixes(s: StageMemory, deficit: int) -> list[str]:
        """A smaller KV cache (max_model_len, max_num_seqs) or dtype for ``s``, each with what it saves on
        each of the stage's devices (its margin shrinks with it)."""
        fixes = []
        n = len(s.devices)

        def saving(**change: int) -> int:
            return s.share - math.ceil(s.total_if(**change) / n)

        kv = s.kv
        if kv is not None and kv.fixed_bytes is None and kv.bytes > 0:
            max_tokens = s.stage.default_sampling_params.get("max_tokens")
            floor = max(256, max_tokens if isinstance(max_tokens, int) else 0)
            per_len = kv.bytes_per_token * kv.max_num_seqs
            length = _halved(kv.max_model_len, lambda v: saving(kv_bytes=v * per_len), deficit, floor)
            if length is not None:
                what = (
                    f"lower max_model_len from {kv.max_model_len} to {length}"
                    if kv.length_from == "max_model_len"
                    else f"set max_model_len: {length} (unset, it is the model's {kv.max_model_len})"
                )
                fixes += _saves(what, saving(kv_bytes=length * per_len), deficit)
            per_seq = kv.bytes_per_token * kv.max_model_len
            seqs = _halved(kv.max_num_seqs, lambda v: saving(kv_bytes=v * per_seq), deficit, 1)
            if seqs is not None:
                what = f"lower max_num_seqs from {kv.max_num_seqs} to {seqs}"
                fixes += _saves(what, saving(kv_bytes=seqs * per_seq), deficit)
        elif kv is not None and kv.fixed_bytes is not None and kv.fixed_bytes > deficit:
            smaller = kv.fixed_bytes - deficit
            what = f"lower kv_cache_memory_bytes from {kv.fixed_bytes} to {smaller}"
            fixes += _saves(what, saving(kv_bytes=smaller), deficit)
        if s.dtype == torch.float32 and s.weights > 0:
            half = sum(c.loaded_bytes(torch.bfloat16) for c in s.components)
            what = f"set dtype: bfloat16 (dtype {s.stage.engine_args.dtype_name} loads float32)"
            fixes += _saves(what, saving(weights=half), deficit)
        return fixes

    def _move(self, s: StageMemory, device: str) -> list[str]:
        if len(s.devices) > 1:
            return []
        for other, budget in self.budgets.items():
            if other == device:
                continue
            room = budget.free - self.need(other)
            if s.total <= room:
                spec = "cpu" if other == "cpu" else f"'{other.split(':')[1]}'"
                return [
                    f"move it with devices: {spec} ({format_bytes(room)} left there)"
                    + (" (slow on a CPU)" if other == "cpu" else "")
                ]
        return []


def _halved(current: int, saving: Callable[[int], int], deficit: int, floor: int) -> int | None:
    """The largest of current/2, current/4, ... (not below ``floor``) whose saving covers ``deficit``;
    else the smallest of them (it helps, but not enough alone); None when none is allowed."""
    value, last = current // 2, None
    while value >= floor:
        if saving(value) >= deficit:
            return value
        last, value = value, value // 2
    return last


def _saves(what: str, saved: int, deficit: int) -> list[str]:
    """``what`` with its saving; nothing when it saves under a quarter of ``deficit`` (noise)."""
    if saved * 4 < deficit:
        return []
    return [f"{what} (saves {format_bytes(saved)}{'' if saved >= deficit else '; not enough alone'})"]
