"""One run path for the API, the UI and the CLI: resolve a request, record it, stream it, keep outputs.

:class:`RunService` is the only code that records while streaming: it starts the run record, passes every
engine event to the run's tracker as it goes by (async for the API and UI, blocking for the CLI), marks a
run the engine refused, a caller that went away, or a failure, and writes output files through the run
store's :class:`~studio.store.files.OutputFiles`. A run's outcome is recorded once: whoever marks it first
wins, so a caller may record a more precise reason (e.g. "the client disconnected") before closing.
"""

from __future__ import annotations

import hashlib
from collections.abc import AsyncGenerator, Callable, Iterator
from pathlib import Path
from typing import Any, Protocol, cast

from engine import GenerationRequest, OmniEngine, RequestError, ResolvedRequest
from engine.engine import EngineBusy, EngineClosed
from engine.events import EngineEvent, RunFailed, RunFinished
from studio.limits import InputLimits
from studio.media import png_bytes
from studio.store.files import PNG, OutputFiles


class RunTracking(Protocol):
    """What a run needs from the run store's per-run tracker (``studio.store.recorder.RunTracker``)."""

    run_id: str

    def observe(self, event: EngineEvent) -> None: ...

    def fail(self, message: str, cancelled: bool = False) -> bool: ...

    def finished(self) -> bool: ...


class Recording(Protocol):
    """What the run service needs from the run store's recorder (``studio.store.recorder.RunRecorder``)."""

    def start_run(
        self,
        source: str,
        resolved: ResolvedRequest,
        config: Any,
        model_name: str,
        fingerprint: str | None,
        request_payload: dict[str, Any],
    ) -> RunTracking: ...


class NoTracking:
    """The tracker of a run nobody records (no run store)."""

    run_id = ""

    def observe(self, event: EngineEvent) -> None:
        pass

    def fail(self, message: str, cancelled: bool = False) -> bool:
        return False

    def finished(self) -> bool:
        return True


class RunRejected(Exception):
    """The engine refused the run before it started; ``reason`` is ``queue_full`` or ``engine_restarting``.

    The run is already recorded as failed when this is raised.
    """

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message


Terminal = RunFinished | RunFailed


