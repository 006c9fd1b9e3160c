"""The stage runner interface: load a model, run a batch of jobs in a worker thread, report through events."""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from engine.config import ResolvedStage
from engine.events import EngineEvent, FinishReason, StageStatus, TextDelta
from engine.modality import OutputAccumulator


class StageCancelled(Exception):
    """Raised inside a runner when every job of its batch was cancelled."""


@dataclass
class StageJob:
    """One variant of one request at one stage.

    ``inputs`` come from the request (entry stage) or from the input processor; ``params`` are the
    stage's resolved parameters. The runner fills ``outputs`` (keys per the stage's output modality) and
    the token counts, and reports progress through ``emit``.
    """

    request_id: str
    index: int
    inputs: dict[str, Any]
    params: dict[str, Any]
    emit: Callable[[EngineEvent], None]
    accumulator: OutputAccumulator
    cancel_event: threading.Event = field(default_factory=threading.Event)
    client: str = ""  # whom the job is for (the engine's fair queues; empty: a client of its own)
    scratch: dict[str, Any] = field(default_factory=dict)  # runner-private state between calls
    input_tokens: int = 0
    output_tokens: int = 0
    finish_reason: FinishReason = FinishReason.STOP

    @property
    def cancelled(self) -> bool:
        return self.cancel_event.is_set()

    def add_output(self, payload: dict[str, Any]) -> None:
        self.accumulator.add(payload)

    def advance_text(self, stage_id: int, text: str) -> str | None:
        """Given all text decoded so far, emit and return what is new since the last call.

        Backends decode the whole generation each step (incremental detokenizers space some tokenizers'
        first word differently), so every backend streams the same pieces. A piece ending in U+FFFD is a
        partial UTF-8 sequence: it waits for the next token.
        """
        previous = self.scratch.get("text", "")
        if not text.startswith(previous) or text.endswith("\ufffd"):
            return None
        piece = text[len(previous) :]
        if not piece:
            return None
        self.scratch["text"] = text
        self.emit(TextDelta(self.request_id, self.index, stage_id, text=piece))
        return piece

    def deliver_outputs(self) -> dict[str, Any]:
        return self.accumulator.deliver()


JobDone = Callable[[StageStatus, "Exception | None"], None]  # (status, error)


# A model this small is dispatch-bound on a CPU: its matrices are too small to split across cores, and
# the OpenMP fork/join of every op costs more than it saves (worse still when the cores are busy). Its
# stage runs on one intra-op thread, which also lets two stages overlap on two cores (AR of one request
# while another's DiT denoises). The float math does not change (same PNG bytes: docs/batching.md).
SINGLE_THREAD_MAX_PARAMETERS = 50_000_000


def intra_op_threads_for(modules: list[torch.nn.Module], device: torch.device) -> int | None:
    """1 for small models on a CPU (see SINGLE_THREAD_MAX_PARAMETERS), else None (the process's)."""
    if device.type != "cpu":
        return None
    parameters = sum(p.numel() for module in modules for p in module.parameters())
    return 1 if parameters <= SINGLE_THREAD_MAX_PARAMETERS else None


class StageRunner(ABC):
    """Runs one stage's model.

    Two ways to take work: ``run`` (the default) is called from the stage's single worker thread with a
    batch of compatible jobs and returns when they are done. A runner with its own scheduler (vLLM's
    continuous batching) sets ``concurrent = True`` and implements ``submit`` instead: the worker hands it
    each job as it arrives, up to ``max_num_seqs`` in flight, and the runner calls ``done`` when the job
    finishes. A concurrent runner that ``pauses_rows`` may be handed more (docs/batching.md, "Fair
    admission"): it then steps at most ``max_num_seqs`` jobs at a time, pausing others.
    """

    kind: str = ""
    concurrent: bool = False
    pauses_rows: bool = False
    # Batches the engine may run at once (one worker thread each): 1 in-process; a stage with several
    # Ray replicas runs one batch per replica (engine/distributed/ray_stage.py).
    parallel_batches: int = 1

    def __init__(self, stage: ResolvedStage, model_path: Path, device: torch.device) -> None:
        self.stage = stage
        self.model_path = Path(model_path)
        self.device = device
        self.loaded = False

    @property
    def stage_id(self) -> int:
        return self.stage.stage_id

    @property
    def intra_op_threads(self) -> int | None:
        """Intra-op threads for the thread that runs this stage's model (``torch.set_num_threads`` there,
        a per-thread setting), or None to keep the process's; see :func:`intra_op_threads_for`."""
        return None

    @property
    def max_batch_size(self) -> int:
        return self.stage.engine_args.batch_size

    @property
    def decode_path(self) -> str | None:
        """How this stage's decode batches, in words (AR stages; None for others)."""
        return None

    @property
    def torch_dtype(self) -> torch.dtype:
        name = self.stage.engine_args.dtype_name
        return {"bfloat16": torch.bfloat16, "float16": torch.float16}.get(name, torch.float32)

    @abstractmethod
    def load(self) -> None:
        """Load weights (called once, at engine start)."""

    def close(self) -> None:
        """Release the model. Safe to call twice."""
        self.loaded = False

    def batch_key(self, job: StageJob) -> Hashable:
        """Jobs with equal keys may run in one batch."""
        return id(job)

    def total_steps(self, job: StageJob) -> int:
        """How many progress steps the job will report (0 if unknown)."""
        return 0

    @abstractmethod
    def run(self, jobs: list[StageJob]) -> None:
        """Run ``jobs`` to completion, adding each job's outputs."""

    def submit(self, job: StageJob, done: JobDone) -> None:
        """Start ``job`` without blocking (``concurrent`` runners only); call ``done`` exactly once."""
        raise NotImplementedError(f"{type(self).__name__} is not a concurrent runner")


def run_batch(runner: StageRunner, jobs: list[StageJob]) -> tuple[StageStatus, Exception | None]:
    """Run a batch on the calling thread (the engine's stage worker, a Ray actor's, a stage process's) with
    the stage's own intra-op threads (the same float math, so the same bytes everywhere); a failing batch
    fails its jobs, never the caller."""
    if runner.intra_op_threads is not None:
        torch.set_num_threads(runner.intra_op_threads)  # this thread's setting only
    try:
        runner.run(jobs)
    except StageCancelled:
        return StageStatus.CANCELLED, None
    except Exception as exc:  # the batch fails; the caller keeps serving
        return StageStatus.FAILED, exc
    return StageStatus.SUCCEEDED, None
