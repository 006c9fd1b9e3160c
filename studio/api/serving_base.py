"""What every serving handler shares: the engine, the cached fingerprint, limits, the run service, and
running a request to completion with client-disconnect detection.

Handlers call :class:`studio.runs.service.RunService` directly (``resolve``, ``start``, ``events``,
``admission_problem``); what is here turns its outcomes into HTTP errors (:func:`request_error`,
:func:`rejection_error`) and watches the client while a non-streamed run works (:meth:`run_to_completion`).

Handlers are built by :class:`studio.api.state.ServingState` *after* the fingerprint mode is applied, and
read ``context.system_fingerprint`` once at construction: changing the mode means building new handlers.
Recording while streaming is :class:`studio.runs.service.RunService`'s job; this module turns its outcomes into
HTTP errors.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from fastapi import Request

from engine import GenerationRequest, OmniEngine, RequestError, ResolvedRequest
from engine.events import RunFailed, RunFinished
from studio.api.errors import APIError
from studio.api.metrics import APIMetrics
from studio.api.refusals import client_key
from studio.media.images import png_bytes
from studio.runs.service import Recording, RunRejected, RunService, RunTracking
from studio.startup.limits import InputLimits

__all__ = ["OpenAIServing", "Recording", "RunTracking", "ServingContext", "png_data_url", "usage_of"]

log = logging.getLogger("omni_studio.api")
DISCONNECT_POLL_S = 0.25


@dataclass(frozen=True)
class ServingContext:
    """Everything a handler reads at construction (and caches)."""

    engine: OmniEngine
    served_model_name: str
    system_fingerprint: str | None
    metrics: APIMetrics
    limits: InputLimits
    runs: RunService
    image_reply: str = "content"  # the server's default: list content, or "images" (message.images)
    output_url: Callable[[str, str], str] | None = None  # (base URL, sha256) -> URL, signed with a key set


def png_data_url(image: Any) -> str:
    return "data:image/png;base64," + base64.b64encode(png_bytes(image)).decode()


RETRY_AFTER_S = 1


def request_error(
    exc: RequestError, prompt_field: str = "prompt", fields: Mapping[str, str] | None = None
) -> APIError:
    """A request the run service refused (``RunService.resolve``) as a 400 naming the client's field
    (``prompt_field``: what the client calls the prompt; chat: ``messages``; ``fields``: other engine
    fields the client names otherwise, e.g. ``voice`` -> ``audio.voice``)."""
    field = prompt_field if exc.field in ("prompt", "history") else exc.field
    field = (fields or {}).get(exc.field, field)
    message = str(exc)
    if field != exc.field:
        message = f"{field}: {exc.message}"
    return APIError(400, message, field)


def rejection_error(exc: RunRejected) -> APIError:
    """Queue full or the client's in-flight limit -> 429 with ``Retry-After``, engine being replaced -> 503."""
    if exc.reason in ("queue_full", "client_limit"):
        message = (
            f"The server is busy: {exc.message}. Retry later."
            if exc.reason == "queue_full"
            else f"Too many requests in flight: {exc.message}. Retry when one has finished."
        )
        error = APIError(429, message, None, exc.reason)
        error.retry_after = RETRY_AFTER_S
        return error
    return APIError(503, "The engine is restarting; retry shortly", None, "engine_not_ready")


def client_id(raw_request: Request | None) -> str | None:
    """Who a request counts against for ``--max-in-flight-per-client``: its address and the API key
    it sends (hashed), so clients behind one address keep apart by key and keyless clients by address."""
    if raw_request is None:
        return None
    return client_key(raw_request.scope)


WARNING_HEADER = "X-Omni-Studio-Warning"  # a request outside what the model supports (README, "The API")


def reply_headers(resolved: ResolvedRequest, tracker: RunTracking) -> dict[str, str]:
    """Headers of a generation reply: the run id, and the model card's warnings when there are any."""
    headers = {"X-Run-Id": tracker.run_id}
    if resolved.warnings:
        headers[WARNING_HEADER] = "; ".join(resolved.warnings)
    return headers


class OpenAIServing:
    """Base of the endpoint handlers."""

    def __init__(self, context: ServingContext) -> None:
        self.context = context
        self.engine = context.engine
        self.runs = context.runs
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

    prompt_field = "prompt"  # what the client calls the prompt (chat: ``messages``)

    def start_run(
        self,
        engine_request: GenerationRequest,
        payload: dict[str, Any],
        fields: Mapping[str, str] | None = None,
    ) -> tuple[ResolvedRequest, RunTracking]:
        """Resolve the request (a bad field is a 400 naming it, ``fields`` mapping engine field names to
        the client's) and record its run as started."""
        try:
            resolved = self.runs.resolve(self.engine, engine_request)
        except RequestError as exc:
            raise request_error(exc, self.prompt_field, fields) from exc
        tracker = self.runs.start(
            self.engine, resolved, self.served_model_name, self.system_fingerprint, payload
        )
        return resolved, tracker

    async def run_to_completion(
        self, resolved: ResolvedRequest, tracker: RunTracking, raw_request: Request | None
    ) -> RunFinished:
        """Run a non-streaming request; a client that goes away cancels it (recorded as cancelled).

        Every error raised here is already recorded under ``tracker``'s run (:func:`recorded`).
        """
        task = asyncio.create_task(
            self.runs.run_to_end(
                self.engine,
                resolved,
                tracker,
                stopped="the request was cancelled by the server",
                client=client_id(raw_request),
            )
        )
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
                if done:
                    break
                if raw_request is not None and await raw_request.is_disconnected():
                    tracker.fail("the client disconnected", cancelled=True)  # before the run service's note
                    task.cancel()
                    with contextlib.suppress(asyncio.CancelledError, RunRejected):
                        await task
                    raise recorded(APIError(499, "client disconnected"), tracker)
        except asyncio.CancelledError:
            tracker.fail("the request was cancelled by the server", cancelled=True)
            task.cancel()
            raise
        try:
            terminal = task.result()
        except RunRejected as exc:
            raise recorded(rejection_error(exc), tracker) from exc
        if isinstance(terminal, RunFinished):
            return terminal
        if isinstance(terminal, RunFailed):
            if terminal.error_type == "invalid_request":
                raise recorded(APIError(400, terminal.message), tracker)
            raise recorded(
                APIError(500, f"The engine failed: {terminal.message}", None, "engine_error"), tracker
            )
        raise recorded(
            APIError(500, "the engine ended the request without a result", None, "engine_error"), tracker
        )


def recorded(error: APIError, tracker: RunTracking) -> APIError:
    """Mark ``error`` as already recorded (under ``tracker``'s run) so it is not recorded twice."""
    error.run_id = tracker.run_id or None
    return error


def usage_of(result: RunFinished) -> dict[str, int]:
    prompt = max((o.input_tokens for o in result.outputs), default=0)
    completion = sum(o.output_tokens for o in result.outputs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


FINGERPRINT_HEADER = "X-System-Fingerprint"  # replies whose body cannot carry it (audio files, README)


def fingerprint_headers(fingerprint: str | None) -> dict[str, str]:
    return {} if fingerprint is None else {FINGERPRINT_HEADER: fingerprint}
