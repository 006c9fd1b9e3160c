"""One run path for the API, the UI and the CLI: resolve a request, record it, stream it, keep outputs.

:class:`RunService` is the only code that records while streaming: it starts the run record, passes every
engine event to the run's tracker as it goes by (async for the API and UI, blocking for the CLI), marks a
run the engine refused, a caller that went away, or a failure, and writes output files through the run
store's :class:`~studio.store.files.OutputFiles`. A run's outcome is recorded once: whoever marks it first
wins, so a caller may record a more precise reason (e.g. "the client disconnected") before closing.
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import AsyncGenerator, Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Protocol, cast

from engine import GenerationRequest, OmniEngine, RequestError, ResolvedRequest
from engine.engine import EngineBusy, EngineClosed
from engine.events import EngineEvent, RunFailed, RunFinished
from studio.accounts.identity import current_user
from studio.media.images import png_bytes
from studio.recipes.recipe import RecipeStamper, RunRecipe
from studio.runs.inflight import RequestBoard, output_of
from studio.startup.limits import InputLimits
from studio.store.files import PNG, OutputFiles


class RunTracking(Protocol):
    """What a run needs from the run store's per-run tracker (``studio.store.tracker.RunTracker``)."""

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
        replay_of: str | None = None,
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


@dataclass(frozen=True)
class Queued:
    """Not an engine event: the run is waiting in a stage's queue with ``ahead`` jobs before it."""

    request_id: str
    ahead: int


