"""The app on the studio's port while it loads: answers at once, records what it refuses, hands over.

``omni-studio serve`` and ``ui`` bind their port before the model libraries import (seconds); until the
real app is ready, :class:`StartingApp` answers: ``/health`` 503 ``starting``, ``/v1`` 503
``engine_not_ready`` with ``Retry-After`` (OpenAI error bodies), and for the UI a loading page that opens
the studio by itself. Generation requests it refuses become failed runs once the run store is open.

For the UI, the API serves as soon as the engine is loaded (``api``), while Gradio still builds the page:
``/health`` stays 503 ``starting`` (with ``"api": "ready"``) until the whole studio is up, and requests in
flight when the port moves to Gradio finish on the loading server (README, first section).
"""

from __future__ import annotations

import json
from collections import deque
from collections.abc import Awaitable, Callable, MutableMapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from studio.store.recorder import RunRecorder

RETRY_AFTER_S = 2  # what 503s during loading tell clients to wait

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


LOADING_PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>Omni Studio · loading model</title>
<style>body{{font-family:system-ui,sans-serif;margin:12vh auto;max-width:36em;color:#333}}
.spin{{display:inline-block;animation:s 1s linear infinite}}@keyframes s{{to{{transform:rotate(360deg)}}}}
</style></head>
<body><h2 id="omni-header">Omni Studio · loading model {model} <span class="spin">◌</span></h2>
<p id="omni-loading">The engine is starting (importing the model libraries, loading every stage). This
page opens the studio by itself when it is ready; the API answers 503 <code>engine_not_ready</code> with
<code>Retry-After</code> until then.</p>
<p><small id="omni-waited"></small></p>
<script>
const started = Date.now();
async function poll() {{
  try {{
    // /health turns 200 when the whole studio is up; the API may serve a little earlier (see /health's "api").
    const r = await fetch("/health", {{cache: "no-store"}});
    if (r.status === 200) {{ location.reload(); return; }}
  }} catch (e) {{}}
  document.getElementById("omni-waited").textContent =
    "waiting " + Math.round((Date.now() - started) / 1000) + " s";
  setTimeout(poll, 500);
}}
setTimeout(poll, 500);
</script></body></html>
"""


GENERATION_PATHS = ("/v1/chat/completions", "/v1/images/generations", "/v1/images/edits")
REFUSED_KEPT = 10_000  # refused requests remembered while loading (a bound, not a quota)


class StartingApp:
    """The ASGI app on the port from the first second: answers for the studio until ``target`` is set.

    ``target`` (the real app) gets every request once set; 503s it sends then carry ``Retry-After`` too
    (the API answers 503 ``engine_not_ready`` while an engine is being rebuilt).
    """

    def __init__(self, model: str, page: bool, api_key: str | None = None, record: bool = True) -> None:
        self.model = model
        self.page = page  # serve the loading page on "/" (the UI), else JSON only (the API)
        self.target: ASGIApp | None = None
        # The API alone, set once the engine is loaded while the UI still builds: everything but "/" and
        # "/health" goes to it (``ui`` mode; ``serve`` sets ``target`` instead).
        self.api: ASGIApp | None = None
        # Generation requests refused while loading, recorded as runs once the store is open (nothing a
        # client sends is lost). Unauthenticated ones are not: that would let anyone fill the history.
        self.api_key = api_key
        self.record = record
        self.refused: deque[tuple[str, str]] = deque(maxlen=REFUSED_KEPT)

    def _counts(self, scope: Scope) -> bool:
        if not self.record or scope.get("method") != "POST" or scope.get("path") not in GENERATION_PATHS:
            return False
        if self.api_key is None:
            return True
        from studio.api.auth import secrets_equal

        header = dict(scope.get("headers") or []).get(b"authorization", b"").decode("latin-1")
        scheme, _, token = header.partition(" ")
        return scheme.lower() == "bearer" and secrets_equal(token.strip(), self.api_key)

    def record_refused(self, recorder: RunRecorder | None, model_name: str) -> int:
        """Record the generation requests refused so far as failed runs; returns how many."""
        count = 0
        while self.refused and recorder is not None:
            path, excerpt = self.refused.popleft()
            recorder.record_rejected(
                "api",
                {"path": path, "raw_body": excerpt},
                f"503 service_unavailable: the engine was still loading ({model_name}); engine_not_ready",
                model_name,
                None,
                None,
            )
            count += 1
        return count

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":  # the real app is started by whoever builds it
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        target = self.target
        if target is not None:
            await target(scope, receive, _retry_after_on_503(send))
            return
        if scope["type"] != "http":
            await send({"type": "websocket.close", "code": 1013})  # "try again later"
            return
        path = scope.get("path", "/")
        api = self.api
        if path == "/" and self.page:
            body = LOADING_PAGE.format(model=_html_escape(self.model)).encode()
            await _respond(send, 200, body, "text/html; charset=utf-8", {"cache-control": "no-store"})
        elif path == "/health":
            health = {"status": "starting"} if api is None else {"status": "starting", "api": "ready"}
            await _respond(send, 503, json.dumps(health).encode(), retry=True)
        elif api is not None:
            await api(scope, receive, _retry_after_on_503(send))
        else:
            if self._counts(scope):
                self.refused.append((path, await _body_excerpt(receive)))
            error = {
                "error": {
                    "message": f"The engine is not ready (loading {self.model}); retry shortly",
                    "type": "service_unavailable",
                    "param": None,
                    "code": "engine_not_ready",
                }
            }
            await _respond(send, 503, json.dumps(error).encode(), retry=True)


async def _body_excerpt(receive: Receive, keep: int = 2000) -> str:
    """The start of a request body (the rest is read and dropped)."""
    kept = bytearray()
    while True:
        message = await receive()
        if message["type"] != "http.request":
            break
        if len(kept) < keep:
            kept += message.get("body", b"")[: keep - len(kept)]
        if not message.get("more_body"):
            break
    return kept.decode(errors="replace")


def _html_escape(text: str) -> str:
    import html

    return html.escape(text)


async def _respond(
    send: Send,
    status: int,
    body: bytes,
    content_type: str = "application/json",
    headers: dict[str, str] | None = None,
    retry: bool = False,
) -> None:
    raw = [(b"content-type", content_type.encode()), (b"content-length", str(len(body)).encode())]
    if retry:
        raw.append((b"retry-after", str(RETRY_AFTER_S).encode()))
    raw += [(k.encode(), v.encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": body})


def _retry_after_on_503(send: Send) -> Send:
    async def wrapped(message: Message) -> None:
        if message["type"] == "http.response.start" and message.get("status") == 503:
            headers = list(message.get("headers") or [])
            if not any(k.lower() == b"retry-after" for k, _ in headers):
                headers.append((b"retry-after", str(RETRY_AFTER_S).encode()))
                message = {**message, "headers": headers}
        await send(message)

    return wrapped


class RetryAfterOn503:
    """ASGI middleware: every 503 tells the client when to retry (the API's ``engine_not_ready`` too)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self.app(scope, receive, _retry_after_on_503(send) if scope["type"] == "http" else send)
