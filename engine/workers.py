"""Stage workers and their bookkeeping: the thread per stage that takes queued jobs, batches compatible
ones (up to the stage's ``max_num_seqs``) and runs them, fairly across clients; and what the engine
tracks per request (:class:`RequestHandle`, one :class:`Variant` per output, a :class:`Ticket` per queued job).

A worker reports to its engine (:class:`WorkerHost`, which :class:`engine.engine.OmniEngine` is) when a
job starts and when it is done; routing the result onward is the engine's (``engine/engine.py``).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from engine.client_load import HOLD_LIMIT_S, ClientLoad
from engine.config import (
    ResolvedStage,
)
from engine.events import (
    EngineEvent,
    StageStatus,
)
from engine.request import ResolvedRequest
from engine.stages.base import StageJob, StageRunner, run_batch
from engine.streaming import ChunkFeed

EventSink = Callable[[EngineEvent], None]

log = logging.getLogger("omni_studio.engine")


# -- bookkeeping per request ----------------------------------------------------------------------


@dataclass
class Variant:
    """One of a request's ``n`` outputs flowing through the stages."""

    index: int
    seed: int
    outputs: dict[int, dict[str, Any]] = field(default_factory=dict)
    jobs: dict[int, StageJob] = field(default_factory=dict)
    # Per stage that consumes its source in chunks: the feed its job reads (engine/streaming.py).
    feeds: dict[int, ChunkFeed] = field(default_factory=dict)
    done: bool = False


@dataclass(eq=False)  # one queued job is itself, whatever its fields (queue membership tests)
class Ticket:
    """A queued job with what the engine needs to route its result."""

    job: StageJob
    handle: RequestHandle
    variant: Variant
    stage: ResolvedStage
    enqueued_at: float

    @property
    def client(self) -> str:
        """Whom the job is served for in the stage queue's round-robin (its request, when anonymous)."""
        return self.job.client


class RequestHandle:
    """A submitted request: cancel it, or wait for its terminal event."""

    def __init__(
        self, resolved: ResolvedRequest, sink: EventSink, stages: frozenset[int] = frozenset()
    ) -> None:
        self.resolved = resolved
        self.sink = sink
        self.cancel_event = threading.Event()
        self.variants = [Variant(i, resolved.seed + i) for i in range(resolved.n)]
        self.terminal: EngineEvent | None = None
        self.submitted_at = time.time()
        self.stages = stages  # the stage ids it runs (PipelineConfig.stages_for its modalities)

    @property
    def request_id(self) -> str:
        return self.resolved.request_id

    @property
    def client(self) -> str:
        """Whom it is served for in the stages' fair queues (its own id, when anonymous)."""
        return self.resolved.request.client or f"request:{self.request_id}"

    def cancel(self) -> None:
        self.cancel_event.set()

    def emit(self, event: EngineEvent) -> None:
        # RuntimeError: the consumer's event loop is gone (client disconnected, loop closed).
        with contextlib.suppress(RuntimeError):
            self.sink(event)


# -- stage workers --------------------------------------------------------------------------------


# How often a held-back batch looks again (the lighter request may have finished).
HOLD_POLL_S = 0.02


