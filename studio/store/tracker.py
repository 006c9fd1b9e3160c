"""One run's recording: a :class:`RunTracker` per request turns the engine's events (:mod:`engine.events`)
into store writes, which its recorder (``studio/store/recorder.py``) queues for its writer thread."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

from engine.events import EngineEvent, RunFailed, RunFinished, StageFinished, StageStarted
from studio.store.records import storable
from studio.store.store import RunStore
from studio.store.write_tasks import WriteTask, prepare_output_file

TEXT_MIME = "text/plain; charset=utf-8"


class RunWrites(Protocol):
    """What a tracker needs from its recorder (``studio.store.recorder.RunRecorder``): the store, and a queue
    of store writes as data."""

    @property
    def store(self) -> RunStore: ...

    def submit_write(
        self,
        description: str,
        op: str,
        run_id: str,
        args: dict[str, Any],
        prepare: Callable[[WriteTask], None] | None = None,
        on_error: Callable[[Exception], None] | None = None,
    ) -> None: ...


class RunTracker:
    """One run's recording: feed it the request's engine events; thread-safe."""

    def __init__(self, recorder: RunWrites, run_id: str) -> None:
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
            self.recorder.submit_write(
                f"mark run {run_id} running", "mark_running", run_id, {"run_id": run_id, "at": at}
            )
        elif isinstance(event, StageFinished):
            self.recorder.submit_write(
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
        self.recorder.submit_write(
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

        def note_output_errors(task: WriteTask) -> None:
            # The request succeeded for its caller even if a file could not be kept; say so in the error.
            task.args["error"] = "; ".join(self._output_errors) or None

        self.recorder.submit_write(
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

        self.recorder.submit_write(
            f"store output {index} ({kind}) of run {run_id}",
            "add_output_file",
            run_id,
            {"run_id": run_id, "index": index, "mime": mime, "width": width, "height": height},
            prepare_output_file(self.store, content),
            failed,
        )
