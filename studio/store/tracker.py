"""One run's recording: a :class:`RunTracker` per request turns the engine's events (:mod:`engine.events`)
into store writes, which its recorder (``studio/store/recorder.py``) queues for its writer thread.

A run that speaks also gets its audio figures (docs/speech.md "Runs, files and the CLI"): TTFP, from the
tracker's start (the run recorded, just before the engine takes it) to the first ``AudioDelta`` that
passed it, or to the finished run when its caller took no stream (the API's whole responses); the audio
seconds made; and the real-time factor, the seconds from start to finish per second of audio.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

from engine.events import (
    AudioDelta,
    EngineEvent,
    RunFailed,
    RunFinished,
    RunOutput,
    StageFinished,
    StageStarted,
)
from studio.media.audio import encode_audio
from studio.recipes.recipe import audio_recipe
from studio.store.files import WAV
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
        self._started = time.monotonic()  # the run is recorded just before the engine takes it
        self._first_audio: float | None = None  # when the first audio samples passed

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
        if isinstance(event, AudioDelta):
            if self._first_audio is None and event.samples.size:
                self._first_audio = time.monotonic()
        elif isinstance(event, StageStarted):
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
                self._record_finished(event, time.time(), time.monotonic())
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

    def _record_finished(self, event: RunFinished, at: float, now: float) -> None:
        run_id = self.run_id
        texts: list[str] = []
        image_index = audio_index = 0
        audio_seconds: float | None = None
        for output in event.outputs:
            if output.audio is not None:
                audio_seconds = audio_seconds or 0.0
                if output.audio.size and output.sample_rate:  # a silent reply makes no samples, no file
                    seconds = output.audio.size / output.sample_rate
                    self._submit_output(
                        audio_index,
                        _wav_encoder(output),
                        WAV,
                        None,
                        None,
                        {"duration_seconds": seconds, "sample_rate": output.sample_rate},
                    )
                    audio_index += 1
                    audio_seconds += seconds
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

        finish: dict[str, Any] = {
            "run_id": run_id,
            "status": "succeeded",
            "text": text,
            "usage": usage,
            "at": at,
        }
        if audio_seconds is not None:
            finish["audio"] = self._audio_figures(audio_seconds, now)
        self.recorder.submit_write(
            f"finish run {run_id} as succeeded", "finish_run", run_id, finish, note_output_errors
        )

    def _audio_figures(self, audio_seconds: float, now: float) -> dict[str, float | None]:
        """TTFP, audio seconds and real-time factor of a run that spoke (see the module's docstring)."""
        first = self._first_audio if self._first_audio is not None else now
        return {
            "ttfp_seconds": first - self._started if audio_seconds else None,
            "audio_seconds": audio_seconds,
            "realtime_factor": (now - self._started) / audio_seconds if audio_seconds else None,
        }

    def _submit_output(
        self,
        index: int,
        content: Any,
        mime: str,
        width: int | None,
        height: int | None,
        extra: dict[str, Any] | None = None,
    ) -> None:
        run_id = self.run_id

        kind = mime.split(";")[0]

        def failed(exc: Exception) -> None:
            self._output_errors.append(f"output {kind} #{index} not saved: {exc.__class__.__name__}: {exc}")

        self.recorder.submit_write(
            f"store output {index} ({kind}) of run {run_id}",
            "add_output_file",
            run_id,
            {
                "run_id": run_id,
                "index": index,
                "mime": mime,
                "width": width,
                "height": height,
                **(extra or {}),
            },
            prepare_output_file(self.store, content),
            failed,
        )


def _wav_encoder(output: RunOutput) -> Callable[[], bytes]:
    """The stored file of a spoken output: WAV with the run's recipe (docs/speech.md), encoded when called
    (on the writer thread); the same bytes ``omni-studio run --out x.wav`` writes."""
    samples, rate, recipe = output.audio, output.sample_rate, audio_recipe(output)
    assert samples is not None  # only spoken outputs are stored as audio

    def encode() -> bytes:
        return encode_audio(samples, rate, "wav", recipe)

    return encode
