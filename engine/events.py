"""Typed events a run yields, in order: stages start, progress, deltas and previews, outputs or an error.

The UI, the API's SSE stream, the CLI progress bars and the run store all consume these same events.
``index`` tells which of the ``n`` outputs of a request an event belongs to.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

import numpy as np
from PIL import Image

# StrEnums: each member equals its string, so comparisons with plain strings and the values stored in
# JSON and the run store stay what they were.


class StageKind(StrEnum):
    AR = "ar"
    DIFFUSION = "diffusion"


class StageStatus(StrEnum):
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"


class ErrorType(StrEnum):
    ENGINE_ERROR = "engine_error"
    CANCELLED = "cancelled"
    INVALID_REQUEST = "invalid_request"


class FinishReason(StrEnum):
    STOP = "stop"
    LENGTH = "length"
    CANCELLED = "cancelled"


@dataclass(frozen=True)
class EngineEvent:
    request_id: str
    index: int = 0


@dataclass(frozen=True)
class StageStarted(EngineEvent):
    stage_id: int = 0
    kind: StageKind = StageKind.AR
    total: int = 0  # tokens to generate (ar) or denoising steps (diffusion); 0 when unknown


@dataclass(frozen=True)
class TokenProgress(EngineEvent):
    """AR generation progress: ``step`` tokens of ``total`` generated."""

    stage_id: int = 0
    step: int = 0
    total: int = 0


@dataclass(frozen=True)
class TextDelta(EngineEvent):
    """New text from an AR stage that produces text."""

    stage_id: int = 0
    text: str = ""


@dataclass(frozen=True)
class DiffusionStep(EngineEvent):
    """One denoising step done; ``preview`` is the decoded current latent when previews were asked for."""

    stage_id: int = 0
    step: int = 0
    total: int = 0
    preview: Image.Image | None = field(default=None, compare=False)


@dataclass(frozen=True)
class AudioDelta(EngineEvent):
    """New audio from a stage that speaks: the samples made since the last delta (float32 mono in
    [-1, 1] at ``sample_rate``). A whole-utterance render sends one; a streamed render one per chunk.
    Concatenated in order they are the output's ``audio`` (docs/speech.md)."""

    stage_id: int = 0
    samples: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.float32), compare=False)
    sample_rate: int = 0


@dataclass(frozen=True)
class StageFinished(EngineEvent):
    stage_id: int = 0
    kind: StageKind = StageKind.AR
    status: StageStatus = StageStatus.SUCCEEDED
    started_at: float = 0.0  # time.time() stamps
    finished_at: float = 0.0
    queue_seconds: float = 0.0  # waited for the stage after the previous one finished
    input_tokens: int = 0
    output_tokens: int = 0
    batch_size: int = 1  # jobs in flight at the stage when this one finished
    # The most rows any decode step of this job computed together (AR stages that decode rows in
    # shared steps; 0 where the stage does not): 8 means eight requests really shared forwards.
    step_rows: int = 0

    @property
    def seconds(self) -> float:
        return max(0.0, self.finished_at - self.started_at)


@dataclass(frozen=True)
class RunOutput:
    """The outputs of one of the ``n`` variants of a request."""

    index: int
    seed: int
    text: str | None = None
    images: tuple[Image.Image, ...] = ()
    token_ids: tuple[int, ...] | None = None
    # Speech (the qwen-omni family): float32 mono samples in [-1, 1] at ``sample_rate`` Hz; None when
    # audio was not asked for. Encoding is the studio's (studio/media/).
    audio: np.ndarray | None = field(default=None, compare=False)
    sample_rate: int = 0
    finish_reason: FinishReason = FinishReason.STOP
    input_tokens: int = 0
    output_tokens: int = 0
    extras: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class RunFinished(EngineEvent):
    """The last event of a successful request: every variant's outputs."""

    outputs: tuple[RunOutput, ...] = ()

    @property
    def images(self) -> list[Image.Image]:
        return [image for output in self.outputs for image in output.images]

    @property
    def text(self) -> str:
        return "".join(output.text or "" for output in self.outputs)


@dataclass(frozen=True)
class RunFailed(EngineEvent):
    """The last event of a failed or cancelled request."""

    message: str = ""
    stage_id: int | None = None
    error_type: ErrorType = ErrorType.ENGINE_ERROR
    cancelled: bool = False


PROGRESS_EVENTS = (TokenProgress, DiffusionStep)
STREAMING_EVENTS = (TokenProgress, DiffusionStep, TextDelta, AudioDelta)  # what only a live view needs
TERMINAL_EVENTS = (RunFinished, RunFailed)
