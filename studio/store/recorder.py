"""Recording runs from engine events without blocking the caller.

:class:`RunRecorder` owns one writer thread and a queue: API handlers on the asyncio event loop, engine
worker threads and the CLI only enqueue, and every database write and file write happens on the writer
thread, in the order enqueued. A :class:`RunTracker` per request turns the engine's events
(:mod:`engine.events`) into store calls:

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
from engine.events import EngineEvent, RunFailed, RunFinished, StageFinished, StageStarted
from engine.request import ResolvedRequest
from studio.media.images import png_bytes
from studio.store.journal import Journal, apply_entries, journal_dir
from studio.store.models import RUN_SOURCES
from studio.store.payloads import REFUSED_TEXT_KEPT, compact_payload, prompt_of
from studio.store.records import storable
from studio.store.store import RunStore

log = logging.getLogger(__name__)

RETRIES = 4  # transient database errors (locked, connection dropped) are retried this many times
RETRY_BASE_DELAY = 0.05
RECOVERY_INTERVAL = 2.0  # seconds between tries to replay the journal while the database is flaky
MAX_BATCH = 256  # queued writes committed together
# Test-only: seconds the writer waits before each batch (a slow database), so that a test can stop a
# server while writes are still queued and check they are not lost.
WRITE_DELAY_ENV = "OMNI_STUDIO_TEST_WRITE_DELAY_S"
TEXT_MIME = "text/plain; charset=utf-8"

_STOP = object()
_open_recorders: weakref.WeakSet[RunRecorder] = weakref.WeakSet()


class _Task:
    """One queued write, as data: a :class:`RunStore` method (``op``) and its JSON-able keyword arguments, so
    that a write the database refuses can go to the journal (:mod:`studio.store.journal`).

    ``prepare`` (run once, on the writer thread, before the first attempt) finishes the arguments: it
    encodes and stores an output file, or reads what the run's earlier writes left (output errors).
    ``extra`` holds arguments that are not journaled (the file's bytes). A task with ``call`` and no
    ``op`` (:meth:`RunRecorder.submit`) cannot be journaled.
    """

    __slots__ = ("description", "op", "run_id", "args", "prepare", "extra", "call", "on_error")

    def __init__(
        self,
        description: str,
        op: str | None = None,
        run_id: str | None = None,
        args: dict[str, Any] | None = None,
        prepare: Callable[[_Task], None] | None = None,
        call: Callable[[], Any] | None = None,
        on_error: Callable[[Exception], None] | None = None,
    ) -> None:
        self.description = description
        self.op = op
        self.run_id = run_id
        self.args = args or {}
        self.prepare = prepare
        self.extra: dict[str, Any] = {}
        self.call = call
        self.on_error = on_error


def _transient(exc: BaseException) -> bool:
    return isinstance(exc, OperationalError) or (isinstance(exc, DBAPIError) and exc.connection_invalidated)


def _output_file(store: RunStore, content: Any) -> Callable[[_Task], None]:
    """A task's ``prepare`` for an output: encode it (PNG for an image, on the writer thread) and put the
    file in the content-addressed tree, which needs no database; the task then records its sha256."""

    def prepare(task: _Task) -> None:
        data = content if isinstance(content, bytes) else png_bytes(content)
        sha256, _path = store.write_file(data, task.args["mime"])
        task.args.update(sha256=sha256, size_bytes=len(data))
        task.extra["data"] = data

    return prepare


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
            batch: list[_Task] = []
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

    def _write_batch(self, tasks: list[_Task]) -> None:
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

    def _prepare(self, task: _Task) -> bool:
        if task.prepare is None:
            return True
        try:
            task.prepare(task)
        except Exception as exc:
            self._failed(task, exc)
            return False
        task.prepare = None
        return True

    def _apply(self, task: _Task) -> None:
        if task.op is None:
            assert task.call is not None
            task.call()
        else:
            getattr(self.store, task.op)(**task.args, **task.extra)

    def _execute(self, task: _Task) -> None:
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

    def _failed(self, task: _Task, exc: Exception) -> None:
        self.errors += 1
        self.last_error = f"{task.description}: {exc.__class__.__name__}: {exc}"
        log.error("run store: %s failed", task.description, exc_info=exc)
        if task.on_error is not None:
            try:
                task.on_error(exc)
            except Exception:
                log.exception("run store: error handler of %s failed", task.description)

    def _to_journal(self, task: _Task) -> None:
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
        self._put(_Task(description, call=call, on_error=on_error))

    def _put(self, task: _Task) -> None:
        if self._closed:
            self._execute(task)
            return
        self._queue.put(task)

    def _submit(
        self,
        description: str,
        op: str,
        run_id: str,
        args: dict[str, Any],
        prepare: Callable[[_Task], None] | None = None,
        on_error: Callable[[Exception], None] | None = None,
    ) -> None:
        """Queue one store write as data (journaled if the database refuses it)."""
        self._put(_Task(description, op, run_id, args, prepare, on_error=on_error))

    def start_run(
        self,
        source: str,
        resolved: ResolvedRequest,
        config: PipelineConfig,
        model_name: str,
        fingerprint: str | None,
        request_payload: dict[str, Any],
        replay_of: str | None = None,
    ) -> RunTracker:
        """Record a new queued run for ``resolved`` and return its tracker (its id is the request id).

        ``replay_of``: the run this one replays (``omni-studio replay``, docs/replay.md).
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
        self._submit(f"create run {run_id}", "create_run", run_id, values)
        image = resolved.request.image
        if image is not None:
            self._submit(
                f"store source image of run {run_id}",
                "add_output_file",
                run_id,
                {"run_id": run_id, "index": 0, "mime": "image/png", "kind": "source"},
                _output_file(self.store, image),
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
    ) -> str:
        """Record a request refused before the engine ran it (bad field, unknown model, queue full...).

        Nothing a client sends is lost: the run shows in history as failed with the error text.
        ``replay_of``: the run a refused replay was replaying.
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
        self._submit(f"record rejected request {run_id}", "create_run", run_id, values)
        finish = {"run_id": run_id, "status": status, "error": error, "at": created}
        self._submit(f"finish rejected request {run_id} as {status}", "finish_run", run_id, finish)
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


class RunTracker:
    """One run's recording: feed it the request's engine events; thread-safe."""

    def __init__(self, recorder: RunRecorder, run_id: str) -> None:
        self.recorder = recorder
        self.run_id = run_id
        self._lock = threading.Lock()
        self._running = False
        self._finished = False
        self._output_errors: list[str] = []  # written and read on the writer thread only

    @property
    def store(self) -> RunStore:
        return self.recorder.store

    def finished(self) -> bool:
        """Whether the run's outcome has been recorded (queued for writing)."""
        return self._finished

    def _claim_finish(self) -> bool:
        with self._lock:
            if self._finished:
                return False
            self._finished = True
            return True

    def observe(self, event: EngineEvent) -> None:
        """Record what ``event`` means for the run (events other than stage and terminal ones are ignored)."""
        run_id = self.run_id
        if isinstance(event, StageStarted):
            with self._lock:
                if self._running or self._finished:
                    return
                self._running = True
            at = time.time()
            self.recorder._submit(
                f"mark run {run_id} running", "mark_running", run_id, {"run_id": run_id, "at": at}
            )
        elif isinstance(event, StageFinished):
            self.recorder._submit(
                f"record stage {event.stage_id} of run {run_id}",
                "add_stage",
                run_id,
                {
                    "run_id": run_id,
                    "stage_id": event.stage_id,
                    "kind": str(event.kind),
                    "status": str(event.status),
                    "started_at": event.started_at,
                    "finished_at": event.finished_at,
                    "queue_seconds": event.queue_seconds,
                    "input_tokens": event.input_tokens,
                    "output_tokens": event.output_tokens,
                    "batch_size": event.batch_size,
                    "variant_index": event.index,
                },
            )
        elif isinstance(event, RunFinished):
            if self._claim_finish():
                self._record_finished(event, time.time())
        elif isinstance(event, RunFailed):
            self.fail(event.message, cancelled=event.cancelled)

    def fail(self, message: str, cancelled: bool = False) -> bool:
        """Record a failure the engine did not report (e.g. the client went away: ``cancelled=True``).

        False when the run already had an outcome.
        """
        if not self._claim_finish():
            return False
        status, at, run_id = ("cancelled" if cancelled else "failed"), time.time(), self.run_id
        self.recorder._submit(
            f"finish run {run_id} as {status}",
            "finish_run",
            run_id,
            {"run_id": run_id, "status": status, "error": message, "at": at},
        )
        return True

    def _record_finished(self, event: RunFinished, at: float) -> None:
        run_id = self.run_id
        texts: list[str] = []
        image_index = 0
        for output in event.outputs:
            if output.text is not None:
                # The file holds what the run's text column holds: unstorable characters escaped.
                self._submit_output(len(texts), storable(output.text).encode(), TEXT_MIME, None, None)
                texts.append(output.text)
            for image in output.images:
                # png_bytes runs on the writer thread; the API's response shares the cached encoding.
                self._submit_output(image_index, image, "image/png", image.width, image.height)
                image_index += 1
        usage = {
            "input_tokens": sum(o.input_tokens for o in event.outputs),
            "output_tokens": sum(o.output_tokens for o in event.outputs),
        }
        text = "\n\n".join(texts) if texts else None

        def note_output_errors(task: _Task) -> None:
            # The request succeeded for its caller even if a file could not be kept; say so in the error.
            task.args["error"] = "; ".join(self._output_errors) or None

        self.recorder._submit(
            f"finish run {run_id} as succeeded",
            "finish_run",
            run_id,
            {"run_id": run_id, "status": "succeeded", "text": text, "usage": usage, "at": at},
            note_output_errors,
        )

    def _submit_output(
        self, index: int, content: Any, mime: str, width: int | None, height: int | None
    ) -> None:
        run_id = self.run_id

        kind = mime.split(";")[0]

        def failed(exc: Exception) -> None:
            self._output_errors.append(f"output {kind} #{index} not saved: {exc.__class__.__name__}: {exc}")

        self.recorder._submit(
            f"store output {index} ({kind}) of run {run_id}",
            "add_output_file",
            run_id,
            {"run_id": run_id, "index": index, "mime": mime, "width": width, "height": height},
            _output_file(self.store, content),
            failed,
        )
