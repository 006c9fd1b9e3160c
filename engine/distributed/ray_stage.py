"""Stages as Ray actors: each stage's model runs in ``num_replicas`` actors on a Ray cluster, behind a
:class:`RayStageRunner` that the engine drives like any other runner (docs/distributed.md).

What crosses the wire for one batch: the jobs' inputs and parameters go to an actor; the actor runs the
stage's own runner (the same class embedded mode runs) and streams back, in order, the events its jobs
emit (progress, previews, text deltas), every output payload they add, and how each job ended. The
proxy replays those on the studio's side exactly as the runner would have produced them in-process, so the
engine's batching, routing, cancel and run records see no difference, and the outputs are the same bytes.

Placement: ``devices`` naming GPUs asks Ray for that many GPUs (Ray sets ``CUDA_VISIBLE_DEVICES``), the
stage's ``resources`` map asks for custom resources (``{node_a: 1}`` pins the stage to nodes started with
that resource), and each actor takes one logical CPU. Requests go to the replica with the fewest batches
in flight.

Faults: actors are created with ``max_restarts`` (the ``ray:`` section) and ``max_task_retries=0`` —
generation is not idempotent, so Ray never re-runs a job by itself. A replica that dies mid-run fails
the jobs it was running with an error naming it; it is marked down, and new work goes to the other
replicas (or waits for it) until Ray has restarted it and it answers again. A job whose replica was lost
before it reported anything is sent again to a live replica, since nothing of it was seen.

This module imports Ray at the top: it is imported only when a Ray address is given
(:func:`engine.engine.build_engine`).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import secrets
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import ray
import torch
from ray.exceptions import ActorDiedError, ActorUnavailableError, GetTimeoutError, RayActorError

from engine.config import ResolvedStage
from engine.config.deploy import RayConfig
from engine.distributed.wire import (
    JobSpec,
    Message,
    RemoteStageRunner,
    deliver,
    done_message,
    far_job,
)
from engine.events import StageStatus
from engine.models import ModelSource, materialize
from engine.stages.base import StageJob, run_batch

log = logging.getLogger("omni_studio.engine.ray")

POLL_S = 0.05  # how often a waiting call looks at its jobs' cancel flags (cancel reaches the actor within it)
FLUSH_S = 0.05  # an actor sends progress at most this often per batch (a job's end at once)
PROBE_S = 0.25  # how often a lost replica is asked whether it is back
LOST = (RayActorError, ActorUnavailableError)  # ActorDiedError is a RayActorError


class StageReplicaLost(RuntimeError):
    """The actor running a stage's batch died or became unreachable mid-run."""


class RayPlacementError(RuntimeError):
    """Ray could not place or start a stage's actors."""


# -- the actor ----------------------------------------------------------------------------------------


def actor_stage(stage: ResolvedStage) -> ResolvedStage:
    """The stage as its actor runs it: Ray has made the GPUs it asked for visible as 0..n-1."""
    gpus = stage.engine_args.placement.gpus
    if not gpus:
        return stage
    devices = ",".join(str(i) for i in range(len(gpus)))
    return replace(stage, engine_args=replace(stage.engine_args, devices=devices))


def actor_device(stage: ResolvedStage) -> torch.device:
    placement = stage.engine_args.placement
    if placement.gpus:
        return torch.device("cuda:0")
    if placement.is_auto and torch.cuda.is_available():
        return torch.device("cuda:0")
    return torch.device("cpu")


