"""Wiring: a thin router over the serving state (``studio/api/state.py``: the engine, options and
cached handlers), its middleware, and the app.
"""

from __future__ import annotations

import functools
import json
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from fastapi import APIRouter, FastAPI, Request, Response
from fastapi.responses import FileResponse, JSONResponse
from pydantic import BaseModel, ValidationError

from studio.api.authentication import accounts_on, check_output_visible
from studio.api.errors import APIError, from_validation_error
from studio.api.inputs import check_json_depth, check_json_text, decode_image_bytes
from studio.api.metrics import metrics_reader, own_positions
from studio.api.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    ErrorResponse,
    HealthResponse,
    ImageGenerationRequest,
    ImagesResponse,
    ModelCard,
    ModelList,
)
from studio.api.protocol_audio import SpeechRequest
from studio.api.refusals import RefusalThrottle
from studio.api.serving_jobs import StudioServingJobs, job_route_docs
from studio.api.state import ServingState
from studio.startup.limits import InputLimits
from studio.store.files import SERVED_MIMES, served_output

log = logging.getLogger("omni_studio.api")
ModelT = TypeVar("ModelT", bound=BaseModel)
EDIT_INT_FIELDS = ("n", "seed", "num_inference_steps", "height", "width")
EDIT_FLOAT_FIELDS = ("guidance_scale",)
# Refusals of generation requests are recorded as failed runs: nothing a client sent is lost. (401s are
# not: recording unauthenticated traffic would let anyone fill the history.)
RECORDED_ENDPOINTS = ("chat_completions", "images_generations", "images_edits", "audio_speech")
RECORDED_STATUSES = (400, 404, 413, 422, 429, 500, 503)


# An oversize body is read (and dropped) up to this many bytes before its 413: a client that is still
# sending when the answer comes (most HTTP clients read nothing until they have sent everything) would see
# a reset connection instead of the 413. Past it the answer goes out and the connection closes.
DISCARD_BEFORE_413 = 256 * 1024 * 1024


async def discard_body(request: Request, read: int) -> None:
    """Read and drop the rest of ``request``'s body, up to :data:`DISCARD_BEFORE_413` bytes in all."""
    try:
        async for piece in request.stream():
            read += len(piece)
            if read > DISCARD_BEFORE_413:
                return
    except Exception:  # the client went away, or the stream was already consumed: nothing to drain
        return


async def read_json(request: Request, limits: InputLimits) -> dict[str, Any]:
    """The request body as a JSON object; 413 past the body limit, 400 when not JSON, nested too deep or
    not valid Unicode text."""
    limit = limits.max_body_bytes
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > limit:
        await discard_body(request, 0)
        raise APIError(
            413,
            f"The request body is {declared} bytes; the limit is {limit} (--max-body-bytes)",
            None,
            "body_too_large",
        )
    body = bytearray()
    async for piece in request.stream():
        body += piece
        if len(body) > limit:
            await discard_body(request, len(body))
            raise APIError(
                413,
                f"The request body is larger than {limit} bytes (--max-body-bytes)",
                None,
                "body_too_large",
            )
    raw = {"raw_body": body[:2000].decode(errors="replace")}  # what is recorded when the body is refused
    request.state.omni_payload = raw
    try:
        data = json.loads(body)
    except RecursionError:  # the decoder's own stack limit, far past max_json_depth
        raise APIError(
            400, f"The JSON body nests deeper than {limits.max_json_depth} levels", None, "json_too_deep"
        ) from None
    except ValueError as exc:
        raise APIError(400, f"The body is not valid JSON: {exc}", None, "invalid_json") from exc
    check_json_depth(data, limits)
    if not isinstance(data, dict):
        raise APIError(400, "The body must be a JSON object", None, "invalid_json")
    request.state.omni_payload = data  # recorded as sent if refused from here on (the store escapes it)
    check_json_text(data)
    return data


