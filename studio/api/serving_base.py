"""What every serving handler shares: the engine, the cached fingerprint, recording, limits, and running a
request to completion with client-disconnect detection.

Handlers are built by :class:`studio.api.app.ServingState` *after* the fingerprint mode is applied, and
read ``context.system_fingerprint`` once at construction: changing the mode means building new handlers.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from fastapi import Request

from engine import GenerationRequest, OmniEngine, RequestError, ResolvedRequest
from engine.engine import EngineBusy, EngineClosed
from engine.events import EngineEvent, RunFailed, RunFinished, StageFinished
from studio.api.errors import APIError
from studio.api.inputs import InputLimits
from studio.api.metrics import APIMetrics
from studio.media import png_bytes

log = logging.getLogger("omni_studio.api")
DISCONNECT_POLL_S = 0.25


class RunTracking(Protocol):
    """What the API needs from the run store's per-run tracker (``studio.store.recorder.RunTracker``)."""

    run_id: str

    def observe(self, event: EngineEvent) -> None: ...

    def fail(self, message: str, cancelled: bool = False) -> None: ...

    def finished(self) -> bool: ...


class Recording(Protocol):
    def start_run(
        self,
        source: str,
        resolved: ResolvedRequest,
        config: Any,
        model_name: str,
        fingerprint: str | None,
        request_payload: dict[str, Any],
    ) -> RunTracking: ...


@dataclass(frozen=True)
class ServingContext:
    """Everything a handler reads at construction (and caches)."""

    engine: OmniEngine
    served_model_name: str
    system_fingerprint: str | None
    metrics: APIMetrics
    limits: InputLimits
    recorder: Recording | None = None
    outputs_dir: Path | None = None
    source: str = "api"


def png_data_url(image: Any) -> str:
    return "data:image/png;base64," + base64.b64encode(png_bytes(image)).decode()


class _NoTracking:
    run_id = ""

    def observe(self, event: EngineEvent) -> None:
        pass

    def fail(self, message: str, cancelled: bool = False) -> None:
        pass

    def finished(self) -> bool:
        return True


class OpenAIServing:
    """Base of the endpoint handlers."""

    def __init__(self, context: ServingContext) -> None:
        self.context = context
        self.engine = context.engine
        self.served_model_name = context.served_model_name
        self.system_fingerprint = context.system_fingerprint  # read once: see the module docstring

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.served_model_name:
            raise APIError(
                404,
                f"The model '{model}' does not exist; this server serves '{self.served_model_name}'",
                "model",
                "model_not_found",
            )

    def resolve(self, request: GenerationRequest) -> ResolvedRequest:
        try:
            return self.engine.resolve(request)
        except RequestError as exc:
            raise APIError(400, str(exc), exc.field) from exc

    def track(self, resolved: ResolvedRequest, payload: dict[str, Any]) -> RunTracking:
        recorder = self.context.recorder
        if recorder is None:
            return _NoTracking()
        return recorder.start_run(
            self.context.source,
            resolved,
            self.engine.config,
            self.served_model_name,
            self.system_fingerprint,
            payload,
        )

    def observe(self, tracker: RunTracking, event: EngineEvent) -> None:
        tracker.observe(event)
        if isinstance(event, StageFinished):
            self.context.metrics.observe_stage(event)

    async def events(
        self, resolved: ResolvedRequest, tracker: RunTracking, progress: bool = True
    ) -> AsyncIterator[EngineEvent]:
        """The engine's events for ``resolved``, recorded as they pass; queue-full and shutdown become 429/503."""
        agen = self.engine.generate(resolved, progress=progress)
        try:
            try:
                first = await agen.__anext__()
            except EngineBusy as exc:
                tracker.fail(f"rejected: queue full ({exc})")
                raise recorded(
                    APIError(429, f"The server is busy: {exc}. Retry later.", None, "queue_full"), tracker
                ) from exc
            except EngineClosed as exc:
                tracker.fail("rejected: the engine is being replaced")
                raise recorded(
                    APIError(503, "The engine is restarting; retry shortly", None, "engine_not_ready"),
                    tracker,
                ) from exc
            self.observe(tracker, first)
            yield first
            async for event in agen:
                self.observe(tracker, event)
                yield event
        finally:
            await agen.aclose()

    async def run_to_completion(
        self, resolved: ResolvedRequest, tracker: RunTracking, raw_request: Request | None
    ) -> RunFinished:
        """Run a non-streaming request; a client that goes away cancels it (recorded as cancelled)."""
        try:
            return await self._run_to_completion(resolved, tracker, raw_request)
        except APIError as exc:
            raise recorded(exc, tracker) from None

    async def _run_to_completion(
        self, resolved: ResolvedRequest, tracker: RunTracking, raw_request: Request | None
    ) -> RunFinished:

        async def consume() -> EngineEvent | None:
            terminal = None
            async for event in self.events(resolved, tracker, progress=False):  # nobody watches progress
                if isinstance(event, (RunFinished, RunFailed)):
                    terminal = event
            return terminal

        task = asyncio.create_task(consume())
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
                if done:
                    break
                if raw_request is not None and await raw_request.is_disconnected():
                    task.cancel()
                    with contextlib.suppress(asyncio.CancelledError, APIError):
                        await task
                    tracker.fail("the client disconnected", cancelled=True)
                    raise APIError(499, "client disconnected")
        except asyncio.CancelledError:
            task.cancel()
            tracker.fail("the request was cancelled by the server", cancelled=True)
            raise
        terminal = task.result()
        if isinstance(terminal, RunFinished):
            return terminal
        if isinstance(terminal, RunFailed):
            if terminal.error_type == "invalid_request":
                raise APIError(400, terminal.message)
            raise APIError(500, f"The engine failed: {terminal.message}", None, "engine_error")
        raise APIError(500, "the engine ended the request without a result", None, "engine_error")


def recorded(error: APIError, tracker: RunTracking) -> APIError:
    """Mark ``error`` as already recorded (under ``tracker``'s run) so it is not recorded twice."""
    error.run_id = tracker.run_id or None
    return error


def usage_of(result: RunFinished) -> dict[str, int]:
    prompt = max((o.input_tokens for o in result.outputs), default=0)
    completion = sum(o.output_tokens for o in result.outputs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
