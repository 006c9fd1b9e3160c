"""The OpenAPI document (``/openapi.json``) and the docs page (``/docs``, Swagger UI) served offline.

The routes read their bodies themselves (``studio.api.app.read_json``: body bytes, JSON depth and lone
surrogates are checked, and a refused request recorded as a run, before pydantic sees the body), so FastAPI
cannot see the bodies in their signatures. The document declares them from the same pydantic models the
routes validate with (:data:`REQUEST_BODIES`), plus the path and query parameters and the bearer scheme:
what the document says is what the server checks. Response models are declared on the routes themselves.

The Swagger UI assets come from the installed ``fastapi-offline`` package and are served by the
studio under ``/docs/assets/``: no page loads anything from elsewhere.
"""

from __future__ import annotations

import copy
import functools
import mimetypes
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Request, Response
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.openapi.utils import get_openapi
from fastapi.responses import FileResponse, JSONResponse
from pydantic import BaseModel

from studio.api.protocol import ChatCompletionRequest, ImageEditForm, ImageGenerationRequest
from studio.api.protocol_audio import SpeechRequest
from studio.jobs.spec import JobSpec

TITLE = "Omni Studio API"
DESCRIPTION = (
    "OpenAI-compatible API of Omni Studio (README.md, 'The API'). Errors are OpenAI error bodies "
    '`{"error": {"message", "type", "param", "code"}}`: `param` is the client\'s field path. With an API '
    "key set, `/v1` needs `Authorization: Bearer <key>`; signed `/v1/outputs` URLs work without it."
)
OPENAPI_PATH = "/openapi.json"
ASSETS_PATH = "/docs/assets"
ASSETS = ("swagger-ui-bundle.js", "swagger-ui.css", "favicon.png")
# No ReDoc page: its bundle loads a logo from its vendor's site, and the docs must work offline.
SECURITY_SCHEME = "bearer"
# operation name -> (content type, the model the route validates the body with)
REQUEST_BODIES: dict[str, tuple[str, type[BaseModel]]] = {
    "chat_completions": ("application/json", ChatCompletionRequest),
    "images_generations": ("application/json", ImageGenerationRequest),
    "images_edits": ("multipart/form-data", ImageEditForm),
    "audio_speech": ("application/json", SpeechRequest),
    "jobs_create": ("application/json", JobSpec),
}
SIGNED_URL_PARAMS = [
    {
        "name": "exp",
        "in": "query",
        "required": False,
        "description": "expiry (Unix time) of a signed URL",
        "schema": {"type": "string", "pattern": "^[0-9]{1,12}$"},
    },
    {
        "name": "sig",
        "in": "query",
        "required": False,
        "description": "HMAC-SHA256 signature of a signed URL",
        "schema": {"type": "string"},
    },
]
PATH_PARAM_DOCS = {
    "model": "the served model's name (GET /v1/models lists it)",
    "name": "an output file, `<sha256>.png` (a picture) or `<sha256>.wav|.flac|.mp3|.ogg` (audio)",
    "job_id": "a job's id (POST /v1/studio/jobs answers with it)",
}
PATH_PARAM_PATTERNS = {"name": "^[0-9a-f]{64}\\.(png|wav|flac|mp3|ogg)$"}


def assets_dir() -> Path:
    import fastapi_offline

    return Path(fastapi_offline.__file__).parent / "static"


def _add_schemas(components: dict[str, Any], model: type[BaseModel]) -> dict[str, Any]:
    schema = model.model_json_schema(ref_template="#/components/schemas/{model}", mode="validation")
    schemas = components.setdefault("schemas", {})
    for name, definition in {**schema.pop("$defs", {}), model.__name__: schema}.items():
        if name in schemas and schemas[name] != definition:
            raise RuntimeError(f"two different OpenAPI schemas are named {name!r}")
        schemas[name] = definition
    return {"$ref": f"#/components/schemas/{model.__name__}"}


