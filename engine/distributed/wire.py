"""What crosses a process boundary when a stage's model runs elsewhere (a Ray actor, a stage process).

The far side runs the stage's own runner (the same class embedded mode runs) on jobs rebuilt from
:class:`JobSpec`, and streams back, in order, per job: the events it emits (progress, previews, text
deltas), every output payload it adds, and how it ended. Messages are tuples tagged by the job's index in
its call::

    ("event", i, event)  ("output", i, payload)  ("done", i, status, error, input_tokens, output_tokens,
                                                 finish_reason, max_new_tokens, step_rows, seconds)

The near side replays them on the engine's jobs (:func:`deliver`) exactly as the runner would have produced
them in-process, so batching, routing, cancel and run records see no difference, and the outputs are the
same bytes (docs/distributed.md, docs/batching.md).
"""

from __future__ import annotations

import collections
import itertools
import pickle
import threading
from abc import abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from engine.config import ResolvedStage
from engine.events import EngineEvent, FinishReason, StageStatus
from engine.modality import OutputAccumulator, OutputModality
from engine.request import RequestError
from engine.stages.base import JobDone, StageCancelled, StageJob, StageRunner

Message = tuple[Any, ...]


@dataclass(frozen=True)
class JobSpec:
    """One job as the far side sees it: the key the near side cancels it by, its inputs and parameters."""

    key: str
    request_id: str
    index: int
    inputs: dict[str, Any]
    params: dict[str, Any]
    cancelled: bool = False

    @classmethod
    def of(cls, key: str, job: StageJob) -> JobSpec:
        return cls(key, job.request_id, job.index, job.inputs, job.params, job.cancelled)


def portable_error(error: BaseException | None) -> tuple[str, ...] | BaseException | None:
    """An exception as it can cross processes: ``RequestError`` by its field, others pickled when they
    survive the round trip, else their type name and message."""
    if error is None:
        return None
    if isinstance(error, RequestError):
        return ("request", error.field, error.message)
    try:
        pickle.loads(pickle.dumps(error))
        return error
    except Exception:  # an exception class whose constructor pickle cannot replay
        return ("error", type(error).__name__, str(error))


def restore_error(payload: tuple[str, ...] | BaseException | None) -> Exception | None:
    if payload is None:
        return None
    if isinstance(payload, Exception):
        return payload
    if isinstance(payload, tuple) and payload and payload[0] == "request":
        return RequestError(payload[1], payload[2])
    if isinstance(payload, tuple) and len(payload) == 3:
        return RuntimeError(f"{payload[1]}: {payload[2]}")
    return RuntimeError(repr(payload))


class ForwardingAccumulator(OutputAccumulator):
    """The far side's accumulator: keeps the runner's view and forwards every payload, in order."""

    def __init__(self, modalities: Any, forward: Callable[[dict[str, Any]], None]) -> None:
        super().__init__(modalities)
        self._forward = forward

    def add(self, delta: Any) -> None:
        super().add(delta)
        self._forward(dict(delta))


def far_job(
    spec: JobSpec, i: int, modalities: tuple[OutputModality, ...], send: Callable[[Message], None]
) -> StageJob:
    """The far side's job for ``spec`` (index ``i`` in its call): its events and outputs go to ``send``."""
    job = StageJob(
        request_id=spec.request_id,
        index=spec.index,
        inputs=spec.inputs,
        params=spec.params,
        emit=lambda event: send(("event", i, event)),
        accumulator=ForwardingAccumulator(modalities, lambda payload: send(("output", i, payload))),
    )
    if spec.cancelled:
        job.cancel_event.set()
    return job


def done_message(
    i: int, job: StageJob, status: StageStatus, error: BaseException | None, seconds: float
) -> Message:
    """How job ``i`` ended, with what the near side's job must carry (token counts, finish reason)."""
    return (
        "done",
        i,
        str(status),
        portable_error(error),
        job.input_tokens,
        job.output_tokens,
        str(job.finish_reason),
        job.scratch.get("max_new_tokens"),
        job.scratch.get("step_rows", 0),
        seconds,  # the far side's own time for the job
    )


def deliver(
    jobs: list[StageJob], message: Message, results: dict[int, tuple[StageStatus, Exception | None]]
) -> None:
    """Replay one message on the near side's jobs; a ``done`` message fills ``results[i]``."""
    kind, i = message[0], message[1]
    job = jobs[i]
    if kind == "event":
        event: EngineEvent = message[2]
        job.emit(event)
    elif kind == "output":
        job.add_output(message[2])
    elif kind == "done":
        _, _, status, error, input_tokens, output_tokens, finish_reason, max_new, step_rows, _ = message
        job.input_tokens, job.output_tokens = int(input_tokens), int(output_tokens)
        job.finish_reason = FinishReason(finish_reason)
        if max_new is not None:
            job.scratch["max_new_tokens"] = max_new
        if step_rows:
            job.scratch["step_rows"] = int(step_rows)
        results[i] = (StageStatus(status), restore_error(error))


class RemoteStageRunner(StageRunner):
    """The near side of a stage whose model runs elsewhere; the engine drives it like any runner.

    Subclasses implement :meth:`call` (run jobs on the far side, replaying its messages, and return how
    each ended). What may share a batch is the family runner's rule, asked of an unloaded copy of it
    (``rules``: cheap, no weights); AR stages batch continuously on the far side and never ask.
    """

    remote_concurrent = False  # what the far side's runner says once loaded
    rules: StageRunner | None = None
    _keys = itertools.count()

    def __init__(self, stage: ResolvedStage, model_path: Path, device: torch.device) -> None:
        super().__init__(stage, model_path, device)
        self.handoff_s: collections.deque[float] = collections.deque(maxlen=1000)  # per job, latest last

    def job_keys(self, jobs: list[StageJob]) -> list[str]:
        """Keys the far side knows the jobs by (the near side cancels them by key); unique per call."""
        return [f"{job.request_id}/{job.index}/{next(self._keys)}" for job in jobs]

    def handoff_ms_p50(self) -> float | None:
        """The median hand-off over recent jobs: ms per job beyond the far side's own time."""
        handoff = sorted(self.handoff_s)
        return round(handoff[len(handoff) // 2] * 1000, 1) if handoff else None

    @property
    def concurrent(self) -> bool:  # type: ignore[override]  # a class attribute on the base; the far side's
        return self.remote_concurrent

    def batch_key(self, job: StageJob) -> Any:
        return self.rules.batch_key(job) if self.rules is not None else id(job)

    def total_steps(self, job: StageJob) -> int:
        if self.rules is not None:
            return self.rules.total_steps(job)
        return int(job.scratch.get("max_new_tokens", 0))

    @abstractmethod
    def call(self, jobs: list[StageJob]) -> list[tuple[StageStatus, Exception | None]]:
        """Run ``jobs`` on the far side; one (status, error) per job."""

    def run(self, jobs: list[StageJob]) -> None:
        status, error = self.call(jobs)[0]
        if status == StageStatus.FAILED:
            raise error or RuntimeError(f"stage {self.stage_id} failed without an error")
        if status == StageStatus.CANCELLED:
            raise StageCancelled()

    def submit(self, job: StageJob, done: JobDone) -> None:
        def call() -> None:
            try:
                status, error = self.call([job])[0]
            except Exception as exc:
                status, error = StageStatus.FAILED, exc
            done(status, error)

        threading.Thread(target=call, name=f"omni-remote-call-{self.stage_id}", daemon=True).start()
