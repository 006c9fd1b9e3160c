"""A stage in its own process on this machine (``own_process: true``; docs/batching.md).

Why: the engine's stages are threads of one Python process, and a small model on a CPU is dispatch-bound,
so every torch call takes and gives back the GIL. Two busy stages (one request's AR decode while another's
DiT denoises) then take turns instead of running on two cores: measured on the tiny GLM presets, an AR step
of 8 rows takes twice as long while a DiT runs in the same process, and not at all longer while it runs in
another. A stage with ``own_process: true`` runs its model in a child process and the engine drives a
:class:`ProcessStageRunner` proxy in its place. The child is a fresh interpreter (never a fork: torch and
threads do not survive one) started on this module alone (:mod:`engine.distributed.spawn`): unlike
multiprocessing's spawn it never re-runs the caller's main script. Its pipe is a socket pair carrying
pickled messages.

The child runs the family's own runner class on jobs rebuilt from the wire (:mod:`engine.distributed.wire`,
the same protocol as a Ray actor), so batching, cancel, progress, run records and the bytes of every output
are the same as in-process. Cancels reach the child within POLL_S. A child that dies fails the jobs it had
(an error naming its pid and exit code); the next batch starts a new one.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import pickle
import queue
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import torch

from engine.config import ResolvedStage
from engine.distributed import spawn
from engine.distributed.wire import (
    JobSpec,
    Message,
    RemoteStageRunner,
    deliver,
    done_message,
    far_job,
    portable_error,
    restore_error,
)
from engine.environment import StartupCollection
from engine.events import StageStatus
from engine.models import ModelSource, describe_model
from engine.stages.base import StageJob, run_batch

log = logging.getLogger("omni_studio.engine.process")

POLL_S = 0.05  # how often a waiting call looks at its jobs' cancel flags
START_TIMEOUT_S = 300.0  # for the child to import its libraries and load the model


class StageProcessLost(RuntimeError):
    """The stage's process died while it had jobs."""


def _send(conn: Connection, message: Any) -> None:
    # Plain pickle, not the Connection's own pickler: with torch imported that one sends tensors as
    # shared-memory handles, which only a multiprocessing child (with its parent's key) may open.
    conn.send_bytes(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))


def _recv(conn: Connection) -> Any:
    return pickle.loads(conn.recv_bytes())


# -- the child ----------------------------------------------------------------------------------------


def child_main(fd: int) -> None:
    """Entry point of the stage process: its pipe is the inherited socket ``fd``; the first message
    says which stage to serve."""
    conn = Connection(fd)
    with StartupCollection(freeze=True) as startup:  # engine/environment.py
        # The model libraries first, while the parent still decides which stage this is
        # (engine.distributed.spawn).
        import diffusers  # noqa: F401
        import transformers  # noqa: F401

        try:
            _, stage, model, path, device, torch_threads = _recv(conn)
        except (EOFError, OSError):  # started early and never taken
            return
        serve_stage(conn, stage, model, path, device, torch_threads, startup.done)


