"""A byte budget for refused requests per client: one client's flood of refused bodies cannot starve others.

A request refused before the engine (a 1 MB prompt past ``--max-prompt-chars``, invalid JSON, an unknown
field...) still costs the server its body: receiving, parsing, checking, recording. A client that sends
such bodies back to back, without even waiting for the answers, would keep the event loop and the run
store busy and slow every other client. So each client (its address and API key, as for
``--max-in-flight-per-client``) may have at most ``rate`` bytes per second of refused bodies (a token
bucket holding up to ``burst`` bytes). Past it, its generation requests get 429 with ``Retry-After`` at
once, before their bodies are read; like the failed-login limiter's 429s, these are not recorded as runs
(they never reach a handler). Well-formed requests cost nothing from the budget (README, "The API").
"""

from __future__ import annotations

import hashlib
import json
import math
import threading
import time
from collections import OrderedDict
from typing import Any

from studio.api.auth import client_address
from studio.starting import GENERATION_PATHS, ASGIApp, Message, Receive, Scope, Send

MiB = 1024 * 1024
REFUSED_BYTES_PER_S = 4 * MiB
REFUSED_BYTES_BURST = 16 * MiB
CLIENTS_KEPT = 10_000  # buckets remembered (least recently used dropped first)
# Refusals that spend the budget: the client's own fault, about what it sent. Not 401 (the login limiter
# has its own), 429 or 503 (the server's state, not the client's).
CHARGED_STATUSES = frozenset({400, 404, 405, 413, 415, 422})


def client_key(scope: Scope) -> str:
    """The client a request counts against: its address and the bearer key it sends (hashed)."""
    headers = dict(scope.get("headers") or [])
    scheme, _, token = headers.get(b"authorization", b"").decode("latin-1").partition(" ")
    key = token.strip() if scheme.lower() == "bearer" else ""
    digest = hashlib.sha256(key.encode()).hexdigest()[:16] if key else "-"
    return f"{client_address(scope)}|{digest}"


class RefusalBudget:
    """Token buckets of refused-body bytes, one per client."""

    def __init__(self, rate: float = REFUSED_BYTES_PER_S, burst: float = REFUSED_BYTES_BURST) -> None:
        self.rate = rate
        self.burst = burst
        self._lock = threading.Lock()
        self._buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()  # client -> (bytes, at)

    def _level(self, client: str, now: float) -> float:
        level, at = self._buckets.get(client, (self.burst, now))
        return min(self.burst, level + (now - at) * self.rate)

    def retry_after(self, client: str) -> int:
        """0 when the client may send; else seconds until its budget is positive again."""
        with self._lock:
            level = self._level(client, time.monotonic())
        return 0 if level > 0 else max(1, math.ceil(-level / self.rate))

    def charge(self, client: str, size: int) -> None:
        """Spend ``size`` bytes of a refused body (the level may go below zero: a debt to wait off)."""
        now = time.monotonic()
        with self._lock:
            self._buckets[client] = (self._level(client, now) - size, now)
            self._buckets.move_to_end(client)
            while len(self._buckets) > CLIENTS_KEPT:
                self._buckets.popitem(last=False)


class RefusalThrottle:
    """ASGI middleware applying a :class:`RefusalBudget` to the generation routes."""

    def __init__(self, app: ASGIApp, budget: RefusalBudget) -> None:
        self.app = app
        self.budget = budget

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (
            scope["type"] != "http"
            or scope.get("method") != "POST"
            or scope.get("path") not in GENERATION_PATHS
        ):
            await self.app(scope, receive, send)
            return
        client = client_key(scope)
        wait = self.budget.retry_after(client)
        if wait:
            await _too_many_refused(send, wait)
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
            if status in CHARGED_STATUSES:
                self.budget.charge(client, received)


async def _too_many_refused(send: Send, retry_after: int) -> None:
    error: dict[str, Any] = {
        "error": {
            "message": "Too many refused requests from this client (their bodies were too large or invalid); "
            f"retry in {retry_after} s",
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
        (b"connection", b"close"),  # the body was not read: the connection cannot carry another request
    ]
    await send({"type": "http.response.start", "status": 429, "headers": headers})
    await send({"type": "http.response.body", "body": body})
