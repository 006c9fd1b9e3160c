"""Chunked hand-off: a stage that consumes its upstream AR stage's output while it is being generated.

A stage with ``chunk_size`` in its deploy config (engine/config) does not wait for its source to finish.
The source's runner publishes its outputs so far after each token (:func:`publish_partial`); the engine
runs the hand-off's input processor on them and puts the result in the downstream job's
:class:`ChunkFeed` (``job.inputs[CHUNK_FEED_KEY]``), queueing that job at the first publication. When the
source finishes, the engine publishes its final outputs and marks the feed ``final``. The downstream
runner reads the feed and works in chunks of ``chunk_size`` source tokens, each decided by the tokens
alone (never by timing), so a request gives the same chunks however fast its source runs
(docs/speech.md, "Streaming").

A source whose runner does not publish (a stage in another process, a runner without the hook) still
works: the feed then fills once, final, and the downstream renders the same chunks back to back.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from typing import Any

from engine.config import ConfigProblem, PipelineConfig
from engine.stages.base import StageCancelled, StageJob, StageRunner

CHUNK_FEED_KEY = "chunk_feed"  # job.inputs: the ChunkFeed of a stage that consumes its input in chunks
PUBLISH_KEY = "publish_partial"  # job.scratch: where a source's runner hands its outputs so far

# How often a waiting consumer looks at its request's cancel flag (a cancel also wakes it at once
# when it comes through ChunkFeed.close).
CANCEL_POLL_S = 0.05

Publisher = Callable[[Mapping[str, Any]], None]


class ChunkFeed:
    """The inputs of a stage that consumes its source in chunks: replaced as the source publishes its
    outputs so far, ``final`` once the source has finished. Thread-safe: the source's thread publishes,
    the consumer's thread waits."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._inputs: dict[str, Any] = {}
        self._final = False
        self._closed = False
        self._listeners: list[threading.Event] = []
        self.publications = 0  # how many times the inputs were replaced (tests and progress)

    def subscribe(self, event: threading.Event) -> None:
        """Set ``event`` at every publication and at close (a consumer that waits on many feeds at once)."""
        with self._cond:
            self._listeners.append(event)
            if self._inputs or self._final or self._closed:
                event.set()

    def publish(self, inputs: Mapping[str, Any], *, final: bool = False) -> None:
        """Replace the inputs with the hand-off of the source's outputs so far (``final``: all of them)."""
        with self._cond:
            if self._final:
                return  # the final inputs never change
            self._inputs = dict(inputs)
            self._final = final
            self.publications += 1
            self._cond.notify_all()
            for event in self._listeners:
                event.set()

    def close(self) -> None:
        """Wake every waiter (the request was cancelled or failed); it then checks its cancel flag."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
            for event in self._listeners:
                event.set()

    @property
    def final(self) -> bool:
        with self._cond:
            return self._final

    def snapshot(self) -> tuple[dict[str, Any], bool]:
        with self._cond:
            return dict(self._inputs), self._final

    def wait(
        self, ready: Callable[[Mapping[str, Any], bool], bool], job: StageJob
    ) -> tuple[dict[str, Any], bool]:
        """Block until ``ready(inputs, final)`` holds (it is called under the feed's lock, so keep it
        cheap) and return that view; raises :class:`StageCancelled` when the job is cancelled."""
        with self._cond:
            while True:
                if job.cancelled:
                    raise StageCancelled()
                if ready(self._inputs, self._final):
                    return dict(self._inputs), self._final
                if self._closed:
                    raise StageCancelled()
                self._cond.wait(CANCEL_POLL_S)


def publish_partial(job: StageJob) -> None:
    """Called by a source runner after each DELTA it adds: hand the outputs so far downstream, when the
    engine asked for them (a stage consumes this one in chunks); nothing otherwise."""
    publisher: Publisher | None = job.scratch.get(PUBLISH_KEY)
    if publisher is not None and not job.cancelled:
        publisher(job.accumulator.peek())


def chunking_problems(config: PipelineConfig, runners: Mapping[int, StageRunner]) -> list[ConfigProblem]:
    """Stages with ``chunk_size`` whose runner cannot consume its input in chunks (checked at start-up,
    once the runners exist: a runner says so with ``consumes_chunks``; a stage in another process or
    on Ray does not, since the feed lives in this process)."""
    problems = []
    for stage in config.stages:
        runner = runners.get(stage.stage_id)
        if stage.engine_args.chunk_size and not getattr(runner, "consumes_chunks", False):
            where = " in its own process" if stage.engine_args.own_process else ""
            problems.append(
                ConfigProblem(
                    stage.stage_id,
                    "chunk_size",
                    f"stage {stage.stage_id} ({stage.kind}{where}) cannot consume its input in chunks; "
                    "allowed: null here (chunks are read by stages that render them in this process, "
                    "e.g. qwen-omni's code2wav)",
                )
            )
    return problems