def parse(model: type[ModelT], data: dict[str, Any]) -> ModelT:
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise from_validation_error(exc, data) from exc


async def read_edit_form(request: Request, state: ServingState) -> tuple[dict[str, Any], Any]:
    """Multipart form of ``/v1/images/edits`` -> (fields, source image)."""
    limit = state.options.limits.max_body_bytes
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > limit:
        await discard_body(request, 0)
        raise APIError(
            413, f"The request body is {declared} bytes; the limit is {limit}", None, "body_too_large"
        )
    try:
        form = await request.form(max_part_size=state.options.limits.max_image_bytes + 1)
    except Exception as exc:  # malformed multipart
        raise APIError(400, f"Expected multipart/form-data with an image and a prompt ({exc})") from exc
    fields: dict[str, Any] = {}
    uploads = []
    for key, value in form.multi_items():
        name = key.removesuffix("[]")
        if hasattr(value, "read"):
            if name != "image":
                raise APIError(400, f"Unsupported file field '{name}' (only 'image' is supported)", name)
            uploads.append(value)
        else:
            fields[name] = value
    if len(uploads) != 1:
        raise APIError(400, f"Expected exactly one 'image' file, got {len(uploads)}", "image")
    for key in EDIT_INT_FIELDS + EDIT_FLOAT_FIELDS:
        if key in fields:
            try:
                fields[key] = int(fields[key]) if key in EDIT_INT_FIELDS else float(fields[key])
            except ValueError:
                raise APIError(
                    400, f"Invalid value for '{key}': {fields[key]!r} is not a number", key
                ) from None
    data = await uploads[0].read()
    image = decode_image_bytes(data, "image", state.options.limits)
    return fields, image


def record_rejection(state: ServingState, request: Request, error: APIError) -> None:
    recorder = state.recorder
    if recorder is None or not hasattr(recorder, "record_rejected"):
        return
    payload = getattr(request.state, "omni_payload", None)
    if payload is None:
        payload = {"path": request.url.path, "note": "the body could not be read"}
    handlers = state.handlers
    try:
        error.run_id = recorder.record_rejected(
            state.source,
            payload,
            f"{error.status} {error.type}: {error.message}",
            state.served_model_name,
            state.engine.config if state.engine else None,
            handlers.system_fingerprint if handlers else None,
        )
    except Exception:  # recording must never turn a clear 4xx into a 500
        log.exception("could not record a rejected request")


Endpoint = Callable[[Request, ServingState], Awaitable[Response]]


def _endpoint(state: ServingState, name: str, handler: Endpoint, *, auth: bool = True):
    async def route(request: Request) -> Response:
        started = time.perf_counter()
        status = 500
        try:
            if auth:
                state.check_api_key(request)
            response = await handler(request, state)
            status = response.status_code
            return response
        except APIError as exc:
            status = exc.status
            if name in RECORDED_ENDPOINTS and exc.status in RECORDED_STATUSES and exc.run_id is None:
                record_rejection(state, request, exc)
            return exc.response()
        except Exception as exc:  # never let one request take the server down
            log.exception("unhandled error in %s", name)
            status = 500
            error = APIError(500, f"Internal error: {type(exc).__name__}: {exc}", None, "internal_error")
            if name in RECORDED_ENDPOINTS:  # nothing a client sent is lost, whatever went wrong
                record_rejection(state, request, error)
            return error.response()
        finally:
            state.metrics.requests.labels(name, str(status)).inc()
            state.metrics.latency.labels(name).observe(time.perf_counter() - started)

    route.__name__ = f"omni_{name}"
    return route


async def _health(request: Request, state: ServingState) -> Response:
    if state.handlers is None:
        return JSONResponse({"status": "starting"}, status_code=503)
    return JSONResponse({"status": "ok", "model": state.served_model_name})


async def _models(request: Request, state: ServingState) -> Response:
    return JSONResponse(state.require_handlers().models.list().model_dump())


