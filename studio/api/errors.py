"""OpenAI error bodies: ``{"error": {"message", "type", "param", "code"}}`` with the right HTTP status."""

from __future__ import annotations

from typing import Any

from fastapi.responses import JSONResponse
from pydantic import ValidationError

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable",
}


class APIError(Exception):
    """An error the API reports to the client; the server carries on."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.run_id: str | None = None  # set once the failure is recorded as a run
        self.retry_after: int | None = None  # seconds, sent as ``Retry-After`` (429s)

    @property
    def type(self) -> str:
        return ERROR_TYPES.get(self.status, "server_error")

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer"} if self.status == 401 else {}
        if self.run_id:
            headers["X-Run-Id"] = self.run_id
        if self.retry_after is not None:
            headers["Retry-After"] = str(self.retry_after)
        return JSONResponse(self.body(), status_code=self.status, headers=headers or None)


def _param(loc: tuple[Any, ...]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part in ("TextPart", "ImagePart") or "[" in str(part):
            continue  # union branch names pydantic inserts into locations
        else:
            out += ("." if out else "") + str(part)
    return out


def from_validation_error(exc: ValidationError) -> APIError:
    """The first problem of a request body, as a 400 naming the field."""
    errors = exc.errors()
    # Prefer "unsupported field" errors: they are the ones a client most needs to hear about.
    errors.sort(key=lambda e: e["type"] != "extra_forbidden")
    first = errors[0]
    param = _param(first["loc"])
    if first["type"] == "extra_forbidden":
        message = (
            f"Unsupported field '{param}': this server does not implement it (remove it from the request)"
        )
    else:
        message = f"Invalid value for '{param}': {first['msg']}" if param else first["msg"]
        if first["type"] == "value_error":
            message = f"Invalid value for '{param}': {str(first['msg']).removeprefix('Value error, ')}"
    if len(errors) > 1:
        message += f" (and {len(errors) - 1} more problem(s))"
    return APIError(400, message, param=param or None, code=first["type"])
