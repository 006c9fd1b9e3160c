"""OpenAI-compatible request and response models (pydantic, with field constraints).

Requests forbid unknown fields: a field we do not support is a 400 that names it, never silently
dropped. Generation fields (``height``, ``num_inference_steps``, ...) may sit at the top level (what the
OpenAI SDK's ``extra_body`` produces) or under a literal ``"extra_body"`` key (what the GLM-Image
regression client sends); :meth:`ChatCompletionRequest.generation` merges the two.
"""

from __future__ import annotations

import re
import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from studio.api.protocol_audio import AssistantAudioRef, AudioOut, ChatAudioParams, InputAudioPart

ImageReply = Literal["content", "images"]
IMAGE_REPLIES: tuple[str, ...] = ("content", "images")
SIZE_PATTERN = re.compile(r"^(\d{1,5})x(\d{1,5})$")  # digits bounded: int() of 5000 digits raises
MODALITY_NAMES = ("text", "image", "audio", "latent", "token_ids")


class StrictRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")


class GenerationFields(StrictRequest):
    """Fields beyond OpenAI's chat API that steer generation (accepted top-level or under ``extra_body``)."""

    height: int | None = Field(None, ge=16, le=4096)
    width: int | None = Field(None, ge=16, le=4096)
    size: str | None = Field(None, description="WIDTHxHEIGHT, e.g. 1024x768")
    num_inference_steps: int | None = Field(None, ge=1, le=1000)
    guidance_scale: float | None = Field(None, ge=0.0, le=100.0)
    negative_prompt: str | None = None  # length: InputLimits.max_prompt_chars
    seed: int | None = Field(None, ge=0, le=2**63 - 1)
    n: int | None = Field(None, ge=1, le=8)
    max_tokens: int | None = Field(None, ge=1, le=32768)
    temperature: float | None = Field(None, ge=0.0, le=10.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1)
    preview_every: int | None = Field(None, ge=0, le=1000, description="stream a preview every k steps")

    @field_validator("size")
    @classmethod
    def _size_format(cls, value: str | None) -> str | None:
        if value is not None and not SIZE_PATTERN.match(value):
            raise ValueError("size must be 'WIDTHxHEIGHT', e.g. '1024x1024'")
        return value


GENERATION_FIELDS = tuple(GenerationFields.model_fields)


class ImageURL(StrictRequest):
    url: str
    detail: Literal["auto", "low", "high"] | None = None


class TextPart(StrictRequest):
    type: Literal["text"]
    text: str


class ImagePart(StrictRequest):
    type: Literal["image_url"]
    image_url: ImageURL


class ChatMessage(StrictRequest):
    role: Literal["system", "user", "assistant", "developer"]
    content: str | list[TextPart | ImagePart | InputAudioPart] | None = None
    name: str | None = None
    # An earlier assistant reply sent back as it came with ``image_reply: "images"`` (history: not read).
    images: list[ImagePart] | None = None
    audio: AssistantAudioRef | None = None  # an earlier spoken reply sent back (history: its content is read)

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(part.text for part in self.content if isinstance(part, TextPart))

    def image_urls(self) -> list[str]:
        if not isinstance(self.content, list):
            return []
        return [part.image_url.url for part in self.content if isinstance(part, ImagePart)]

    def audio_parts(self) -> list[tuple[int, InputAudioPart]]:
        """The ``input_audio`` parts with their index in ``content``."""
        if not isinstance(self.content, list):
            return []
        return [(i, part) for i, part in enumerate(self.content) if isinstance(part, InputAudioPart)]


class StreamOptions(StrictRequest):
    include_usage: bool = False


class ChatCompletionRequest(GenerationFields):
    """``POST /v1/chat/completions``."""

    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_completion_tokens: int | None = Field(None, ge=1, le=32768)
    modalities: list[str] | None = None
    audio: ChatAudioParams | None = Field(
        None, description="with modalities ['text', 'audio']: the voice and the format of message.audio.data"
    )
    user: str | None = None
    image_reply: ImageReply | None = Field(
        None,
        description=(
            "How images come back: 'content' (default) as image_url parts of message.content; 'images' with "
            "message.content a string and the parts in message.images (streams: delta.images)"
        ),
    )
    extra_body: GenerationFields | None = None

    model_config = ConfigDict(
        extra="forbid",
        json_schema_extra={
            "examples": [
                {
                    "model": "tiny-glm-image",
                    "messages": [{"role": "user", "content": "a red circle on a blue background"}],
                    "seed": 42,
                    "height": 64,
                    "width": 64,
                    "num_inference_steps": 4,
                }
            ]
        },
    )

    @field_validator("modalities")
    @classmethod
    def _canonical_modalities(cls, value: list[str] | None) -> list[str] | None:
        if value is None:
            return None
        if not value:
            raise ValueError(f"modalities must not be empty; valid names are {', '.join(MODALITY_NAMES)}")
        for name in value:
            if name not in MODALITY_NAMES:
                raise ValueError(f"unknown modality {name!r}; valid names are {', '.join(MODALITY_NAMES)}")
        return value

    @model_validator(mode="after")
    def _no_conflicts(self) -> ChatCompletionRequest:
        if self.extra_body is not None:
            for key in self.extra_body.model_fields_set:
                if key in self.model_fields_set and getattr(self, key) != getattr(self.extra_body, key):
                    raise ValueError(
                        f"{key} is given both at the top level and under extra_body with different values"
                    )
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        return self

    def generation(self) -> dict[str, Any]:
        """Generation fields from the top level and ``extra_body``, merged (explicitly set ones only)."""
        merged = {k: getattr(self, k) for k in GENERATION_FIELDS if k in self.model_fields_set}
        if self.extra_body is not None:
            merged.update({k: getattr(self.extra_body, k) for k in self.extra_body.model_fields_set})
        if self.max_completion_tokens is not None and "max_tokens" not in merged:
            merged["max_tokens"] = self.max_completion_tokens
        return merged


