"""Recording runs from engine events without blocking the caller.

:class:`RunRecorder` owns one writer thread and a queue: API handlers on the asyncio event loop, engine
worker threads and the CLI only enqueue, and every database write and file write happens on the writer
thread, in the order enqueued. A :class:`~studio.store.tracker.RunTracker` per request
(``studio/store/tracker.py``) turns the engine's events (:mod:`engine.events`) into store calls:

    tracker = recorder.start_run("api", resolved, engine.config, served_name, fingerprint, body)
    async for event in engine.generate(resolved):
        tracker.observe(event)
        ...
    # a client that went away: tracker.fail("client disconnected", cancelled=True)
"""

from __future__ import annotations

import atexit
import logging
import os
import queue
import threading
import time
import uuid
import weakref
from collections.abc import Callable
from typing import Any

from sqlalchemy.exc import DBAPIError, OperationalError

from engine.config import PipelineConfig
from engine.request import ResolvedRequest
from studio.accounts.identity import current_user
from studio.store.journal import Journal, apply_entries, journal_dir
from studio.store.models import RUN_SOURCES
from studio.store.payloads import REFUSED_TEXT_KEPT, compact_payload, prompt_of
from studio.store.store import RunStore
from studio.store.tracker import RunTracker
from studio.store.write_tasks import WriteTask, prepare_output_file

log = logging.getLogger(__name__)

RETRIES = 4  # transient database errors (locked, connection dropped) are retried this many times
RETRY_BASE_DELAY = 0.05
RECOVERY_INTERVAL = 2.0  # seconds between tries to replay the journal while the database is flaky
MAX_BATCH = 256  # queued writes committed together
# Test-only: seconds the writer waits before each batch (a slow database), so that a test can stop a
# server while writes are still queued and check they are not lost.
WRITE_DELAY_ENV = "OMNI_STUDIO_TEST_WRITE_DELAY_S"

_STOP = object()
_open_recorders: weakref.WeakSet[RunRecorder] = weakref.WeakSet()


def _transient(exc: BaseException) -> bool:
    return isinstance(exc, OperationalError) or (isinstance(exc, DBAPIError) and exc.connection_invalidated)