class RunService:
    """Runs requests from one source (``api``, ``ui`` or ``cli``) through an engine, recording them."""

    def __init__(
        self,
        recorder: Recording | None,
        source: str,
        files: OutputFiles | None = None,
        on_event: Callable[[EngineEvent], None] | None = None,
        limits: InputLimits | None = None,
    ) -> None:
        self.recorder = recorder
        self.source = source
        self.files = files
        self.on_event = on_event
        self.limits = limits or InputLimits()

    def resolve(self, engine: OmniEngine, request: GenerationRequest) -> ResolvedRequest:
        """Defaults and checks applied (raises :class:`engine.RequestError` for a bad request).

        Prompts longer than the prompt limit, or not valid Unicode text, are refused here, before the
        engine tokenizes them (a long prompt costs every other client its prefill time).
        """
        limit = self.limits.max_prompt_chars
        texts = [("prompt", request.prompt), ("negative_prompt", request.params.negative_prompt)]
        texts += [("history", turn.text) for turn in request.history]
        for name, text in texts:
            if text is None:
                continue
            if len(text) > limit:
                raise RequestError(
                    name, f"is {len(text)} characters; the limit is {limit} (--max-prompt-chars)"
                )
            try:
                text.encode("utf-8")
            except UnicodeEncodeError as exc:  # a lone surrogate: no tokenizer takes it
                raise RequestError(
                    name, f"is not valid Unicode text (a lone surrogate at {exc.start})"
                ) from None
        return engine.resolve(request)

    def start(
        self,
        engine: OmniEngine,
        resolved: ResolvedRequest,
        model_name: str,
        fingerprint: str | None,
        payload: dict[str, Any],
    ) -> RunTracking:
        """Record a new queued run for ``resolved`` (its id is the request id) and return its tracker."""
        if self.recorder is None:
            return NoTracking()
        return self.recorder.start_run(self.source, resolved, engine.config, model_name, fingerprint, payload)

    def _observe(self, tracker: RunTracking, event: EngineEvent) -> None:
        tracker.observe(event)
        if self.on_event is not None:
            self.on_event(event)

    @staticmethod
    def _rejected(exc: Exception, tracker: RunTracking) -> RunRejected:
        if isinstance(exc, EngineBusy):
            tracker.fail(f"rejected: queue full ({exc})")
            return RunRejected("queue_full", str(exc))
        tracker.fail("rejected: the engine is being replaced")
        return RunRejected("engine_restarting", str(exc))

    async def events(
        self,
        engine: OmniEngine,
        resolved: ResolvedRequest,
        tracker: RunTracking,
        *,
        progress: bool = True,
        stopped: str = "stopped before the run finished",
    ) -> AsyncGenerator[EngineEvent, None]:
        """The engine's events for ``resolved``, recorded as they pass.

        A refused run raises :class:`RunRejected`; a run left before its terminal event (the iterator
        closed, an error) is recorded as cancelled with ``stopped``, and closing cancels the request.
        """
        # OmniEngine.generate is an async generator (typed as an iterator): closing it cancels the request.
        agen = cast(AsyncGenerator[EngineEvent, None], engine.generate(resolved, progress=progress))
        finished = False
        try:
            try:
                first = await agen.__anext__()
            except (EngineBusy, EngineClosed) as exc:
                finished = True
                raise self._rejected(exc, tracker) from exc
            self._observe(tracker, first)
            yield first
            async for event in agen:
                self._observe(tracker, event)
                yield event
            finished = True
        finally:
            if not finished:
                tracker.fail(stopped, cancelled=True)
            await agen.aclose()

    async def run_to_end(
        self, engine: OmniEngine, resolved: ResolvedRequest, tracker: RunTracking, *, stopped: str
    ) -> Terminal | None:
        """Run ``resolved`` without watching its progress; returns its terminal event."""
        terminal: Terminal | None = None
        events = self.events(engine, resolved, tracker, progress=False, stopped=stopped)
        try:
            async for event in events:
                if isinstance(event, (RunFinished, RunFailed)):
                    terminal = event
        finally:
            await events.aclose()
        return terminal

    def run_blocking(
        self,
        engine: OmniEngine,
        resolved: ResolvedRequest,
        tracker: RunTracking,
        *,
        on_event: Callable[[EngineEvent], None] | None = None,
        stopped: str = "stopped before the run finished",
    ) -> Terminal | None:
        """The blocking counterpart of :meth:`events` (the CLI): runs to the end, returns the terminal event.

        Ctrl-C (or any error) records the run as cancelled with ``stopped`` and propagates.
        """
        terminal: Terminal | None = None
        stream: Iterator[EngineEvent] = engine.stream(resolved)
        finished = False
        try:
            try:
                first = next(stream)
            except (EngineBusy, EngineClosed) as exc:
                finished = True
                raise self._rejected(exc, tracker) from exc
            except StopIteration:
                finished = True
                return None
            for event in _chain(first, stream):
                self._observe(tracker, event)
                if on_event is not None:
                    on_event(event)
                if isinstance(event, (RunFinished, RunFailed)):
                    terminal = event
            finished = True
        finally:
            if not finished:
                tracker.fail(stopped, cancelled=True)
            close = getattr(stream, "close", None)
            if close is not None:
                close()  # cancels the request if it is still running
        return terminal

    def keep_image(self, image: Any) -> tuple[str, Path] | None:
        """Write ``image`` as PNG to the output files (once per hash); its sha256 and path, or ``None``
        without a data dir. The recorder stores the same file for the run: same bytes, same hash."""
        if self.files is None:
            return None
        data = png_bytes(image)
        return self.files.write(data, PNG, hashlib.sha256(data).hexdigest())


def _chain(first: EngineEvent, rest: Iterator[EngineEvent]) -> Iterator[EngineEvent]:
    yield first
    yield from rest
