"""Refused requests throttled only at sustained abusive rates: honest mistakes never cost the next request.

A request refused before the engine (a 1 MB prompt past ``--max-prompt-chars``, invalid JSON, an unknown
field...) still costs the server its body: receiving, parsing, checking, recording. A client that sends
such requests back to back without pause would keep the event loop and the run store busy and slow every
other client. An honest client makes mistakes one at a time, reads the answer and fixes the request. So
a client (its address and API key, :func:`client_key`) is throttled only while, over the last
:data:`WINDOW_S` seconds, it had more than :data:`MAX_REFUSALS` refusals (20 a second, sustained) or more
than :data:`MAX_REFUSED_BYTES` of refused bodies; its generation requests then get 429 ``too_many_refused``
with ``Retry-After`` and a message saying why, and the throttle ends as soon as the rate falls back (a
throttled request counts as a refusal: a client that keeps flooding stays throttled; one that pauses is
served again within :data:`WINDOW_S` seconds). Not counted: well-formed requests, 401/429/503 (the server's state or
the login limiter's business, studio/api/auth.py) and 413s (a body refused by its size is not read past a
bound: it costs the server little, and an honest client that uploads one too big an image must learn why
from the 413, not from a throttle). A throttled answer reads and discards up to :data:`READ_BEFORE_ANSWER`
of the body first, so a client sending an ordinary request gets the 429 rather than a reset connection;
a bigger body from a throttled (abusive) client is answered before it is read, and the connection closed:
reading megabytes for a client already flooding would hand it the CPU the throttle is there to protect
(README, "The API").
"""

from __future__ import annotations

import hashlib
import json
import math
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from typing import Any

from studio.api.auth import client_address
from studio.startup.starting import GENERATION_PATHS, ASGIApp, Message, Receive, Scope, Send

MiB = 1024 * 1024
WINDOW_S = 5.0
MAX_REFUSALS = 100  # in WINDOW_S: 20 a second, sustained
MAX_REFUSED_BYTES = 100 * MiB  # in WINDOW_S: 20 MiB a second of bodies read and refused
READ_BEFORE_ANSWER = 64 * 1024  # a throttled request's body read (and dropped) before its 429
CLIENTS_KEPT = 10_000  # clients remembered (least recently used dropped first)
# Refusals that count: the client's own fault, about what it sent (see the module's docstring for 413).
COUNTED_STATUSES = frozenset({400, 404, 405, 415, 422})


def client_key(scope: Scope) -> str:
    """The client a request counts against: its address and the bearer key it sends (hashed)."""
    headers = dict(scope.get("headers") or [])
    scheme, _, token = headers.get(b"authorization", b"").decode("latin-1").partition(" ")
    key = token.strip() if scheme.lower() == "bearer" else ""
    digest = hashlib.sha256(key.encode()).hexdigest()[:16] if key else "-"
    return f"{client_address(scope)}|{digest}"


class RefusalRate:
    """Each client's refusals (time and body size) over the last :data:`WINDOW_S` seconds."""

    def __init__(
        self,
        max_refusals: int = MAX_REFUSALS,
        max_bytes: int = MAX_REFUSED_BYTES,
        window_s: float = WINDOW_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.max_refusals = max_refusals
        self.max_bytes = max_bytes
        self.window_s = window_s
        self.clock = clock
        self._lock = threading.Lock()
        self._clients: OrderedDict[str, deque[tuple[float, int]]] = OrderedDict()

    def _recent(self, client: str, now: float) -> deque[tuple[float, int]]:
        seen = self._clients.get(client)
        if seen is None:
            return deque()
        while seen and seen[0][0] <= now - self.window_s:
            seen.popleft()
        return seen

    def retry_after(self, client: str) -> int:
        """0 when the client is not throttled; else seconds until its rate is back under the limits."""
        with self._lock:
            now = self.clock()
            seen = self._recent(client, now)
            over = len(seen) - self.max_refusals
            total = sum(size for _, size in seen)
            if over <= 0 and total <= self.max_bytes:
                return 0
            # The time at which enough of the oldest refusals have left the window.
            until = now
            for at, size in seen:
                over, total = over - 1, total - size
                until = at + self.window_s
                if over <= 0 and total <= self.max_bytes:
                    break
            return max(1, math.ceil(until - now))

    def record(self, client: str, size: int) -> None:
        """One refusal of a ``size``-byte body."""
        with self._lock:
            now = self.clock()
            seen = self._recent(client, now)
            seen.append((now, size))
            if len(seen) > 2 * self.max_refusals:  # the window never needs more to decide
                seen.popleft()
            self._clients[client] = seen
            self._clients.move_to_end(client)
            while len(self._clients) > CLIENTS_KEPT:
                self._clients.popitem(last=False)


class RefusalThrottle:
    """ASGI middleware applying a :class:`RefusalRate` to the generation routes."""

    def __init__(self, app: ASGIApp, rate: RefusalRate) -> None:
        self.app = app
        self.rate = rate

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (
            scope["type"] != "http"
            or scope.get("method") != "POST"
            or scope.get("path") not in GENERATION_PATHS
        ):
            await self.app(scope, receive, send)
            return
        client = client_key(scope)
        wait = self.rate.retry_after(client)
        if wait:
            self.rate.record(client, 0)  # a throttled request is a refusal too: a client still flooding
            await _too_many_refused(receive, send, wait)  # stays throttled until it slows down
            return
        received = 0
        status = 0

        async def counting_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
            return message

        async def status_send(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            await send(message)

        try:
            await self.app(scope, counting_receive, status_send)
        finally:
            if status in COUNTED_STATUSES:
                self.rate.record(client, received)


async def _too_many_refused(receive: Receive, send: Send, retry_after: int) -> None:
    """429 with ``Retry-After``, after reading (and dropping) up to READ_BEFORE_ANSWER of the body: a
    client still sending would otherwise see a reset connection instead of the answer."""
    read, more = 0, True
    while more and read <= READ_BEFORE_ANSWER:
        message = await receive()
        if message["type"] != "http.request":
            break
        read += len(message.get("body", b""))
        more = bool(message.get("more_body"))
    error: dict[str, Any] = {
        "error": {
            "message": f"Too many refused requests from this client: more than {MAX_REFUSALS} in "
            f"{WINDOW_S:g} s or {MAX_REFUSED_BYTES // MiB} MiB of refused bodies (invalid or over a limit; "
            f"each answer named the field). Retry in {retry_after} s.",
            "type": "rate_limit_error",
            "param": None,
            "code": "too_many_refused",
        }
    }
    body = json.dumps(error).encode()
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        (b"retry-after", str(retry_after).encode()),
    ]
    if more:  # the rest of the body was not read: the connection cannot carry another request
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": 429, "headers": headers})
    await send({"type": "http.response.body", "body": body})