class RunRecorder:
    """Writes runs to a :class:`RunStore` on one background thread; callers never wait for the database.

    Failed writes are retried when the error is transient and otherwise logged (with the run id) and
    counted in :attr:`errors`; the writer thread keeps going either way. A write the database still
    refuses after the retries (it is down, locked or read-only) goes to the journal in the data dir
    (:mod:`studio.store.journal`), and so does every later write of that run, to keep the run's order;
    counted in :attr:`journaled`. Once a write succeeds again the journal is replayed; what is left in
    it when the process stops is written by the next ``open_store`` on the data dir.
    """

    def __init__(self, store: RunStore) -> None:
        self.store = store
        self.errors = 0
        self.journaled = 0
        self.last_error: str | None = None
        self._journal: Journal | None = None
        self._journaled_runs: set[str] = set()  # runs whose writes go to the journal until it is replayed
        self._db_down = False  # the last write failed for good: try new writes once, without retries
        self._last_recovery = 0.0
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._closed = False
        self._configs: dict[int, tuple[PipelineConfig, dict[str, Any], str]] = {}
        self._write_delay = float(os.environ.get(WRITE_DELAY_ENV) or 0)
        self._thread = threading.Thread(target=self._work, name="omni-run-recorder", daemon=True)
        self._thread.start()
        _open_recorders.add(self)

    # the writer thread ----------------------------------------------------------------------------

    def _work(self) -> None:
        """Take what is queued, up to a flush marker, and write it as one batch."""
        while True:
            item = self._queue.get()
            batch: list[WriteTask] = []
            while True:
                if item is _STOP:
                    self._write_batch(batch)
                    return
                if isinstance(item, threading.Event):  # a flush marker: everything before it is written
                    self._write_batch(batch)
                    batch = []
                    item.set()
                else:
                    batch.append(item)
                    if len(batch) >= MAX_BATCH:
                        self._write_batch(batch)
                        batch = []
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
            self._write_batch(batch)

    def _write_batch(self, tasks: list[WriteTask]) -> None:
        """One transaction for all of ``tasks``; if anything in it fails, each task again on its own, so
        one bad write costs only itself (and transient errors get their retries)."""
        if tasks and self._write_delay > 0:  # test-only (see WRITE_DELAY_ENV)
            time.sleep(self._write_delay)
        tasks = [task for task in tasks if self._prepare(task)]
        if len(tasks) > 1 and not self._db_down and not any(t.run_id in self._journaled_runs for t in tasks):
            try:
                with self.store.batch():
                    for task in tasks:
                        self._apply(task)
                self._recover()
                return
            except Exception as exc:
                log.debug(
                    "run store: a batch of %d writes failed (%s); writing them one by one",
                    len(tasks),
                    exc.__class__.__name__,
                )
        for task in tasks:
            self._execute(task)

    def _prepare(self, task: WriteTask) -> bool:
        if task.prepare is None:
            return True
        try:
            task.prepare(task)
        except Exception as exc:
            self._failed(task, exc)
            return False
        task.prepare = None
        return True

    def _apply(self, task: WriteTask) -> None:
        if task.op is None:
            assert task.call is not None
            task.call()
        else:
            getattr(self.store, task.op)(**task.args, **task.extra)

    def _execute(self, task: WriteTask) -> None:
        if not self._prepare(task):
            return
        if task.run_id is not None and task.run_id in self._journaled_runs:
            self._to_journal(task)
            return
        retries = 0 if self._db_down else RETRIES
        for attempt in range(retries + 1):
            try:
                self._apply(task)
            except Exception as exc:
                if not _transient(exc):
                    self._failed(task, exc)
                    return
                if attempt < retries:
                    log.warning(
                        "run store: %s failed (%s); retrying", task.description, exc.__class__.__name__
                    )
                    time.sleep(RETRY_BASE_DELAY * 2**attempt)
                    continue
                if task.op is None or task.run_id is None:
                    self._failed(task, exc)
                    return
                if not self._db_down:
                    log.error(
                        "run store: the database refuses writes (%s: %s); journaling them in %s",
                        exc.__class__.__name__,
                        exc,
                        journal_dir(self.store.data_dir),
                    )
                self._db_down = True
                self._to_journal(task)
                return
            self._db_down = False
            self._recover()
            return

    def _failed(self, task: WriteTask, exc: Exception) -> None:
        self.errors += 1
        self.last_error = f"{task.description}: {exc.__class__.__name__}: {exc}"
        log.error("run store: %s failed", task.description, exc_info=exc)
        if task.on_error is not None:
            try:
                task.on_error(exc)
            except Exception:
                log.exception("run store: error handler of %s failed", task.description)

    def _to_journal(self, task: WriteTask) -> None:
        assert task.op is not None and task.run_id is not None
        try:
            if self._journal is None:
                self._journal = Journal(self.store.data_dir, self.store.owner)
            self._journal.append(task.op, task.run_id, task.args)
        except Exception as exc:
            self._failed(task, exc)
            return
        self._journaled_runs.add(task.run_id)
        self.journaled += 1

    def _recover(self, force: bool = False) -> None:
        """The database took a write: replay this recorder's journal (at most every few seconds)."""
        if self._journal is None or not self._journal.count:
            return
        now = time.monotonic()
        if not force and now - self._last_recovery < RECOVERY_INTERVAL:
            return
        self._last_recovery = now
        try:
            failed = apply_entries(self.store, self._journal.entries(), self.store.owner)
        except Exception:
            log.exception("run store: replaying the journal failed")
            return
        if failed:
            return  # all of it stays (replay is idempotent); the next start or the next recovery retries
        log.warning("run store: the database is back; %d journaled write(s) recorded", self._journal.count)
        self._journal.clear()
        self._journaled_runs.clear()

    # the callers' side ----------------------------------------------------------------------------

    def submit(
        self, description: str, call: Callable[[], Any], on_error: Callable[[Exception], None] | None = None
    ) -> None:
        """Queue one write; ``on_error`` runs (on the writer thread) if it finally fails.

        After :meth:`close` the write runs at once in the caller: late, but not lost.
        """
        self._put(WriteTask(description, call=call, on_error=on_error))

    def _put(self, task: WriteTask) -> None:
        if self._closed:
            self._execute(task)
            return
        self._queue.put(task)

    def submit_write(
        self,
        description: str,
        op: str,
        run_id: str,
        args: dict[str, Any],
        prepare: Callable[[WriteTask], None] | None = None,
        on_error: Callable[[Exception], None] | None = None,
    ) -> None:
        """Queue one store write as data (journaled if the database refuses it)."""
        self._put(WriteTask(description, op, run_id, args, prepare, on_error=on_error))

    def start_run(
        self,
        source: str,
        resolved: ResolvedRequest,
        config: PipelineConfig,
        model_name: str,
        fingerprint: str | None,
        request_payload: dict[str, Any],
        replay_of: str | None = None,
        user: str | None = None,
    ) -> RunTracker:
        """Record a new queued run for ``resolved`` and return its tracker (its id is the request id).

        ``replay_of``: the run this one replays (``omni-studio replay``, docs/replay.md); ``user``: the
        account it belongs to (docs/team.md).
        """
        if source not in RUN_SOURCES:
            raise ValueError(f"source must be one of {', '.join(RUN_SOURCES)}, got {source!r}")
        run_id = resolved.request_id
        created = time.time()
        body, config_hash = self._config_body(config)
        values = {
            "source": source,
            "prompt": resolved.request.prompt,
            "model": model_name,
            "request": compact_payload(request_payload),
            "parameters": resolved.parameters,
            "seed": resolved.seed,
            "config": body,
            "config_hash": config_hash,
            "fingerprint": fingerprint,
            "run_id": run_id,
            "created_at": created,
            "replay_of": replay_of,
        }
        if user is not None:  # absent otherwise: journals written before accounts replay as they were
            values["user_name"] = user
        self.submit_write(f"create run {run_id}", "create_run", run_id, values)
        image = resolved.request.image
        if image is not None:
            self.submit_write(
                f"store source image of run {run_id}",
                "add_output_file",
                run_id,
                {"run_id": run_id, "index": 0, "mime": "image/png", "kind": "source"},
                prepare_output_file(self.store, image),
            )
        return RunTracker(self, run_id)

    def record_rejected(
        self,
        source: str,
        request_payload: dict[str, Any] | None,
        error: str,
        model_name: str,
        config: PipelineConfig | None,
        fingerprint: str | None,
        status: str = "failed",
        replay_of: str | None = None,
        user: str | None = None,
    ) -> str:
        """Record a request refused before the engine ran it (bad field, unknown model, queue full...).

        Nothing a client sends is lost: the run shows in history as failed with the error text.
        ``replay_of``: the run a refused replay was replaying. ``user``: the account it belongs to, by
        default the one the current API request authenticated as (docs/team.md).
        """
        if source not in RUN_SOURCES:
            raise ValueError(f"source must be one of {', '.join(RUN_SOURCES)}, got {source!r}")
        run_id = uuid.uuid4().hex
        created = time.time()
        payload = compact_payload(request_payload or {}, REFUSED_TEXT_KEPT)
        prompt = prompt_of(payload)
        body, config_hash = self._config_body(config) if config is not None else (None, None)

        values = {
            "source": source,
            "prompt": prompt,
            "model": model_name,
            "request": payload,
            "parameters": {},
            "seed": None,
            "config": body,
            "config_hash": config_hash,
            "fingerprint": fingerprint,
            "run_id": run_id,
            "created_at": created,
            "replay_of": replay_of,
        }
        user = user if user is not None else current_user()
        if user is not None:
            values["user_name"] = user
        self.submit_write(f"record rejected request {run_id}", "create_run", run_id, values)
        finish = {"run_id": run_id, "status": status, "error": error, "at": created}
        self.submit_write(f"finish rejected request {run_id} as {status}", "finish_run", run_id, finish)
        return run_id

    def _config_body(self, config: PipelineConfig) -> tuple[dict[str, Any], str]:
        """``config.to_dict()`` and its hash, computed once per config object (a server has one or two)."""
        cached = self._configs.get(id(config))
        if cached is None or cached[0] is not config:
            cached = (config, config.to_dict(), config.config_hash())
            if len(self._configs) >= 8:  # engines rebuilt from the UI leave old configs behind
                self._configs.clear()
            self._configs[id(config)] = cached
        return cached[1], cached[2]

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until everything queued before this call is written; False on timeout."""
        if self._closed or threading.current_thread() is self._thread:
            return True
        marker = threading.Event()
        self._queue.put(marker)
        return marker.wait(timeout)

    @property
    def pending(self) -> int:
        """Writes queued and not yet done (approximate)."""
        return self._queue.qsize()

    def close(self, timeout: float | None = 30.0) -> None:
        """Write what is queued, then stop the writer thread. The store stays open (its owner closes it)."""
        if self._closed:
            return
        self._queue.put(_STOP)
        self._thread.join(timeout)
        self._closed = True
        _open_recorders.discard(self)
        # Anything queued after the stop marker (a late submit racing close) is written here.
        while True:
            try:
                task = self._queue.get_nowait()
            except queue.Empty:
                break
            if isinstance(task, threading.Event):
                task.set()
            elif task is not _STOP:
                self._execute(task)
        if self._journal is not None:
            self._recover(force=True)  # a last try; what stays is written at the next start
            self._journal.close()


@atexit.register
def _close_open_recorders() -> None:
    """Interpreter exit: write what is still queued (the writer is a daemon thread and would just stop)."""
    for recorder in list(_open_recorders):
        recorder.close(timeout=10)