async def _model(request: Request, state: ServingState) -> Response:
    model = request.path_params["model"]
    return JSONResponse(state.require_handlers().models.retrieve(model).model_dump())


async def _unknown(request: Request, state: ServingState) -> Response:
    """Any other ``/v1`` path or method: an OpenAI error body (404, or 405 naming the allowed methods)."""
    path = request.url.path
    allowed = sorted(
        {
            method
            for method, template, *_ in API_ROUTES
            if _path_matches(template, path) and template != UNKNOWN_PATH
        }
    )
    if allowed:
        raise APIError(
            405,
            f"{request.method} is not allowed on {path}; allowed: {', '.join(allowed)}",
            None,
            "method_not_allowed",
        )
    raise APIError(404, f"There is no route {path}; see /docs for the API", None, "not_found")


def _path_matches(template: str, path: str) -> bool:
    parts, wanted = template.strip("/").split("/"), path.strip("/").split("/")
    return len(parts) == len(wanted) and all(
        p == w or p.startswith("{") for p, w in zip(parts, wanted, strict=True)
    )


async def _chat(request: Request, state: ServingState) -> Response:
    handlers = state.require_handlers()
    payload = await read_json(request, state.options.limits)
    return await handlers.chat.create(parse(ChatCompletionRequest, payload), payload, request)


async def _images_generations(request: Request, state: ServingState) -> Response:
    handlers = state.require_handlers()
    payload = await read_json(request, state.options.limits)
    return await handlers.images.generate(parse(ImageGenerationRequest, payload), payload, request)


async def _images_edits(request: Request, state: ServingState) -> Response:
    handlers = state.require_handlers()
    fields, image = await read_edit_form(request, state)
    payload = {**fields, "image": "<uploaded file>"}
    request.state.omni_payload = payload
    return await handlers.images.generate(
        parse(ImageGenerationRequest, fields), payload, request, image=image
    )


async def _audio_speech(request: Request, state: ServingState) -> Response:
    handlers = state.require_handlers()
    payload = await read_json(request, state.options.limits)
    return await handlers.speech.create(parse(SpeechRequest, payload), payload, request)


async def _outputs(request: Request, state: ServingState) -> Response:
    name = request.path_params["name"]
    if state.options.api_key or accounts_on(state):
        # The bearer key, or a signed URL (what response_format "url" answers with a key set): a plain GET
        # of that URL works until it expires; tampered, expired or unsigned without the key -> 403.
        if request.headers.get("authorization"):
            state.check_api_key(request)
        else:
            problem = state.signer.problem(
                name, request.query_params.get("exp"), request.query_params.get("sig")
            )
            if problem is not None:
                raise APIError(
                    403,
                    f"{problem}: use the signed URL from the response or send 'Authorization: Bearer <key>'",
                    None,
                    "invalid_signature",
                )
    served = served_output(name)  # <sha256>.png, or audio: .wav .flac .mp3 .ogg (studio/store/files.py)
    files = state.files
    path = files.path(*served) if served is not None and files is not None else None
    if served is None or path is None or not path.is_file():
        raise APIError(404, f"No output file named {name!r}", "name", "file_not_found")
    check_output_visible(state, served[0], name)  # another user's file: 404 too (docs/team.md)
    return FileResponse(path, media_type=served[1])


def _jobs(state: ServingState) -> StudioServingJobs:
    """The job endpoints' handler (studio/api/serving_jobs.py); 503 until the job service runs."""
    if state.jobs is None:
        raise APIError(503, "Jobs are not available yet (the studio is starting)", None, "engine_not_ready")
    return StudioServingJobs(state.jobs, state.options.limits, state.output_url)


async def _jobs_create(request: Request, state: ServingState) -> Response:
    handler = _jobs(state)
    return handler.create(await read_json(request, state.options.limits), request)


async def _jobs_list(request: Request, state: ServingState) -> Response:
    return _jobs(state).list(request)