def build_document(router: APIRouter, version: str, authenticated: set[str]) -> dict[str, Any]:
    """The document of ``router``'s routes (those in the schema), with request bodies, parameters and
    security added; ``authenticated``: the operation names that need the key when one is set."""
    document = get_openapi(title=TITLE, version=version, description=DESCRIPTION, routes=router.routes)
    components = document.setdefault("components", {})
    components["securitySchemes"] = {
        SECURITY_SCHEME: {
            "type": "http",
            "scheme": "bearer",
            "description": "the server's API key (--api-key); not needed when none is set",
        }
    }
    # One path may carry several operations (GET and DELETE /v1/studio/jobs/{job_id}): named per method.
    names = {
        (getattr(route, "path", None), method.lower()): getattr(route, "name", None)
        for route in router.routes
        for method in getattr(route, "methods", None) or ()
    }
    for path, operations in document.get("paths", {}).items():
        for method, operation in operations.items():
            name = names.get((path, method))
            parameters = operation.setdefault("parameters", [])
            declared = {p["name"] for p in parameters}
            for part in path.split("/"):
                if part.startswith("{") and part.strip("{}") not in declared:
                    param = part.strip("{}")
                    schema = {"type": "string"}
                    if param in PATH_PARAM_PATTERNS:
                        schema["pattern"] = PATH_PARAM_PATTERNS[param]
                    parameters.append(
                        {
                            "name": param,
                            "in": "path",
                            "required": True,
                            "description": PATH_PARAM_DOCS.get(param, param),
                            "schema": schema,
                        }
                    )
            if name == "outputs":
                parameters.extend(copy.deepcopy(SIGNED_URL_PARAMS))
                operation["security"] = [{SECURITY_SCHEME: []}, {}]
            elif name in authenticated:
                operation["security"] = [{SECURITY_SCHEME: []}]
            if not parameters:
                operation.pop("parameters")
            if name in REQUEST_BODIES:
                content_type, model = REQUEST_BODIES[name]
                body: dict[str, Any] = {"schema": _add_schemas(components, model)}
                extra = model.model_config.get("json_schema_extra")
                examples: Any = extra.get("examples") if isinstance(extra, dict) else None
                if isinstance(examples, list) and examples:
                    body["example"] = examples[0]
                operation["requestBody"] = {"required": True, "content": {content_type: body}}
    return document


def docs_router(document: functools.partial[dict[str, Any]] | Any) -> APIRouter:
    """``/openapi.json``, ``/docs`` and its assets; ``document()`` builds the document."""
    router = APIRouter()
    cached: list[dict[str, Any]] = []

    async def openapi_json(request: Request) -> Response:
        if not cached:
            cached.append(document())
        return JSONResponse(cached[0])

    async def swagger(request: Request) -> Response:
        return get_swagger_ui_html(
            openapi_url=OPENAPI_PATH,
            title=f"{TITLE} - Swagger UI",
            swagger_js_url=f"{ASSETS_PATH}/swagger-ui-bundle.js",
            swagger_css_url=f"{ASSETS_PATH}/swagger-ui.css",
            swagger_favicon_url=f"{ASSETS_PATH}/favicon.png",
        )

    async def asset(request: Request) -> Response:
        name = request.path_params["name"]
        if name not in ASSETS:
            return JSONResponse({"error": {"message": "no such asset", "type": "not_found_error"}}, 404)
        media_type = mimetypes.guess_type(name)[0] or "application/octet-stream"
        return FileResponse(
            assets_dir() / name, media_type=media_type, headers={"Cache-Control": "public, max-age=86400"}
        )

    for path, endpoint, name in (
        (OPENAPI_PATH, openapi_json, "openapi"),
        ("/docs", swagger, "swagger_ui"),
        (ASSETS_PATH + "/{name}", asset, "docs_asset"),
    ):
        router.add_api_route(path, endpoint, methods=["GET"], include_in_schema=False, name=name)
    return router
