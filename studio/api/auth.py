"""Who may use the studio: constant-time secret checks, a limit on failed logins, the UI login session.

- :func:`secrets_equal` compares an API key or password without leaking, through timing, how much of it
  was right.
- :class:`FailedLoginLimiter`: 5 failures of one presented credential (an API key, a UI login's user and
  password) within a minute from one client address block that pair (429 with ``Retry-After``) for a
  minute, twice as long each time it is blocked again (up to an hour). The pair, not the address: behind
  a reverse proxy or the share tunnel every user arrives from one address, and a stranger's wrong keys
  must not lock out the right one, which works at once whatever others sent (:func:`credential_client`).
  One limiter per serving state (:func:`limiter_for`) counts both the ``/v1`` keys and the UI's
  ``/login``.
- :func:`ui_session_user` asks Gradio's own login check (its ``/user`` route) who the request's login
  cookie belongs to, so ``/metrics`` can accept a UI session as well as the API key.
- :func:`guard_gradio_login` wraps Gradio's ``POST /login`` so its failures are counted and a blocked
  address is refused before Gradio checks the password.

The client address is the TCP peer's, or what ``X-Forwarded-For`` says when the peer is a proxy named by
``--forwarded-allow-ips`` (uvicorn's meaning and default: 127.0.0.1; anyone else's header is ignored). A guess of
another credential is a new pair, so the limiter slows repeating one wrong key or password (a typo, a
stale key in a script), not a search through many: that is what the keys' length is for (generated keys
and share logins are random, 128 bits and more).
"""

from __future__ import annotations

import hashlib
import hmac
import inspect
import math
import threading
import time
import weakref
from collections import OrderedDict, deque
from collections.abc import Callable
from typing import Any
from urllib.parse import parse_qs

from fastapi import Request
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from studio.api.errors import APIError

MAX_FAILURES = 5
WINDOW_S = 60.0
BLOCK_S = 60.0
MAX_BLOCK_S = 3600.0  # repeated blocks of one pair double up to this
MAX_CLIENTS = 10_000  # addresses tracked at once (memory bound); the oldest are forgotten first


def secrets_equal(given: str, expected: str) -> bool:
    """``given == expected`` in time independent of where they differ."""
    return hmac.compare_digest(given.encode(), expected.encode())


class _Client:
    __slots__ = ("failures", "blocked_until", "blocks")

    def __init__(self, max_failures: int) -> None:
        self.failures: deque[float] = deque(maxlen=max_failures)
        self.blocked_until = 0.0
        self.blocks = 0  # how often this pair has been blocked: each block lasts twice the last