class StageActor:
    """One replica of one stage: loads the stage's runner in the actor process and runs batches on it."""

    def __init__(
        self, stage: ResolvedStage, model: ModelSource, model_cache: str, torch_threads: int
    ) -> None:
        from engine.environment import quiet_libraries

        quiet_libraries()
        # The studio's thread count: the same float math, so the same bytes as embedded on the same hardware.
        torch.set_num_threads(max(1, torch_threads))
        if model.builtin and (model.path is None or not Path(model.path).is_dir()):
            # A built-in model is built deterministically on the node that needs it.
            model = materialize(replace(model, path=None), Path(model_cache))
        stage = actor_stage(stage)
        self.stage = stage
        self.runner = model.family.create_runner(stage, Path(model.path or "."), actor_device(stage))
        quiet_libraries()  # again, now that the model libraries are imported (their progress bars off)
        self.runner.load()
        self.jobs: dict[str, StageJob] = {}

    async def describe(self) -> dict[str, Any]:
        """Where this replica runs and how it takes work."""
        return {
            "node_id": ray.get_runtime_context().get_node_id(),
            "pid": os.getpid(),
            "concurrent": bool(self.runner.concurrent),
            "max_batch_size": int(self.runner.max_batch_size),
            "torch_threads": torch.get_num_threads(),
        }

    async def cancel(self, keys: list[str]) -> None:
        for key in keys:
            job = self.jobs.get(key)
            if job is not None:
                job.cancel_event.set()

    async def run(self, specs: list[JobSpec]) -> Any:
        """Run a batch; yields lists of messages as they come (a streaming generator method):
        ``("event", i, event)``, ``("output", i, payload)``, ``("done", i, status, error, counts...)``."""
        started = time.perf_counter()
        loop = asyncio.get_running_loop()
        inbox: asyncio.Queue[Message] = asyncio.Queue()

        def put(message: Message) -> None:
            loop.call_soon_threadsafe(inbox.put_nowait, message)

        modalities = self.stage.output_modalities
        jobs: list[StageJob] = []
        for i, spec in enumerate(specs):
            job = far_job(spec, i, modalities, put)
            self.jobs[spec.key] = job
            jobs.append(job)
        try:
            if self.runner.concurrent:
                for i, job in enumerate(jobs):

                    def done(status: StageStatus, error: Exception | None, i: int = i) -> None:
                        put(("end", i, status, error))

                    try:
                        self.runner.submit(job, done)
                    except Exception as exc:
                        done(StageStatus.FAILED, exc)
            else:

                def run_all() -> None:
                    status, error = run_batch(self.runner, jobs)
                    for i in range(len(jobs)):
                        put(("end", i, status, error))

                threading.Thread(
                    target=run_all, name=f"omni-ray-stage-{self.stage.stage_id}", daemon=True
                ).start()
            remaining = len(jobs)
            last_yield = loop.time()
            while remaining:
                messages = [await inbox.get()]
                # Each yield costs the studio a round of Ray calls (~1 ms): progress gathers for up to
                # FLUSH_S after the previous yield; a job's end goes out at once.
                while True:
                    while not inbox.empty():
                        messages.append(inbox.get_nowait())
                    wait = FLUSH_S - (loop.time() - last_yield)
                    if wait <= 0 or any(m[0] == "end" for m in messages):
                        break
                    try:
                        messages.append(await asyncio.wait_for(inbox.get(), wait))
                    except TimeoutError:
                        break
                last_yield = loop.time()
                out: list[tuple[Any, ...]] = []
                for message in messages:
                    if message[0] != "end":
                        out.append(message)
                        continue
                    _, i, status, error = message
                    remaining -= 1
                    out.append(done_message(i, jobs[i], status, error, time.perf_counter() - started))
                yield out
        finally:
            for spec in specs:
                self.jobs.pop(spec.key, None)


_REMOTE_ACTOR = ray.remote(StageActor)


# -- the studio's side ---------------------------------------------------------------------------------


def connect(address: str, namespace: str) -> None:
    """Join the cluster at ``address`` as a driver (once per process; later engines reuse it)."""
    if ray.is_initialized():
        return
    try:
        ray.init(
            address=address,
            namespace=namespace,
            log_to_driver=False,  # actor logs stay in the cluster's log folder (docs/distributed.md)
            logging_level=logging.WARNING,
        )
    except Exception as exc:
        raise RayPlacementError(f"cannot connect to the Ray cluster at {address!r}: {exc}") from exc


@dataclass
class Replica:
    """One actor of a stage and what the proxy knows of it."""

    index: int
    name: str
    actor: Any
    node_id: str = ""
    pid: int = 0
    in_flight: int = 0
    served: int = 0  # batches it finished (any outcome)
    up: bool = True
    lost_reason: str = ""

    def describe(self) -> dict[str, Any]:
        return {
            "replica": self.index,
            "name": self.name,
            "node_id": self.node_id,
            "pid": self.pid,
            "in_flight": self.in_flight,
            "served": self.served,
            "up": self.up,
        }