def serve_stage(
    conn: Connection,
    stage: ResolvedStage,
    model: str,
    path: str,
    device: str,
    torch_threads: int,
    loaded: Callable[[], None] = lambda: None,
) -> None:
    """The child's main: load the stage's runner (then call ``loaded``), then run what the parent sends
    until it says stop.

    Parent -> child: ``("start", stage, model, path, device, threads)`` first, then ``("run", call_id, [JobSpec])``, ``("cancel", [key])``, ``("stop",)``.
    Child -> parent: ``("ready", info)`` or ``("failed", error)`` once, then ``(call_id, message)``.
    """
    from engine.environment import quiet_libraries

    quiet_libraries()
    torch.set_num_threads(max(1, torch_threads))  # the parent's: the same float math, the same bytes
    sending = threading.Lock()

    def send(message: Any) -> None:
        with sending:
            _send(conn, message)

    try:
        source = replace(describe_model(model), path=Path(path))
        runner = source.family.create_runner(stage, Path(path), torch.device(device))
        quiet_libraries()  # again, now that the model libraries are imported
        runner.load()
    except Exception as exc:
        send(("failed", portable_error(exc)))
        return
    loaded()
    send(("ready", {"pid": os.getpid(), "concurrent": bool(runner.concurrent)}))
    jobs: dict[str, StageJob] = {}
    batches: queue.SimpleQueue[tuple[int, list[StageJob], list[str]] | None] = queue.SimpleQueue()

    def finish(
        call_id: int, i: int, job: StageJob, key: str, status: StageStatus, error: Any, started: float
    ) -> None:
        jobs.pop(key, None)
        send((call_id, done_message(i, job, status, error, time.perf_counter() - started)))

    def run_batches() -> None:  # one batch at a time, as the engine's stage worker does
        while (item := batches.get()) is not None:
            call_id, batch, keys = item
            started = time.perf_counter()
            status, error = run_batch(runner, batch)
            for i, (job, key) in enumerate(zip(batch, keys, strict=True)):
                finish(call_id, i, job, key, status, error, started)

    worker = threading.Thread(target=run_batches, name=f"omni-stage-{stage.stage_id}-process", daemon=True)
    worker.start()
    modalities = stage.output_modalities
    try:
        while True:
            try:
                message = _recv(conn)
            except (EOFError, OSError):  # the parent is gone
                break
            if message[0] == "stop":
                break
            if message[0] == "cancel":
                for key in message[1]:
                    if (job := jobs.get(key)) is not None:
                        job.cancel_event.set()
                continue
            _, call_id, specs = message

            def tagged(item: Message, call_id: int = call_id) -> None:
                send((call_id, item))

            batch = [far_job(spec, i, modalities, tagged) for i, spec in enumerate(specs)]
            jobs.update({spec.key: job for spec, job in zip(specs, batch, strict=True)})
            if not runner.concurrent:
                batches.put((call_id, batch, [spec.key for spec in specs]))
                continue
            for i, (spec, job) in enumerate(zip(specs, batch, strict=True)):
                started = time.perf_counter()

                def done(
                    status: StageStatus,
                    error: Exception | None,
                    call_id: int = call_id,
                    i: int = i,
                    job: StageJob = job,
                    key: str = spec.key,
                    started: float = started,
                ) -> None:
                    finish(call_id, i, job, key, status, error, started)

                try:
                    runner.submit(job, done)
                except Exception as exc:
                    done(StageStatus.FAILED, exc)
    finally:
        batches.put(None)
        worker.join(timeout=30)
        runner.close()


# -- the parent ---------------------------------------------------------------------------------------


