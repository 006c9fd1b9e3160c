"""The serving state: the engine the API serves, its options, and the handlers built over it.

The fingerprint mode is applied in :meth:`ServingState.build_handlers` *before* any handler is built, on
every construction path (multi-stage, AR-only, diffusion-only: they differ only in the engine), and the
handlers cache it. The UI changes the mode with :meth:`ServingState.set_fingerprint`, which rebuilds the
handlers, so the next response carries the new value. The router over it is ``studio/api/app.py``.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

from fastapi import Request

from engine import OmniEngine
from engine.events import EngineEvent, StageFinished
from studio.api.authentication import accounts_on, authenticate
from studio.api.errors import APIError
from studio.api.fingerprint import FingerprintSettings, system_fingerprint
from studio.api.metrics import APIMetrics
from studio.api.protocol import ImageReply
from studio.api.refusals import RefusalRate
from studio.api.serving_base import ServingContext
from studio.api.serving_chat import OpenAIServingChat
from studio.api.serving_images import OpenAIServingImages
from studio.api.serving_models import OpenAIServingModels
from studio.api.serving_speech import OpenAIServingSpeech
from studio.api.signing import DEFAULT_TTL_S, URLSigner, load_secret
from studio.runs.inflight import RequestBoard
from studio.runs.service import ClientSlots, Recording, RunService
from studio.startup.limits import InputLimits
from studio.store.files import OutputFiles

if TYPE_CHECKING:
    from studio.accounts.service import Accounts
    from studio.jobs.service import JobService

__all__ = ["Handlers", "ServingOptions", "ServingState"]


@dataclass(frozen=True)
class ServingOptions:
    served_model_name: str | None = None
    api_key: str | None = None
    fingerprint: FingerprintSettings = field(default_factory=FingerprintSettings)
    limits: InputLimits = field(default_factory=InputLimits)
    data_dir: Path | None = None
    image_reply: ImageReply = "content"  # chat images: list content (default) or message.images
    output_url_ttl: int = DEFAULT_TTL_S  # lifetime of signed /v1/outputs URLs (with an API key set)


@dataclass(frozen=True)
class Handlers:
    chat: OpenAIServingChat
    images: OpenAIServingImages
    models: OpenAIServingModels
    system_fingerprint: str | None
    speech: OpenAIServingSpeech


class ServingState:
    """The engine the API serves and the handlers built over it."""

    def __init__(
        self,
        engine: OmniEngine | None,
        options: ServingOptions | None = None,
        recorder: Recording | None = None,
        metrics: APIMetrics | None = None,
        source: str = "api",
    ) -> None:
        self.options = options or ServingOptions()
        self.recorder = recorder
        self.metrics = metrics or APIMetrics()
        self.source = source
        self.engine: OmniEngine | None = None
        self.handlers: Handlers | None = None
        self._lock = threading.Lock()
        self._signer: URLSigner | None = None
        # Per-client in-flight counts outlive handler rebuilds (fingerprint changes, engine swaps).
        self.client_slots = ClientSlots(self.options.limits.client_share)
        self.refusals = RefusalRate()  # refusals per client (studio/api/refusals.py)
        self.board = RequestBoard()  # requests in the engine, for the Queue panel (studio/runs/inflight.py)
        self.jobs: JobService | None = None  # batch jobs (studio/jobs/service.py), set once the store is open
        self.accounts: Accounts | None = None  # team accounts (docs/team.md), set once the store is open
        # --share with accounts: /v1 needs an account's key (or --api-key) even after the last account goes
        self.accounts_required = False
        if engine is not None:
            self.set_engine(engine)

    @property
    def served_model_name(self) -> str:
        if self.options.served_model_name:
            return self.options.served_model_name
        return self.engine.model.name if self.engine else "unknown"

    @property
    def files(self) -> OutputFiles | None:
        """The run store's output files (``None`` without a data dir: ``url`` responses are refused)."""
        store = getattr(self.recorder, "store", None)
        if store is not None:
            return store.files
        return OutputFiles.in_data_dir(self.options.data_dir) if self.options.data_dir else None

    @property
    def signer(self) -> URLSigner:
        """Signs ``/v1/outputs`` URLs with the data dir's secret (studio/api/signing.py)."""
        if self._signer is None:
            self._signer = URLSigner(load_secret(self.options.data_dir))
        return self._signer

    def output_url(self, base: str, sha: str) -> str:
        """The URL of an output file: signed (``?exp=...&sig=...``) when an API key is set."""
        name = f"{sha}.png"
        url = f"{base}/v1/outputs/{name}"
        if self.options.api_key or accounts_on(self):
            url += "?" + self.signer.query(name, self.options.output_url_ttl)
        return url

    def run_service(self) -> RunService:
        """The run path of API requests: recorded under this state's source, stage timings in the metrics."""
        metrics = self.metrics
        model = self.served_model_name  # handlers (and this) are rebuilt when the model changes

        def observe(event: EngineEvent) -> None:
            if isinstance(event, StageFinished):
                metrics.observe_stage(event)
            metrics.speech.observe(model, event)

        return RunService(
            self.recorder,
            self.source,
            self.files,
            on_event=observe,
            limits=self.options.limits,
            slots=self.client_slots,
            board=self.board,
        )

    def build_handlers(self) -> Handlers:
        """Apply the fingerprint mode, then build every handler over it (they cache what they read)."""
        with self._lock:
            engine = self.engine
            if engine is None:
                self.handlers = None
                raise APIError(503, "no engine is loaded", None, "engine_not_ready")
            fingerprint = system_fingerprint(self.options.fingerprint, engine.config)
            context = ServingContext(
                engine=engine,
                served_model_name=self.served_model_name,
                system_fingerprint=fingerprint,
                metrics=self.metrics,
                limits=self.options.limits,
                runs=self.run_service(),
                image_reply=self.options.image_reply,
                output_url=self.output_url,
            )
            self.handlers = Handlers(
                OpenAIServingChat(context),
                OpenAIServingImages(context),
                OpenAIServingModels(context),
                fingerprint,
                OpenAIServingSpeech(context),
            )
            return self.handlers

    def set_engine(self, engine: OmniEngine | None) -> None:
        """Serve ``engine`` (``None`` while a new one is being built: requests get 503); its queue bound
        is ``--max-queue``."""
        if engine is not None:
            engine.max_pending = self.options.limits.max_queue
        self.engine = engine
        if engine is None:
            self.handlers = None
        else:
            self.build_handlers()

    def set_fingerprint(self, mode: str, value: str | None = None) -> str | None:
        """Change the fingerprint mode (raises ``FingerprintError``); returns the new fingerprint."""
        settings = FingerprintSettings(mode, value or None)
        self.options = replace(self.options, fingerprint=settings)
        return self.build_handlers().system_fingerprint

    def set_api_key(self, key: str | None) -> None:
        self.options = replace(self.options, api_key=key or None)

    def require_handlers(self) -> Handlers:
        handlers = self.handlers
        if handlers is None:
            raise APIError(
                503,
                "The engine is not ready (starting or being rebuilt); retry shortly",
                None,
                "engine_not_ready",
            )
        return handlers

    def check_api_key(self, request: Request) -> None:
        """401 without the right key (when one is set, or the studio has accounts: a user's own key);
        429 for a wrong key that failed too often from this address. Failures count per (address,
        presented key), so the right key always works at once (studio/api/authentication.py, README
        "The API", docs/team.md)."""
        authenticate(self, request)