class RayStageRunner(RemoteStageRunner):
    """A stage whose model runs in Ray actors; the engine drives it like an in-process runner.

    Runners that take whole batches (diffusers) run one batch per replica at a time
    (:attr:`parallel_batches` worker threads in the engine); concurrent runners (continuous batching)
    get ``max_num_seqs`` jobs in flight per replica.
    """

    def __init__(
        self,
        stage: ResolvedStage,
        model: ModelSource,
        *,
        ray_config: RayConfig,
        namespace: str,
        model_cache: Path,
    ) -> None:
        super().__init__(stage, Path(model.path or "."), torch.device("cpu"))
        self.kind = stage.kind.value
        self.ray_config = ray_config
        self.namespace = namespace
        self.remote_concurrent = False
        self._lock = threading.Condition()
        self._rotation = itertools.count()
        self._closed = False
        # The family's runner for this stage, never loaded here: the rules that need no model.
        if stage.kind == "diffusion" and model.path is not None:
            self.rules = model.family.create_runner(stage, Path(model.path), torch.device("cpu"))
        token = secrets.token_hex(3)
        args = stage.engine_args
        # vLLM's Ray executor places its own GPU workers; the actor then holds none itself.
        gpus = 0 if args.distributed_executor_backend == "ray" else len(args.placement.gpus)
        self.actor_options: dict[str, Any] = {
            "num_cpus": 1,
            "num_gpus": gpus,
            "resources": dict(args.resources or {}),
            "max_restarts": ray_config.max_restarts,
            "max_task_retries": 0,  # generation is not idempotent: a lost batch fails, never re-runs silently
            "namespace": namespace,
        }
        self.replicas = [
            Replica(
                i,
                f"stage-{stage.stage_id}-replica-{i}-{token}",
                _REMOTE_ACTOR.options(
                    name=f"stage-{stage.stage_id}-replica-{i}-{token}", **self.actor_options
                ).remote(stage, model, str(model_cache), torch.get_num_threads()),
            )
            for i in range(args.replicas)
        ]

    # -- StageRunner -------------------------------------------------------------------------------

    @property
    def parallel_batches(self) -> int:  # type: ignore[override]  # a class attribute on the base
        return len(self.replicas)

    @property
    def max_batch_size(self) -> int:
        per_replica = self.stage.engine_args.batch_size
        return per_replica * len(self.replicas) if self.remote_concurrent else per_replica

    def load(self) -> None:
        """Wait until every replica is placed and has loaded its model (``ray.start_timeout_s``)."""
        timeout = self.ray_config.start_timeout_s
        missing = self._missing_resources()
        if missing:  # not an error yet: an autoscaler may add such a node
            log.warning(
                "stage %s asks Ray for %s, which no node of the cluster has now; waiting up to %.0f s",
                self.stage_id,
                missing,
                timeout,
            )
        pending = {replica.actor.describe.remote(): replica for replica in self.replicas}
        deadline = time.monotonic() + timeout
        while pending:
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                raise RayPlacementError(
                    self._placement_hint(sorted(r.index for r in pending.values()), timeout)
                )
            replica = pending.pop(ready[0])
            try:
                info = ray.get(ready[0])
            except RayActorError as exc:
                raise RayPlacementError(
                    f"stage {self.stage_id} replica {replica.index} failed to start on Ray: {_cause(exc)}"
                ) from exc
            replica.node_id, replica.pid = info["node_id"], info["pid"]
            self.remote_concurrent = bool(info["concurrent"])
        self.loaded = True

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._lock.notify_all()
        for replica in self.replicas:
            try:
                ray.kill(replica.actor, no_restart=True)
            except Exception as exc:  # already gone, or the cluster is unreachable: nothing left to free
                log.debug("stage %s replica %s: kill: %s", self.stage_id, replica.index, exc)
        super().close()

    # -- where the studio looks ----------------------------------------------------------------------

    def placement(self) -> list[dict[str, Any]]:
        """Each replica: actor name, node, pid, batches in flight and served, whether it is up; and the
        stage's median hand-off (ms per job beyond the actor's own time) over its recent jobs."""
        with self._lock:
            median = self.handoff_ms_p50()
            return [{**replica.describe(), "handoff_ms_p50": median} for replica in self.replicas]

    # -- calls ----------------------------------------------------------------------------------------

    def call(self, jobs: list[StageJob]) -> list[tuple[StageStatus, Exception | None]]:
        """Run ``jobs`` on a replica; a replica lost before it reported anything is replaced by another."""
        while True:
            replica = self._acquire()
            try:
                return self._stream(replica, jobs)
            except _ReplicaLost as lost:
                self._mark_down(replica, lost.reason)
                if lost.seen_any or all(job.cancelled for job in jobs):
                    raise StageReplicaLost(lost.message) from None
                log.warning("%s; sending the batch to another replica", lost.message)
            finally:
                self._release(replica)

    def _stream(self, replica: Replica, jobs: list[StageJob]) -> list[tuple[StageStatus, Exception | None]]:
        keys = self.job_keys(jobs)
        specs = [JobSpec.of(key, job) for key, job in zip(keys, jobs, strict=True)]
        results: dict[int, tuple[StageStatus, Exception | None]] = {}
        cancel_sent: set[int] = set()
        seen_any = False
        try:
            sent = time.perf_counter()
            stream = replica.actor.run.options(num_returns="streaming").remote(specs)
            while True:
                cancelled = [i for i, job in enumerate(jobs) if job.cancelled and i not in cancel_sent]
                if cancelled:
                    cancel_sent.update(cancelled)
                    replica.actor.cancel.remote([keys[i] for i in cancelled])
                ready, _ = ray.wait([stream], timeout=POLL_S)
                if not ready:
                    continue
                try:
                    ref = next(stream)
                except StopIteration:
                    break
                messages = ray.get(ref)
                seen_any = True
                for message in messages:
                    deliver(jobs, message, results)
                    if message[0] == "done":  # what the trip cost beyond the actor's own time
                        self.handoff_s.append(time.perf_counter() - sent - message[-1])
        except LOST as exc:
            raise _ReplicaLost(self._lost_message(replica, exc), _cause(exc), seen_any) from exc
        missing = [i for i in range(len(jobs)) if i not in results]
        if missing:
            raise RuntimeError(
                f"stage {self.stage_id} replica {replica.index} ended without finishing jobs {missing}"
            )
        return [results[i] for i in range(len(jobs))]

    def _lost_message(self, replica: Replica, exc: BaseException) -> str:
        restarts = self.ray_config.max_restarts
        again = (
            "Ray restarts it"
            + (f" (up to {restarts} times)" if restarts >= 0 else "")
            + "; the stage's other replicas take new requests meanwhile"
        )
        return (
            f"stage {self.stage_id} replica {replica.index} (Ray actor {replica.name}, node {replica.node_id[:12]}, "
            f"pid {replica.pid}) was lost mid-run: {_cause(exc)}. {again}"
        )

    # -- replicas: choose, lose, get back ---------------------------------------------------------

    def _acquire(self) -> Replica:
        """The live replica with the fewest batches in flight (ties in turn); waits while none is up."""
        deadline = time.monotonic() + self.ray_config.start_timeout_s
        with self._lock:
            while True:
                if self._closed:
                    raise RuntimeError(f"stage {self.stage_id}: the engine is shutting down")
                live = [r for r in self.replicas if r.up]
                if live:
                    turn = next(self._rotation)
                    replica = min(live, key=lambda r: (r.in_flight, (r.index - turn) % len(self.replicas)))
                    replica.in_flight += 1
                    return replica
                left = deadline - time.monotonic()
                if left <= 0:
                    reasons = "; ".join(f"replica {r.index}: {r.lost_reason}" for r in self.replicas)
                    raise StageReplicaLost(
                        f"no replica of stage {self.stage_id} is available after "
                        f"{self.ray_config.start_timeout_s:.0f} s ({reasons})"
                    )
                self._lock.wait(min(left, 1.0))

    def _release(self, replica: Replica) -> None:
        with self._lock:
            replica.in_flight -= 1
            replica.served += 1
            self._lock.notify_all()

    def _mark_down(self, replica: Replica, reason: str) -> None:
        with self._lock:
            if not replica.up:
                return
            replica.up, replica.lost_reason = False, reason
        threading.Thread(
            target=self._probe, args=(replica,), name=f"omni-ray-probe-{self.stage_id}", daemon=True
        ).start()

    def _probe(self, replica: Replica) -> None:
        """Ask a lost replica whether it is back (Ray restarts it, reloading the model); then take it back."""
        while not self._closed:
            try:
                info = ray.get(replica.actor.describe.remote(), timeout=5.0)
            except ActorDiedError as exc:  # restarts used up, or its node is gone for good
                with self._lock:
                    replica.lost_reason = f"gone: {_cause(exc)}"
                log.error("stage %s replica %s is gone: %s", self.stage_id, replica.index, _cause(exc))
                return
            except (ActorUnavailableError, GetTimeoutError, RayActorError):
                time.sleep(PROBE_S)
                continue
            with self._lock:
                replica.node_id, replica.pid = info["node_id"], info["pid"]
                replica.up, replica.lost_reason = True, ""
                self._lock.notify_all()
            log.warning("stage %s replica %s is back (pid %s)", self.stage_id, replica.index, replica.pid)
            return

    def _wanted(self) -> dict[str, float]:
        wanted = {"CPU": float(self.actor_options["num_cpus"]), **self.actor_options["resources"]}
        if self.actor_options["num_gpus"]:
            wanted["GPU"] = float(self.actor_options["num_gpus"])
        return wanted

    def _missing_resources(self) -> dict[str, float]:
        """What one actor asks for that no single node of the cluster has."""
        try:
            nodes = [n["Resources"] for n in ray.nodes() if n.get("Alive")]
        except Exception:  # best effort: the wait itself reports what is wrong
            return {}
        wanted = self._wanted()
        if any(all(node.get(k, 0) >= v for k, v in wanted.items()) for node in nodes):
            return {}
        return wanted

    def _placement_hint(self, indexes: list[int], timeout: float) -> str:
        wanted = self._wanted()
        try:
            total, free = ray.cluster_resources(), ray.available_resources()
        except Exception:  # the hint is best effort; the timeout itself is the error
            total, free = {}, {}
        shown = sorted(set(wanted) | {k for k in total if not k.startswith("node:") and "memory" not in k})
        have = ", ".join(f"{k} {free.get(k, 0):g}/{total.get(k, 0):g}" for k in shown)
        return (
            f"stage {self.stage_id} replica(s) {', '.join(map(str, indexes))} not started within {timeout:.0f} s: "
            f"each asks Ray for {wanted}; the cluster has (free/total) {have}. Add a node with those "
            "resources, or change the stage's devices, resources or num_replicas (docs/distributed.md)"
        )