async def _jobs_get(request: Request, state: ServingState) -> Response:
    return _jobs(state).get(request.path_params["job_id"], request)


async def _jobs_cancel(request: Request, state: ServingState) -> Response:
    return _jobs(state).cancel(request.path_params["job_id"], request)


async def _jobs_grid(request: Request, state: ServingState) -> Response:
    return _jobs(state).grid(request.path_params["job_id"])


async def _metrics(request: Request, state: ServingState) -> Response:
    # Open while nothing is protected; then a key (the --api-key, or an account's own) or a UI login:
    # README, "--share"; docs/team.md ("/metrics").
    owner = await metrics_reader(state, request)
    engine = state.engine
    if engine is None:
        body = state.metrics.render({}, 0)
    else:
        body = state.metrics.render(
            engine.queue_depths(),
            engine.in_flight,
            engine.waiting_depths(),
            own_positions(engine.queue_positions(), _board_owner(state), owner),
            engine.decode_paths(),
        )
    return Response(body, media_type="text/plain; version=0.0.4; charset=utf-8")


def _board_owner(state: ServingState) -> Callable[[str], str | None]:
    """Who a request in the engine belongs to (``user:NAME``, ...; ``None``: no longer on the board)."""

    def owner_of(request_id: str) -> str | None:
        entry = state.board.get(request_id)
        return entry.owner if entry is not None else None

    return owner_of


API_ROUTES: list[tuple[str, str, str, Endpoint, bool]] = [
    ("GET", "/health", "health", _health, False),
    ("GET", "/metrics", "metrics", _metrics, False),
    ("GET", "/v1/models", "models", _models, True),
    ("GET", "/v1/models/{model}", "model", _model, True),
    ("POST", "/v1/chat/completions", "chat_completions", _chat, True),
    ("POST", "/v1/images/generations", "images_generations", _images_generations, True),
    ("POST", "/v1/images/edits", "images_edits", _images_edits, True),
    ("POST", "/v1/audio/speech", "audio_speech", _audio_speech, True),  # docs/speech.md, "The API"
    ("GET", "/v1/outputs/{name}", "outputs", _outputs, False),  # the key or a signed URL: see _outputs
    ("POST", "/v1/studio/jobs", "jobs_create", _jobs_create, True),  # batch jobs: docs/jobs.md
    ("GET", "/v1/studio/jobs", "jobs_list", _jobs_list, True),
    ("GET", "/v1/studio/jobs/{job_id}", "jobs_get", _jobs_get, True),
    ("DELETE", "/v1/studio/jobs/{job_id}", "jobs_cancel", _jobs_cancel, True),
    ("GET", "/v1/studio/jobs/{job_id}/grid", "jobs_grid", _jobs_grid, True),
]
UNKNOWN_PATH = "/v1/{path:path}"  # after every other route: OpenAI errors for unknown routes and methods
UNKNOWN_METHODS = ["GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS"]


def _errors(*statuses: int) -> dict[int | str, dict[str, Any]]:
    return {
        status: {"model": ErrorResponse, "description": ERROR_DESCRIPTIONS[status]} for status in statuses
    }


