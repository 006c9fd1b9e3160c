"""The OpenAI-compatible HTTP API: protocol models, serving handlers per endpoint family, a thin router.

Names are imported on first use (as in ``engine``): ``studio.api.fingerprint`` checks the CLI's flags
before anything loads, without pulling in the serving modules, the engine and torch (seconds).
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "studio.api.app": ("create_api_router", "create_app"),
    "studio.api.fingerprint": ("FingerprintError", "FingerprintSettings", "system_fingerprint"),
    "studio.api.state": ("ServingOptions", "ServingState"),
}
_WHERE = {name: module for module, names in _EXPORTS.items() for name in names}
__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'studio.api' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