class ProcessStageRunner(RemoteStageRunner):
    """The engine's side of a stage whose model runs in a child process."""

    def __init__(self, stage: ResolvedStage, model: ModelSource, device: torch.device) -> None:
        super().__init__(stage, Path(model.path or "."), device)
        self.kind = stage.kind.value
        # How the child finds the model: a built-in by name, a folder by its path.
        self._model_ref = model.name if model.builtin else str(model.path)
        self.pid: int | None = None
        self.served = 0
        self._calls: dict[int, queue.SimpleQueue[Message]] = {}
        self._call_ids = itertools.count()
        self._lock = threading.Lock()  # the process, the pipe's sending end, the calls
        self._process: Any = None
        self._conn: Connection | None = None
        self._closed = False
        # The family's runner for this stage, never loaded here: the rules that need no model.
        if stage.kind == "diffusion":
            self.rules = model.family.create_runner(stage, self.model_path, device)
        self._spawn()  # now: the child imports and loads while the engine loads the other stages

    def _spawn(self) -> None:
        child = spawn.take()  # one the studio started early (its imports done meanwhile), else a new one
        self._process, conn = child.process, child.conn
        args = (str(self.model_path), str(self.device), torch.get_num_threads())
        _send(conn, ("start", self.stage, self._model_ref, *args))
        self._conn = conn

    def load(self) -> None:
        """Wait for the child to load the model (or report why it could not)."""
        with self._lock:
            self._await_ready()
        self.loaded = True

    def _await_ready(self) -> None:
        conn = self._conn
        assert conn is not None and self._process is not None
        deadline = time.monotonic() + START_TIMEOUT_S
        while not conn.poll(0.1):
            if self._process.poll() is not None:
                raise StageProcessLost(
                    f"stage {self.stage_id}'s process (pid {self._process.pid}) exited with code "
                    f"{self._process.returncode} while loading the model"
                )
            if time.monotonic() > deadline:
                self._process.kill()
                raise StageProcessLost(
                    f"stage {self.stage_id}'s process did not load within {START_TIMEOUT_S:.0f} s"
                )
        kind, payload = _recv(conn)
        if kind == "failed":
            error = restore_error(payload)
            raise RuntimeError(
                f"stage {self.stage_id}'s process could not load the model: {error}"
            ) from error
        self.pid = int(payload["pid"])
        self.remote_concurrent = bool(payload["concurrent"])
        threading.Thread(
            target=self._read,
            args=(conn, self._process),
            name=f"omni-stage-{self.stage_id}-pipe",
            daemon=True,
        ).start()

    def _read(self, conn: Connection, process: Any) -> None:
        """Route the child's messages to the calls waiting for them; at EOF, fail those calls."""
        while True:
            try:
                call_id, message = _recv(conn)
            except (EOFError, OSError):
                break
            with self._lock:
                inbox = self._calls.get(call_id)
            if inbox is not None:
                inbox.put(message)
        try:
            process.wait(timeout=5)
        except subprocess.TimeoutExpired:  # the pipe closed but the process lives on: end it
            process.kill()
            process.wait(timeout=5)
        lost = ("lost", f"pid {process.pid}, exit code {process.returncode}")
        with self._lock:
            if self._conn is conn:
                self._conn = None
            waiting = list(self._calls.values())
        for inbox in waiting:
            inbox.put(lost)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            conn, process, self._conn = self._conn, self._process, None
        if conn is not None:
            with contextlib.suppress(OSError, ValueError):  # the child is already gone
                _send(conn, ("stop",))
        if process is not None:
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=5)
        super().close()

    def placement(self) -> list[dict[str, Any]]:
        """Where the stage runs: its process, whether it is up, and the median hand-off per job (ms beyond
        the child's own time)."""
        with self._lock:
            up = self._conn is not None
        return [
            {
                "replica": 0,
                "name": f"process {self.pid}",
                "node_id": "local",
                "pid": self.pid,
                "in_flight": len(self._calls),
                "served": self.served,
                "up": up,
                "handoff_ms_p50": self.handoff_ms_p50(),
            }
        ]

    def _connection(self) -> Connection:
        """The pipe to a live child, starting a new one if the last died."""
        if self._closed:
            raise RuntimeError(f"stage {self.stage_id}: the engine is shutting down")
        if self._conn is None:
            log.warning("stage %s: starting a new process (the last one exited)", self.stage_id)
            self._spawn()
            self._await_ready()
        assert self._conn is not None
        return self._conn

    def call(self, jobs: list[StageJob]) -> list[tuple[StageStatus, Exception | None]]:
        keys = self.job_keys(jobs)
        inbox: queue.SimpleQueue[Message] = queue.SimpleQueue()
        call_id = next(self._call_ids)
        with self._lock:
            conn = self._connection()
            self._calls[call_id] = inbox
            sent = time.perf_counter()
            _send(conn, ("run", call_id, [JobSpec.of(key, job) for key, job in zip(keys, jobs, strict=True)]))
        results: dict[int, tuple[StageStatus, Exception | None]] = {}
        cancel_sent: set[int] = set()
        try:
            while len(results) < len(jobs):
                cancelled = [i for i, job in enumerate(jobs) if job.cancelled and i not in cancel_sent]
                if cancelled:
                    cancel_sent.update(cancelled)
                    with self._lock:
                        if self._conn is conn:
                            _send(conn, ("cancel", [keys[i] for i in cancelled]))
                try:
                    message = inbox.get(timeout=POLL_S)
                except queue.Empty:
                    continue
                if message[0] == "lost":
                    raise StageProcessLost(
                        f"stage {self.stage_id}'s process ({message[1]}) exited mid-run; "
                        "the next batch starts a new one"
                    )
                deliver(jobs, message, results)
                if message[0] == "done":  # what the trip cost beyond the child's own time
                    self.handoff_s.append(time.perf_counter() - sent - message[-1])
        finally:
            with self._lock:
                self._calls.pop(call_id, None)
                self.served += 1
        return [results[i] for i in range(len(jobs))]
