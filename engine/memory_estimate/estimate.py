"""The estimate of a whole pipeline: every stage's memory summed per device against what the device has,
as a table, a verdict per device and, for a device that cannot hold its stages, the deploy keys that
would make them fit (docs/memory.md)."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch

from engine.config import ConfigProblem, PipelineConfig
from engine.memory_estimate.activations import PROCESS_RUNTIME_CPU, VLLM_DEFAULT_BATCHED_TOKENS
from engine.memory_estimate.checkpoints import ComponentWeights
from engine.memory_estimate.devices import DeviceBudget, device_budget
from engine.memory_estimate.stages import MARGIN_FLOOR, MARGIN_FRACTION, StageMemory, estimate_stage


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


# -- reporting -------------------------------------------------------------------------------------


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

    def processes(self, device: str) -> int:
        """Processes holding stages on the CPU: the engine's (its in-process stages) and one per stage with
        ``own_process``. Each carries the interpreter and its libraries (0 on a GPU)."""
        if device != "cpu":
            return 0
        stages = self.on_device().get(device, [])
        own = sum(1 for s in stages if s.stage.engine_args.own_process)
        return own + (1 if len(stages) > own else 0)

    def runtime(self, device: str) -> int:
        return self.processes(device) * PROCESS_RUNTIME_CPU

    def need(self, device: str) -> int:
        budget = self.budgets.get(device)
        return sum(s.claim(budget) for s in self.on_device().get(device, [])) + self.runtime(device)

    def table(self) -> str:
        head = (
            "stage", "component", "params", "dtype", "weights", "KV cache", "extra", "margin", "total", "device"
        )  # fmt: skip
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
                        (format_bytes(s.extra) if s.extra else "-") if first else "",
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
            if s.copies:
                notes.append(
                    f"stage {s.stage_id} extra: vLLM on the CPU keeps a packed copy of the embedding and LM head "
                    f"beside them: {format_bytes(s.copies)}"
                )
            if s.buffers:
                batched = s.stage.engine_args.max_num_batched_tokens
                notes.append(
                    f"stage {s.stage_id} extra: vLLM's input buffer for max_num_batched_tokens "
                    f"{batched or f'{VLLM_DEFAULT_BATCHED_TOKENS} (unset: assumed)'}: {format_bytes(s.buffers)}"
                )
            if s.work is not None:
                w = s.work
                source = f" + the DiT's cache of the source {format_bytes(w.dit_source_cache)}" * bool(
                    w.dit_source_cache
                )
                notes.append(
                    f"stage {s.stage_id} extra: working memory at {w.height}x{w.width} ({w.size_from}) x batch "
                    f"{w.batch}: the larger of a DiT forward {format_bytes(w.dit_forward)}{source} and the VAE "
                    f"decode {format_bytes(w.vae_decode)}"
                )
            if s.unreadable:
                notes.append(
                    f"stage {s.stage_id}: {', '.join(s.unreadable)} hold weights that are not safetensors: not counted"
                )
        for device in self.on_device():
            if self.runtime(device):
                notes.append(
                    f"{device}: + {format_bytes(self.runtime(device))} for the interpreter and libraries of "
                    f"{self.processes(device)} process(es)"
                )
        notes.append(
            f"margin: {MARGIN_FRACTION:.0%} of weights + copies + buffers + KV cache, at least "
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
