"""The OpenAI-compatible HTTP API: protocol models, serving handlers per endpoint family, a thin router."""

from studio.api.app import ServingOptions, ServingState, create_api_router, create_app
from studio.api.fingerprint import FingerprintError, FingerprintSettings, system_fingerprint

__all__ = [
    "FingerprintError",
    "FingerprintSettings",
    "ServingOptions",
    "ServingState",
    "create_api_router",
    "create_app",
    "system_fingerprint",
]
