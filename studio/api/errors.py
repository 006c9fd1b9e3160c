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


_MISSING = object()


def client_path(loc: tuple[Any, ...], data: Any = _MISSING) -> tuple[str, bool]:
    """The client's field path of a pydantic error location, and whether its last element is a union
    branch name pydantic inserted (``str``, ``list[union[TextPart,ImagePart]]``, ``TextPart``): those are
    not fields of the request, so the location is walked over the data the client sent and every element
    that is not a key or index there is left out (a missing or unsupported field, the last element, stays)."""
    out = ""
    node = data
    tag_last = False
    for position, part in enumerate(loc):
        last = position == len(loc) - 1
        tag_last = False
        if isinstance(part, int):
            out += f"[{part}]"
            node = node[part] if isinstance(node, list) and 0 <= part < len(node) else _MISSING
        elif isinstance(node, dict) and part in node:
            out += ("." if out else "") + str(part)
            node = node[part]
        elif data is _MISSING:  # no data to walk: leave out the branch names pydantic uses here
            if part in ("TextPart", "ImagePart", "InputAudioPart", "VoiceID", "str") or "[" in str(part):
                tag_last = True
                continue
            out += ("." if out else "") + str(part)
        elif last and isinstance(node, dict):  # a missing or unsupported field of this object
            out += ("." if out else "") + str(part)
        else:
            tag_last = True  # a union branch name: not something the client sent
    return out, tag_last


def _client_errors(errors: list[Any], data: Any) -> list[Any]:
    """Drop the errors of union branches the client did not mean: a branch whose ``type`` literal does not
    match (an ``image_url`` part checked as a text part), and a type mismatch of a whole branch (``str``)
    where another branch of the same field got further. What is left names the client's real problem."""
    wrong_branches = [
        tuple(e["loc"][:-1]) for e in errors if e["type"] == "literal_error" and e["loc"][-1:] == ("type",)
    ]

    def keep(error: Any) -> bool:
        loc = tuple(error["loc"])
        is_type_error = error["type"] == "literal_error" and loc[-1:] == ("type",)
        if not is_type_error and any(loc[: len(b)] == b for b in wrong_branches):
            return False
        _, tag_last = client_path(loc, data)
        if tag_last and str(error["type"]).endswith("_type"):
            prefix = loc[:-1]
            if any(tuple(o["loc"][: len(prefix)]) == prefix and o is not error for o in errors):
                return False
        return True

    kept = [e for e in errors if keep(e)]
    # A branch whose ``type`` matched has the client's problem: the other branches' ``type`` errors are noise.
    matched = [e for e in kept if not any(tuple(e["loc"][: len(b)]) == b for b in wrong_branches)]
    if matched:
        kept = matched
    return kept or errors


def from_validation_error(exc: ValidationError, data: Any = _MISSING) -> APIError:
    """The first problem of a request body, as a 400 naming the client's field path (``data``, the body
    the client sent, lets union branch names be told from fields)."""
    errors = _client_errors(exc.errors(), data)
    # Prefer "unsupported field" errors: they are the ones a client most needs to hear about.
    errors.sort(key=lambda e: e["type"] != "extra_forbidden")
    first = errors[0]
    param, _ = client_path(tuple(first["loc"]), data)
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
