"""Prometheus metrics for ``GET /metrics``: requests, latency, per-stage time, queue depth and each
waiting request's place in its stage's queue; spoken replies' TTFP, RTF and underruns
(``studio/api/speech_metrics.py``); and the process's own (CPU, memory, garbage collection).

Who may read them (:func:`metrics_reader`): everyone while nothing is protected; once an API key, accounts
or a UI login is set, the ``--api-key``, any account's own key, or a UI login. The figures are the
studio's, for everyone alike, except the per-request queue positions: a user's key sees only their own
requests there (docs/team.md)."""

from __future__ import annotations

import gc
from collections.abc import Callable
from typing import Any

from fastapi import Request
from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    GCCollector,
    Histogram,
    ProcessCollector,
    generate_latest,
)

from engine.events import StageFinished
from studio.accounts.identity import NOBODY
from studio.api.auth import ui_login_configured, ui_session_user
from studio.api.authentication import accounts_on, authenticate
from studio.api.errors import APIError
from studio.api.speech_metrics import SpeechMeter

LATENCY_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class APIMetrics:
    """One registry per app, so several apps (tests) in one process do not collide."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        # process_* (CPU seconds, resident memory, open files) and python_gc_* (collections per
        # generation: the collector is off during start-up and back on after, engine/environment.py)
        ProcessCollector(registry=self.registry)
        GCCollector(registry=self.registry)
        Gauge(
            "omni_studio_gc_frozen_objects",
            "Objects the start-up moved out of the garbage collector's reach (0 while starting)",
            registry=self.registry,
        ).set_function(gc.get_freeze_count)
        self.requests = Counter(
            "omni_studio_requests",
            "HTTP requests by endpoint and status code",
            ["endpoint", "status"],
            registry=self.registry,
        )
        self.latency = Histogram(
            "omni_studio_request_latency_seconds",
            "End-to-end request latency",
            ["endpoint"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.stage_seconds = Histogram(
            "omni_studio_stage_seconds",
            "Time spent in each stage per request",
            ["stage", "kind"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.queue_depth = Gauge(
            "omni_studio_queue_depth", "Jobs queued or running per stage", ["stage"], registry=self.registry
        )
        self.in_flight = Gauge(
            "omni_studio_requests_in_flight", "Requests inside the engine", registry=self.registry
        )

        self.queue_waiting = Gauge(
            "omni_studio_queue_waiting",
            "Jobs waiting (not yet running) per stage",
            ["stage"],
            registry=self.registry,
        )
        self.queue_position = Gauge(
            "omni_studio_request_queue_position",
            "Jobs ahead of each waiting request at its stage (running there plus queued before it)",
            ["request_id", "stage"],
            registry=self.registry,
        )
        self.speech = SpeechMeter(self.registry)  # TTFP, RTF, underruns of spoken replies
        self.decode_path = Gauge(
            "omni_studio_decode_path",
            "How each AR stage's decode batches on this machine (1 for the path in use; docs/batching.md)",
            ["stage", "path"],
            registry=self.registry,
        )

    def observe_stage(self, event: StageFinished) -> None:
        if event.status == "succeeded":
            self.stage_seconds.labels(str(event.stage_id), event.kind).observe(event.seconds)

    def render(
        self,
        queue_depths: dict[int, int],
        in_flight: int,
        waiting: dict[int, int] | None = None,
        positions: dict[str, dict[int, int]] | None = None,
        decode_paths: dict[int, str] | None = None,
    ) -> bytes:
        for stage, depth in queue_depths.items():
            self.queue_depth.labels(str(stage)).set(depth)
        self.in_flight.set(in_flight)
        for stage, depth in (waiting or {}).items():
            self.queue_waiting.labels(str(stage)).set(depth)
        self.queue_position.clear()  # only the requests waiting now
        for request_id, stages in (positions or {}).items():
            for stage, ahead in stages.items():
                self.queue_position.labels(request_id, str(stage)).set(ahead)
        self.decode_path.clear()  # the path can change (checks run at the first decode step; Apply)
        for stage, path in (decode_paths or {}).items():
            self.decode_path.labels(str(stage), path).set(1)
        return generate_latest(self.registry)


async def metrics_reader(state: Any, request: Request) -> str | None:
    """Check that ``request`` may read ``GET /metrics`` (401 otherwise); returns the owner (``user:NAME``)
    whose requests alone are listed per request (``None``: every request's).

    Open while nothing is protected. Once an ``--api-key``, accounts or a UI login is set (always with
    ``--share``): the ``--api-key`` or, with accounts, any account's own key, or a UI login session
    (Gradio's own cookie check). A user sees the studio's figures as the admin does, read-only and
    aggregate; only the per-request queue positions are narrowed to their own requests (docs/team.md).
    """
    team = accounts_on(state)
    keyed = bool(state.options.api_key) or team
    if not keyed and not ui_login_configured(request):
        return None
    if keyed and request.headers.get("authorization"):
        identity = authenticate(state, request)  # 401 for a wrong or revoked key, 429 when throttled
        return None if identity is None or identity.sees_all else (identity.owner or f"user:{NOBODY}")
    user = await ui_session_user(request)
    if user is None:
        raise APIError(
            401,
            "The metrics need an API key ('Authorization: Bearer <key>') or a UI login",
            None,
            "missing_api_key",
        )
    if not team:
        return None
    account = state.accounts.user(user)
    if account is None:  # an account removed since it logged in (or the --auth login: it has --api-key)
        return f"user:{NOBODY}"
    return None if account.admin else f"user:{account.name}"


def own_positions(
    positions: dict[str, dict[int, int]], owner_of: Callable[[str], str | None], owner: str | None
) -> dict[str, dict[int, int]]:
    """The queue positions of ``owner``'s requests only (``None``: all of them)."""
    if owner is None:
        return positions
    return {request_id: stages for request_id, stages in positions.items() if owner_of(request_id) == owner}