class StageWorker:
    """The single thread that runs one stage's jobs, batching compatible ones."""

    def __init__(self, runner: StageRunner, engine: WorkerHost) -> None:
        self.runner = runner
        self.engine = engine
        self.queue: list[Ticket] = []
        # Fair queue: when each client was last served (a counter), so waiting jobs are taken round-robin
        # across clients: one client's sixteen cannot hold another's one for more than about one job.
        self._served: dict[str, int] = {}
        self._serve_count = 0
        self.cond = threading.Condition()
        self.stopping = False
        self.running = 0  # batch runners: batches running now (one per worker thread)
        self.in_flight = 0  # concurrent runners: jobs handed to the runner and not yet done
        self.in_flight_by_client: dict[str, int] = {}
        self._holding_since: float | None = None  # a heavier client's batch held back since (monotonic)
        # One thread per batch the runner can take at once: 1 in-process, one per replica on Ray.
        slots = 1 if runner.concurrent else max(1, int(runner.parallel_batches))
        self.threads = [
            threading.Thread(
                target=self._loop, name=f"omni-stage-{runner.stage_id}" + (f"-{i}" if i else ""), daemon=True
            )
            for i in range(slots)
        ]
        self.thread = self.threads[0]
        for thread in self.threads:
            thread.start()

    def submit(self, ticket: Ticket) -> None:
        with self.cond:
            self.queue.append(ticket)
            self.cond.notify()

    @property
    def depth(self) -> int:
        return len(self.queue)

    def fair_order(self) -> list[Ticket]:
        """The queue in the order it will be served: clients round-robin, lighter clients (fewer requests
        in flight in the engine) first, then the one served longest ago (or never), each client's own
        jobs oldest first. Callers hold ``cond``."""
        by_client: dict[str, list[Ticket]] = {}
        for ticket in self.queue:
            by_client.setdefault(ticket.client, []).append(ticket)
        load = self.engine.client_load.snapshot()
        clients = sorted(
            by_client, key=lambda c: (load.get(c, 0), self._served.get(c, -1), by_client[c][0].enqueued_at)
        )
        order: list[Ticket] = []
        for turn in range(max((len(jobs) for jobs in by_client.values()), default=0)):
            order += [by_client[c][turn] for c in clients if turn < len(by_client[c])]
        return order

    def _take(self, ticket: Ticket) -> None:
        """Remove ``ticket`` from the queue as served now (callers hold ``cond``)."""
        self.queue.remove(ticket)
        self._serve_count += 1
        self._served[ticket.client] = self._serve_count
        if len(self._served) > 10_000:  # forget the clients served longest ago
            for client in sorted(self._served, key=self._served.__getitem__)[:5_000]:
                del self._served[client]

    @property
    def active(self) -> int:
        return self.in_flight if self.runner.concurrent else self.running

    def stop(self) -> None:
        with self.cond:
            self.stopping = True
            self.cond.notify_all()

    def _take_batch(self) -> tuple[list[Ticket], list[tuple[Ticket, Exception]]] | None:
        """The next batch: the oldest job and queued jobs with its batch key (up to max_num_seqs).

        A job whose batch key cannot be computed (a runner bug, a malformed input) is returned in the
        second list with the error, to be failed: it must not take the worker thread down, leaving every
        queued request waiting.
        """
        failed: list[tuple[Ticket, Exception]] = []
        with self.cond:
            while True:
                while not self.queue and not self.stopping:
                    self.cond.wait()
                if self.stopping:
                    return None
                order = self.fair_order()
                first = order[0]
                if self._held_back(first):
                    self.cond.wait(HOLD_POLL_S)
                    continue
                # A heavy client's jobs never share a batch with other clients' jobs: a busy client's
                # batch cannot set a light client's pace (docs/batching.md, "Fair admission").
                heavy = self.engine.client_load.heavy(first.client)
                self._take(first)
                try:
                    key = self.runner.batch_key(first.job)
                except Exception as exc:
                    failed.append((first, exc))
                    if self.queue:
                        continue
                    return [], failed
                break
            batch = [first]
            for ticket in order[1:]:
                if len(batch) >= self.runner.max_batch_size:
                    break
                if ticket not in self.queue:  # failed above while looking for a first job
                    continue
                try:
                    same = self.runner.batch_key(ticket.job) == key
                except Exception as exc:
                    self.queue.remove(ticket)
                    failed.append((ticket, exc))
                    continue
                if same and self.engine.client_load.heavy(ticket.client) == heavy:
                    self._take(ticket)
                    batch.append(ticket)
            self.running += 1
            return batch, failed

    def _held_back(self, first: Ticket) -> bool:
        """Whether the next batch (``first``'s client is the lightest with a job queued here) waits: a
        lighter client has a request in flight elsewhere in the engine, and the batch has waited less
        than HOLD_LIMIT_S (engine/client_load.py). Callers hold ``cond``."""
        if not self.engine.client_load.lighter_than(first.client):
            self._holding_since = None
            return False
        now = time.monotonic()
        if self._holding_since is None:
            self._holding_since = now
        if now - self._holding_since < HOLD_LIMIT_S:
            return True
        self._holding_since = None
        return False

    def _loop(self) -> None:
        if self.runner.concurrent:
            return self._concurrent_loop()
        while True:  # run_batch sets the stage's intra-op threads on this thread
            taken = self._take_batch()
            if taken is None:
                return
            batch, failed = taken
            for ticket, error in failed:
                log.warning(
                    "stage %s: job %s failed before it ran: %s",
                    self.runner.stage_id,
                    ticket.job.request_id,
                    error,
                )
                now = time.time()
                self.engine._job_done(ticket, StageStatus.FAILED, error, now, now, 1)
            if not batch:
                continue
            try:
                self._run(batch)
            finally:
                with self.cond:
                    self.running -= 1

    def _may_hand_next(self) -> bool:
        """Whether the next job in fair order goes to the concurrent runner now (callers hold ``cond``):
        below max_num_seqs in flight, or, where the runner pauses rows, a client with nothing in flight
        here while another holds several (fair admission, docs/batching.md): it joins the running steps
        at once instead of waiting for a slot, and the runner pauses one of the other client's rows. At
        most max_num_seqs such jobs at once."""
        if not self.queue:
            return False
        limit = self.runner.max_batch_size
        if self.in_flight < limit:
            return True
        if not self.runner.pauses_rows or self.in_flight >= 2 * limit:
            return False
        newcomer = self.fair_order()[0].client
        holding = self.in_flight_by_client
        return not holding.get(newcomer) and max(holding.values(), default=0) > 1

    def _concurrent_loop(self) -> None:
        """Hand jobs to a runner with its own scheduler, keeping at most max_num_seqs in flight (past it
        only by fair admission, :meth:`_may_hand_next`)."""
        while True:
            with self.cond:
                while not self.stopping and not self._may_hand_next():
                    self.cond.wait()
                if self.stopping:
                    return
                ticket = self.fair_order()[0]
                self._take(ticket)
                if ticket.job.cancelled:
                    cancelled = True
                else:
                    cancelled = False
                    self.in_flight += 1
                    client = ticket.client
                    self.in_flight_by_client[client] = self.in_flight_by_client.get(client, 0) + 1
            if cancelled:
                self.engine._job_done(ticket, StageStatus.CANCELLED, None, time.time(), time.time(), 1)
                continue
            started = time.time()
            self.engine._job_started(ticket, started)

            def done(
                status: StageStatus,
                error: Exception | None,
                ticket: Ticket = ticket,
                started: float = started,
            ) -> None:
                with self.cond:
                    batch_size = min(self.in_flight, self.runner.max_batch_size)
                    self.in_flight -= 1
                    left = self.in_flight_by_client.pop(ticket.client) - 1
                    if left:
                        self.in_flight_by_client[ticket.client] = left
                    self.cond.notify_all()
                if status == StageStatus.SUCCEEDED and ticket.job.cancelled:
                    status = StageStatus.CANCELLED
                self.engine._job_done(ticket, status, error, started, time.time(), batch_size)

            try:
                self.runner.submit(ticket.job, done)
            except Exception as exc:
                done(StageStatus.FAILED, exc)

    def _run(self, batch: list[Ticket]) -> None:
        live = []
        for ticket in batch:
            if ticket.job.cancelled:
                self.engine._job_done(ticket, StageStatus.CANCELLED, None, time.time(), time.time(), 1)
            else:
                live.append(ticket)
        if not live:
            return
        started = time.time()
        for ticket in live:
            self.engine._job_started(ticket, started)
        status, error = run_batch(self.runner, [t.job for t in live])  # a failing stage fails its requests
        finished = time.time()
        for ticket in live:
            ticket_status = (
                StageStatus.CANCELLED if status == StageStatus.SUCCEEDED and ticket.job.cancelled else status
            )
            self.engine._job_done(ticket, ticket_status, error, started, finished, len(live))


class WorkerHost(Protocol):
    """What a stage worker calls back: the engine that routes its jobs' results."""

    client_load: ClientLoad

    def _job_started(self, ticket: Ticket, started: float) -> None: ...

    def _job_done(
        self,
        ticket: Ticket,
        status: StageStatus,
        error: Exception | None,
        started: float,
        finished: float,
        batch_size: int,
    ) -> None: ...
