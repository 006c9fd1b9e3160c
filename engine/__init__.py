"""Omni Studio's engine: validated multi-stage pipelines (AR -> diffusion) that stream typed events.

No UI, HTTP or database code lives here; ``studio`` builds on this package, never the reverse.
"""

from engine.engine import (
    EngineBuildError,
    EngineBusy,
    EngineClosed,
    OmniEngine,
    build_engine,
    build_pipeline_config,
    device_problems,
)
from engine.events import (
    DiffusionStep,
    EngineEvent,
    RunFailed,
    RunFinished,
    RunOutput,
    StageFinished,
    StageStarted,
    TextDelta,
    TokenProgress,
)
from engine.modality import OutputModality, parse_output_modalities
from engine.request import ChatTurn, GenerationParams, GenerationRequest, RequestError, ResolvedRequest

__version__ = "0.1.0"

__all__ = [
    "ChatTurn",
    "DiffusionStep",
    "EngineBuildError",
    "EngineBusy",
    "EngineClosed",
    "EngineEvent",
    "GenerationParams",
    "GenerationRequest",
    "OmniEngine",
    "OutputModality",
    "RequestError",
    "ResolvedRequest",
    "RunFailed",
    "RunFinished",
    "RunOutput",
    "StageFinished",
    "StageStarted",
    "TextDelta",
    "TokenProgress",
    "build_engine",
    "build_pipeline_config",
    "device_problems",
    "parse_output_modalities",
]