class FailedLoginLimiter:
    """Failed authentications per client (an address and a presented credential:
    :func:`credential_client`); thread-safe, bounded memory, injectable clock."""

    def __init__(
        self,
        max_failures: int = MAX_FAILURES,
        window_s: float = WINDOW_S,
        block_s: float = BLOCK_S,
        max_clients: int = MAX_CLIENTS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.max_failures = max_failures
        self.window_s = window_s
        self.block_s = block_s
        self.max_clients = max_clients
        self.clock = clock
        self._clients: OrderedDict[str, _Client] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        with self._lock:
            return len(self._clients)

    def retry_after(self, client: str) -> int | None:
        """Seconds (rounded up) until ``client`` may try again; ``None`` when it is not blocked."""
        with self._lock:
            entry = self._clients.get(client)
            if entry is None:
                return None
            left = entry.blocked_until - self.clock()
            return math.ceil(left) if left > 0 else None

    def record_failure(self, client: str) -> int | None:
        """Count one failed authentication; the block's length in seconds when this one starts it."""
        with self._lock:
            now = self.clock()
            entry = self._clients.pop(client, None)
            if entry is None:
                self._make_room(now)
                entry = _Client(self.max_failures)
            self._clients[client] = entry  # most recently seen last
            if entry.blocked_until > now:
                return None  # already blocked (requests are refused before they get here)
            while entry.failures and entry.failures[0] <= now - self.window_s:
                entry.failures.popleft()
            entry.failures.append(now)
            if len(entry.failures) < self.max_failures:
                return None
            entry.failures.clear()
            block = min(MAX_BLOCK_S, self.block_s * 2**entry.blocks)
            entry.blocks += 1
            entry.blocked_until = now + block
            return math.ceil(block)

    def _make_room(self, now: float) -> None:
        if len(self._clients) < self.max_clients:
            return
        for name in [n for n, e in self._clients.items() if not self._active(e, now)]:
            del self._clients[name]
        while len(self._clients) >= self.max_clients:
            self._clients.popitem(last=False)

    def _active(self, entry: _Client, now: float) -> bool:
        return entry.blocked_until > now or bool(entry.failures and entry.failures[-1] > now - self.window_s)


_LIMITERS: weakref.WeakKeyDictionary[object, FailedLoginLimiter] = weakref.WeakKeyDictionary()
_LIMITERS_LOCK = threading.Lock()


def limiter_for(owner: object) -> FailedLoginLimiter:
    """The limiter of one serving state (the API's and the UI login's failures count together)."""
    with _LIMITERS_LOCK:
        limiter = _LIMITERS.get(owner)
        if limiter is None:
            limiter = _LIMITERS[owner] = FailedLoginLimiter()
        return limiter


def client_address(scope: Scope) -> str:
    """The TCP peer's address of a request (``request.scope``)."""
    client = scope.get("client")
    return str(client[0]) if client else "unknown"


def credential_client(scope: Scope, credential: str) -> str:
    """What the failed-login limiter counts: the request's address and the credential it presented
    (hashed: the limiter never holds a key or password)."""
    digest = hashlib.sha256(credential.encode(errors="replace")).hexdigest()[:16]
    return f"{client_address(scope)}|{digest}"


class TooManyFailures(APIError):
    """429 for a blocked (address, credential) pair, with ``Retry-After``; never recorded as a run."""

    def __init__(self, retry_after: int) -> None:
        super().__init__(
            429,
            f"This key failed too often from this address; retry in {retry_after} s (other keys, the "
            "right one included, are not affected)",
            None,
            "too_many_failed_logins",
        )
        self.retry_after = retry_after
        # Not None: the router records refused generation requests whose run_id is None, and traffic
        # that never authenticated must not fill the history (falsy, so no X-Run-Id header either).
        self.run_id = ""

    def response(self) -> JSONResponse:
        response = super().response()
        response.headers["Retry-After"] = str(self.retry_after)
        return response


def ui_login_configured(request: Request) -> bool:
    """Whether the app serving ``request`` is a Gradio app with a login (``--auth`` / ``--share``)."""
    app = request.app
    return getattr(app, "auth", None) is not None or getattr(app, "auth_dependency", None) is not None


async def ui_session_user(request: Request) -> str | None:
    """The UI user logged in with this request's cookie, by Gradio's own check; ``None`` when none."""
    for route in getattr(request.app, "routes", []):
        endpoint = getattr(route, "endpoint", None)
        if getattr(route, "path", "").endswith("/user") and getattr(endpoint, "__name__", "") == (
            "get_current_user"
        ):
            assert endpoint is not None
            user = endpoint(request)
            if inspect.isawaitable(user):
                user = await user
            return str(user) if user is not None else None
    return None


class _LoginGuard:
    """Gradio's ``POST /login`` behind the limiter: a blocked (address, user and password) pair gets 429,
    400s are counted against the pair."""

    def __init__(self, app: ASGIApp, limiter: FailedLoginLimiter) -> None:
        self.app = app
        self.limiter = limiter

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        messages: list[Message] = []  # the form, read here to name the pair, then handed on unchanged
        while True:
            message = await receive()
            messages.append(message)
            if message["type"] != "http.request" or not message.get("more_body"):
                break
        body = b"".join(m.get("body", b"") for m in messages if m["type"] == "http.request")
        form = parse_qs(body.decode("latin-1"))
        user, password = (form.get(name, [""])[0] for name in ("username", "password"))
        client = credential_client(scope, f"{user}\0{password}")
        replay = iter(messages)

        async def replayed() -> Message:
            return next(replay, None) or await receive()

        wait = self.limiter.retry_after(client)
        if wait is not None:
            response = JSONResponse(
                {"detail": f"This login failed too often from this address; retry in {wait} s"},
                status_code=429,
                headers={"Retry-After": str(wait)},
            )
            await response(scope, receive, send)
            return

        async def watch(message: Message) -> None:
            if message["type"] == "http.response.start" and message["status"] == 400:
                self.limiter.record_failure(client)  # Gradio's "Incorrect credentials."
            await send(message)

        try:
            await self.app(scope, replayed, watch)
        except HTTPException as exc:  # raised past the route when no handler answers inside it
            if exc.status_code == 400:
                self.limiter.record_failure(client)
            raise


def guard_gradio_login(app: Any, limiter: FailedLoginLimiter) -> int:
    """Put Gradio's ``POST /login`` routes of ``app`` behind ``limiter``; returns how many were wrapped."""
    wrapped = 0
    for route in app.router.routes:
        if (
            getattr(route, "path", None) in ("/login", "/login/")
            and "POST" in (getattr(route, "methods", None) or ())
            and not isinstance(route.app, _LoginGuard)
        ):
            route.app = _LoginGuard(route.app, limiter)
            wrapped += 1
    return wrapped