class ClientSlots:
    """Requests in flight per client (an API key and address, a UI session): at most ``limit`` each."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._lock = threading.Lock()
        self._counts: dict[str, int] = {}

    def in_flight(self, client: str) -> int:
        with self._lock:
            return self._counts.get(client, 0)

    def full(self, client: str) -> bool:
        return self.in_flight(client) >= self.limit

    def acquire(self, client: str) -> bool:
        with self._lock:
            count = self._counts.get(client, 0)
            if count >= self.limit:
                return False
            self._counts[client] = count + 1
            return True

    def release(self, client: str) -> None:
        with self._lock:
            count = self._counts.get(client, 0) - 1
            if count > 0:
                self._counts[client] = count
            else:
                self._counts.pop(client, None)

    def message(self) -> str:
        return f"{self.limit} requests of this client are in flight (limit {self.limit}, --max-in-flight-per-client)"


class RunService:
    """Runs requests from one source (``api``, ``ui`` or ``cli``) through an engine, recording them."""

    def __init__(
        self,
        recorder: Recording | None,
        source: str,
        files: OutputFiles | None = None,
        on_event: Callable[[EngineEvent], None] | None = None,
        limits: InputLimits | None = None,
        slots: ClientSlots | None = None,
        board: RequestBoard | None = None,
    ) -> None:
        self.recorder = recorder
        self.board = board  # the requests in flight, for the Queue panel (studio/runs/inflight.py)
        self.source = source
        self.files = files
        self.on_event = on_event
        self.limits = limits or InputLimits()
        self.slots = slots

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
        resolved = engine.resolve(request)
        engine.check_context(resolved)  # a prompt past the model's context never reaches the queue
        return resolved

    @staticmethod
    def client_of(client: str | None) -> str | None:
        """Who a request counts against (its in-flight limit, the fair queue): the account the current API
        request acts as (``user:NAME``: one client however many keys and addresses it uses, docs/team.md),
        else ``client`` (an address and key, a UI session)."""
        user = current_user()
        return f"user:{user}" if user is not None and client is not None else client

    def admission_problem(self, engine: OmniEngine, client: str | None) -> RunRejected | None:
        """Why a run of ``client`` would be refused now (the client's limit, a full queue), or ``None``.

        A streamed response checks this before its headers go out, so the refusal is a 429, not an
        error chunk; the run itself still enforces both.
        """
        client = self.client_of(client)
        if client is not None and self.slots is not None and self.slots.full(client):
            return RunRejected("client_limit", self.slots.message())
        if engine.in_flight >= engine.max_pending:
            return RunRejected(
                "queue_full", f"{engine.in_flight} requests in flight (limit {engine.max_pending})"
            )
        return None

    def start(
        self,
        engine: OmniEngine,
        resolved: ResolvedRequest,
        model_name: str,
        fingerprint: str | None,
        payload: dict[str, Any],
        replay_of: str | None = None,
        user: str | None = None,
    ) -> RunTracking:
        """Record a new queued run for ``resolved`` (its id is the request id) and return its tracker.

        ``replay_of``: the recorded run this one replays (``studio/replay/replayer.py``); the store links them.
        ``user``: the account the run belongs to (docs/team.md); by default the account the current API
        request authenticated as (``studio/api/authentication.py``), if any.
        The tracker writes the run's recipe into each output image before anyone encodes it, so every PNG
        of the run (response, UI, CLI file, run store) carries it (studio/recipes/recipe.py, docs/recipes.md).
        """
        recipe = RunRecipe.of(resolved, engine.config, fingerprint)  # before the recorder: see RunRecipe.of
        if self.recorder is None:
            return RecipeStamper(NoTracking(), recipe)
        user = user if user is not None else current_user()
        # Only with an account: recorders that predate accounts (and test doubles) take no ``user``.
        owned = {"user": user} if user is not None else {}
        tracker = self.recorder.start_run(
            self.source,
            resolved,
            engine.config,
            model_name,
            fingerprint,
            payload,
            replay_of=replay_of,
            **owned,
        )
        return RecipeStamper(tracker, recipe)

    def _observe(self, tracker: RunTracking, event: EngineEvent) -> None:
        tracker.observe(event)
        if self.board is not None:
            self.board.observe(event)
        if self.on_event is not None:
            self.on_event(event)

    @staticmethod
    def reject(rejection: RunRejected, tracker: RunTracking) -> RunRejected:
        """Record ``rejection`` as the run's failure and return it (to raise)."""
        if rejection.reason == "client_limit":
            tracker.fail(f"rejected: too many requests of this client ({rejection.message})")
        elif rejection.reason == "queue_full":
            tracker.fail(f"rejected: queue full ({rejection.message})")
        else:
            tracker.fail("rejected: the engine is being replaced")
        return rejection

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
        client: str | None = None,
        owner: str | None = None,
    ) -> AsyncGenerator[EngineEvent, None]:
        """The engine's events for ``resolved``, recorded as they pass.

        A refused run (the engine's queue full, ``client`` at its in-flight limit) raises
        :class:`RunRejected`; a run left before its terminal event (the iterator closed, an error) is
        recorded as cancelled with ``stopped``, and closing cancels the request. ``owner`` (default: the
        source and ``client``) is who the Queue panel lets cancel it. An API request of an account counts
        as that account (:meth:`client_of`) and belongs to it (``user:NAME``).
        """
        client = self.client_of(client)
        if client is not None and client.startswith("user:") and owner is None:
            owner = client
        slots = self.slots if client is not None else None
        if slots is not None and client is not None and not slots.acquire(client):
            raise self.reject(RunRejected("client_limit", slots.message()), tracker)
        if self.board is not None:
            who = owner or (f"{self.source}:{client}" if client else None)
            output = output_of(resolved.modalities, resolved.parameters)
            self.board.add(resolved.request_id, self.source, who, resolved.request.prompt, engine, output)
        if client is not None or owner is not None:  # the stage queues take clients round-robin
            if client is not None and client.startswith("user:"):
                who = client  # one client per account, from the UI, the API and jobs alike
            else:
                who = f"{self.source}:{client}" if client is not None else str(owner)
            resolved = replace(resolved, request=replace(resolved.request, client=who))
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
            try:
                await agen.aclose()
            finally:
                if self.board is not None:
                    self.board.remove(resolved.request_id)
                if slots is not None and client is not None:
                    slots.release(client)

    async def run_to_end(
        self,
        engine: OmniEngine,
        resolved: ResolvedRequest,
        tracker: RunTracking,
        *,
        stopped: str,
        client: str | None = None,
        owner: str | None = None,
    ) -> Terminal | None:
        """Run ``resolved`` without watching its progress; returns its terminal event."""
        terminal: Terminal | None = None
        events = self.events(
            engine, resolved, tracker, progress=False, stopped=stopped, client=client, owner=owner
        )
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