class _ReplicaLost(Exception):
    """A replica was lost during a call; ``seen_any``: whether it had reported anything yet."""

    def __init__(self, message: str, reason: str, seen_any: bool) -> None:
        super().__init__(message)
        self.message, self.reason, self.seen_any = message, reason, seen_any


def _cause(exc: BaseException) -> str:
    """Ray's error in one line: what happened and, for an error raised inside the actor, that error
    (the last line of its traceback), without Ray's long troubleshooting text."""
    lines = [line.strip() for line in str(exc).strip().splitlines() if line.strip()]
    if not lines:
        return type(exc).__name__
    head = lines[0]
    if "creation task" in head or "Traceback" in str(exc):
        last = lines[-1]
        if last != head:
            return f"{head.split(',')[0]}: {last}"[:500]
    return head[:300]


class RayPlacement:
    """Builds the stage runners of one engine on a Ray cluster."""

    def __init__(self, address: str, ray_config: RayConfig | None, model_cache: Path) -> None:
        self.ray_config = ray_config or RayConfig.model_validate({})
        self.address = address
        self.namespace = self.ray_config.namespace or "omni-studio"
        self.model_cache = Path(model_cache)
        connect(address, self.namespace)

    def runner(self, stage: ResolvedStage, model: ModelSource) -> RayStageRunner:
        return RayStageRunner(
            stage, model, ray_config=self.ray_config, namespace=self.namespace, model_cache=self.model_cache
        )