class ImageGenerationRequest(StrictRequest):
    """``POST /v1/images/generations`` (the edits endpoint takes the same fields as form data)."""

    prompt: str = Field(min_length=1)  # length: InputLimits.max_prompt_chars
    model: str | None = None
    n: int = Field(1, ge=1, le=8)
    size: str | None = None
    response_format: Literal["b64_json", "url"] = "b64_json"
    output_format: Literal["png"] | None = None
    quality: Literal["auto", "standard"] | None = None
    user: str | None = None
    seed: int | None = Field(None, ge=0, le=2**63 - 1)
    num_inference_steps: int | None = Field(None, ge=1, le=1000)
    guidance_scale: float | None = Field(None, ge=0.0, le=100.0)
    negative_prompt: str | None = None  # length: InputLimits.max_prompt_chars
    height: int | None = Field(None, ge=16, le=4096)
    width: int | None = Field(None, ge=16, le=4096)

    model_config = ConfigDict(
        extra="forbid",
        json_schema_extra={
            "examples": [
                {"prompt": "a red circle", "seed": 7, "size": "64x64", "response_format": "b64_json"}
            ]
        },
    )

    @field_validator("size")
    @classmethod
    def _size_format(cls, value: str | None) -> str | None:
        if value is not None and value != "auto" and not SIZE_PATTERN.match(value):
            raise ValueError("size must be 'WIDTHxHEIGHT' (e.g. '1024x1024') or 'auto'")
        return value


# -- responses --------------------------------------------------------------------------------------


def completion_id() -> str:
    return f"chatcmpl-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=now)
    owned_by: str = "omni-studio"
    root: str | None = None
    family: str | None = None
    stages: list[dict[str, Any]] = Field(default_factory=list)
    config_hash: str | None = None
    modalities: list[str] = Field(
        default_factory=list,
        description="what the model outputs ('text', 'image', 'audio'): all of them unless a request's "
        "modalities picks some",
    )
    voices: list[str] = Field(default_factory=list, description="the voices it speaks in, the default first")


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


class ImageEditForm(ImageGenerationRequest):
    """``POST /v1/images/edits`` (multipart/form-data): the image file and the generation fields."""

    image: bytes = Field(
        json_schema_extra={"format": "binary"}, description="the source image (PNG, JPEG, ...)"
    )


class ImageURLOut(BaseModel):
    url: str = Field(description="a data:image/png;base64 URL")


class ImagePartOut(BaseModel):
    type: Literal["image_url"] = "image_url"
    image_url: ImageURLOut


class TextPartOut(BaseModel):
    type: Literal["text"] = "text"
    text: str


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | list[TextPartOut | ImagePartOut] = Field(
        description="text; with images, a list of parts (image_reply 'content') or the text (image_reply 'images')"
    )
    images: list[ImagePartOut] | None = Field(None, description="the images, with image_reply 'images'")
    audio: AudioOut | None = Field(None, description="the spoken reply, when audio was asked for")


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    finish_reason: str | None = None


class ChatCompletionResponse(BaseModel):
    """A chat completion (``stream: true`` sends ``chat.completion.chunk`` server-sent events instead)."""

    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo
    system_fingerprint: str | None = None


class ImageData(BaseModel):
    b64_json: str | None = None
    url: str | None = Field(None, description="with response_format 'url'; signed when an API key is set")
    revised_prompt: str | None = None


class ImagesResponse(BaseModel):
    created: int
    data: list[ImageData]
    output_format: Literal["png"] = "png"
    system_fingerprint: str | None = None


class HealthResponse(BaseModel):
    status: Literal["ok", "starting"]
    model: str | None = None