ERROR_DESCRIPTIONS = {
    400: "a bad, over-limit or unsupported field (`param` names it)",
    401: "missing or wrong API key",
    403: "an unsigned, tampered or expired output URL",
    404: "unknown model or file",
    405: "method not allowed",
    413: "body, image or input audio too large",
    422: "the upload is not an image",
    429: "queue full, too many requests in flight or too many wrong keys (Retry-After)",
    500: "engine failure (recorded as a failed run)",
    503: "the engine is not ready (Retry-After)",
}
GENERATION_ERRORS = (400, 401, 404, 413, 422, 429, 500, 503)
OUTPUT_RESPONSE = {
    "content": {mime: {"schema": {"type": "string", "format": "binary"}} for mime in SERVED_MIMES}
}
SSE_RESPONSE = {
    "description": "a chat completion, or with `stream: true` `chat.completion.chunk` events ending in "
    "`data: [DONE]`",
    "content": {"text/event-stream": {"schema": {"type": "string"}}},
}
SPEECH_RESPONSE = {
    "description": "the audio in response_format (its content type); with stream_format 'audio' the same "
    "bytes as they are made (pcm, or wav with an open-ended header); with 'sse' speech.audio.delta events "
    "then speech.audio.done",
    "content": {
        **{
            content_type: {"schema": {"type": "string", "format": "binary"}}
            for content_type in ("audio/wav", "audio/mpeg", "audio/flac", "audio/ogg", "audio/pcm")
        },
        "text/event-stream": {"schema": {"type": "string"}},
    },
}
ROUTE_DOCS: dict[str, dict[str, Any]] = {
    "health": {"response_model": HealthResponse, "summary": "Liveness: 'ok' once the engine serves"},
    "metrics": {
        "summary": "Prometheus metrics",
        "responses": {
            200: {"content": {"text/plain": {"schema": {"type": "string"}}}},
            **_errors(401),
        },
    },
    "models": {"response_model": ModelList, "summary": "The served model", "responses": _errors(401, 503)},
    "model": {
        "response_model": ModelCard,
        "summary": "One model by name (the SDK's models.retrieve)",
        "responses": _errors(401, 404, 503),
    },
    "chat_completions": {
        "response_model": ChatCompletionResponse,
        "summary": "Chat: text and images (streams with progress)",
        "responses": {200: SSE_RESPONSE, **_errors(*GENERATION_ERRORS)},
    },
    "images_generations": {
        "response_model": ImagesResponse,
        "summary": "Text to image",
        "responses": _errors(*GENERATION_ERRORS),
    },
    "images_edits": {
        "response_model": ImagesResponse,
        "summary": "Image to image (multipart form)",
        "responses": _errors(*GENERATION_ERRORS),
    },
    "audio_speech": {
        "summary": "Text to speech: the audio file, or a stream (stream_format audio or sse)",
        "response_class": Response,
        "responses": {200: SPEECH_RESPONSE, **_errors(*GENERATION_ERRORS)},
    },
    "outputs": {
        "summary": "An output file (a picture or a run's audio); the key or a signed URL when a key is set",
        "response_class": FileResponse,
        "responses": {200: OUTPUT_RESPONSE, **_errors(401, 403, 404)},
    },
    **job_route_docs(_errors),
}


def create_api_router(state: ServingState) -> APIRouter:
    """All API routes over ``state`` (include it in any FastAPI app, Gradio's included), with
    ``/openapi.json`` and ``/docs`` (studio/api/openapi.py)."""
    from studio import __version__
    from studio.api.openapi import build_document, docs_router

    router = APIRouter()
    for method, path, name, handler, auth in API_ROUTES:
        router.add_api_route(
            path,
            _endpoint(state, name, handler, auth=auth),
            methods=[method],
            include_in_schema=True,
            name=name,
            **ROUTE_DOCS.get(name, {}),
        )
    authenticated = {name for _, _, name, _, auth in API_ROUTES if auth}
    document = functools.partial(build_document, router, __version__, authenticated)
    router.include_router(docs_router(document))
    router.add_api_route(
        UNKNOWN_PATH,
        _endpoint(state, "unknown", _unknown, auth=False),
        methods=UNKNOWN_METHODS,
        include_in_schema=False,
        name="unknown",
    )
    return router


def create_app(state: ServingState) -> FastAPI:
    """The API-only app behind ``omni-studio serve``."""
    from studio import __version__

    # The document and the docs pages come from the router (the same in `ui` mode): not FastAPI's own.
    app = FastAPI(
        title="Omni Studio API", version=__version__, openapi_url=None, docs_url=None, redoc_url=None
    )
    app.include_router(create_api_router(state))
    app.add_middleware(RefusalThrottle, rate=state.refusals)
    app.state.serving = state
    return app
