"""Omni Studio's engine: validated multi-stage pipelines (AR -> diffusion) that stream typed events.

No UI, HTTP or database code lives here; ``studio`` builds on this package, never the reverse. Names are
imported on first use, so ``engine.config`` (validation) loads without torch and the model libraries.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "engine.engine": (
        "EngineBuildError",
        "EngineBusy",
        "EngineClosed",
        "OmniEngine",
        "build_engine",
        "build_pipeline_config",
        "device_problems",
    ),
    "engine.events": (
        "DiffusionStep",
        "EngineEvent",
        "RunFailed",
        "RunFinished",
        "RunOutput",
        "StageFinished",
        "StageStarted",
        "TextDelta",
        "TokenProgress",
    ),
    "engine.modality": ("OutputModality", "parse_output_modalities"),
    "engine.request": (
        "ChatTurn",
        "GenerationParams",
        "GenerationRequest",
        "RequestError",
        "ResolvedRequest",
    ),
}
_WHERE = {name: module for module, names in _EXPORTS.items() for name in names}
__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
