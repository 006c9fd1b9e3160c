"""What a caller asks the engine for, and the checked, fully resolved form the engine runs."""

from __future__ import annotations

import secrets
import uuid
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
from PIL import Image

from engine.modality import OutputModality

MAX_SEED = 2**63 - 1


class RequestError(ValueError):
    """A request the engine cannot run; ``field`` names the offending parameter."""

    def __init__(self, field: str, message: str) -> None:
        self.field = field
        self.message = message
        super().__init__(f"{field}: {message}")


@dataclass(frozen=True)
class ChatTurn:
    role: str  # system | user | assistant
    text: str


@dataclass(frozen=True)
class GenerationParams:
    """Per-request parameters; ``None`` means "use the stage's default"."""

    seed: int | None = None
    height: int | None = None
    width: int | None = None
    num_inference_steps: int | None = None
    guidance_scale: float | None = None
    negative_prompt: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    n: int = 1
    preview_every: int = 0  # decode a preview every k denoising steps (0: none)
    voice: str | None = None  # speech: the speaker (families with audio output; None: the model's default)
    speed: float | None = None  # speech: tempo, pitch kept (0.25-4.0; engine/tempo.py; None: as spoken)

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if v is not None}


@dataclass(frozen=True)
class GenerationRequest:
    """A prompt (with optional chat history and source image) and its parameters."""

    prompt: str
    params: GenerationParams = field(default_factory=GenerationParams)
    image: Image.Image | None = None
    history: tuple[ChatTurn, ...] = ()  # earlier turns, oldest first; ``prompt`` is the newest user turn
    modalities: tuple[OutputModality, ...] | None = None  # None: what the pipeline's final stage produces
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    # Who sent it (an API key and address, a UI session...; None: a client of its own). Stage queues
    # serve waiting jobs round-robin across clients (engine/engine.py; README, "Many clients").
    client: str | None = None
    # Speech (families that speak, docs/speech.md "Speaking given text and audio in"): the words to say,
    # teacher-forced as the model's reply instead of sampled (``prompt``: the instructions, or "").
    speak_text: str | None = None
    # Speech in: float32 mono 16 kHz clips, heard in this order at the start of the newest user turn.
    # Left out of ==/hash (arrays have neither); limits on length are the caller's.
    input_audio: tuple[np.ndarray, ...] = field(default=(), compare=False)

    def with_params(self, **changes: Any) -> GenerationRequest:
        return replace(self, params=replace(self.params, **changes))

    @property
    def messages(self) -> list[ChatTurn]:
        return [*self.history, ChatTurn("user", self.prompt)]


@dataclass(frozen=True)
class ResolvedRequest:
    """A request checked against the running pipeline, with every parameter and the seed decided.

    ``stage_params`` holds, per stage id, the parameters that stage will run with; ``parameters`` is the
    flat view recorded in history (and enough to re-run the request exactly).
    """

    request: GenerationRequest
    seed: int
    parameters: dict[str, Any]
    stage_params: dict[int, dict[str, Any]]
    modalities: tuple[OutputModality, ...]
    # Notes about a request that runs but is outside what the model supports (e.g. a size it was not
    # trained at): the CLI prints them, the UI shows them, the API returns them in ``warnings``.
    warnings: tuple[str, ...] = ()

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def n(self) -> int:
        return self.request.params.n


def check_request_types(request: GenerationRequest) -> None:
    """Refuse speech fields of the wrong type: :class:`RequestError` naming ``speak_text`` or ``input_audio``.

    Only types (and finite samples) are checked here; lengths and sizes are the caller's limits.
    """
    if request.speak_text is not None and not isinstance(request.speak_text, str):
        raise RequestError("speak_text", f"must be a string or None, got {type(request.speak_text).__name__}")
    clips = request.input_audio
    if not isinstance(clips, tuple):
        raise RequestError("input_audio", f"must be a tuple of clips, got {type(clips).__name__}")
    for i, clip in enumerate(clips):
        if not isinstance(clip, np.ndarray) or clip.dtype != np.float32 or clip.ndim != 1:
            got = (
                f"a {clip.ndim}-D {clip.dtype} array" if isinstance(clip, np.ndarray) else type(clip).__name__
            )
            raise RequestError(
                "input_audio", f"clip {i} must be a 1-D float32 numpy array (mono, 16 kHz), got {got}"
            )
        if not np.isfinite(clip).all():
            raise RequestError("input_audio", f"clip {i} has samples that are NaN or infinite")


def random_seed() -> int:
    """A fresh seed for requests that do not give one (recorded, so the run can be repeated)."""
    return secrets.randbelow(2**31)
