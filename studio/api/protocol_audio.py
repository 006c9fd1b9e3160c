"""Request and response models of the API's audio (docs/speech.md, "The API"): ``POST /v1/audio/speech``,
the ``audio`` and ``input_audio`` fields of chat completions, and ``message.audio`` in replies.

OpenAI's shapes; what this server cannot do is refused by name (``aac``, a
compressed format in a stream), never dropped.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class StrictAudio(BaseModel):
    """Unknown fields are refused (a 400 naming them), as in studio/api/protocol.py."""

    model_config = ConfigDict(extra="forbid")


SpeechFormat = Literal["wav", "mp3", "flac", "opus", "pcm"]
ChatAudioFormat = Literal["wav", "mp3", "flac", "opus", "pcm16"]
InputAudioFormat = Literal["wav", "mp3"]
# Formats whose bytes can go out as they are made: raw pcm16, or a WAV with an open-ended header.
STREAMABLE_SPEECH_FORMATS = ("wav", "pcm")
STREAMABLE_CHAT_FORMATS = ("wav", "pcm16")


class VoiceID(StrictAudio):
    """A voice given as an object (``{"id": "Ethan"}``, the SDK's custom-voice form)."""

    id: str


class SpeechRequest(StrictAudio):
    """``POST /v1/audio/speech``: the audio speaks ``input`` (the thinker is made to say it)."""

    model: str | None = None
    input: str = Field(min_length=1, description="the text to speak (length: --max-speech-chars)")
    voice: str | VoiceID | None = Field(None, description="one of the model's voices (GET /v1/models)")
    response_format: SpeechFormat = "wav"
    speed: float = Field(
        1.0,
        ge=0.25,
        le=4.0,
        description="tempo, the pitch kept: 2.0 says it in half the time (docs/speech.md)",
    )
    seed: int | None = Field(None, ge=0, le=2**63 - 1)
    stream_format: Literal["sse", "audio"] | None = Field(
        None,
        description="absent: the whole file; 'audio': raw pcm or wav bytes as they are made; 'sse': "
        "speech.audio.delta events (base64 pcm16) then speech.audio.done",
    )
    instructions: str | None = Field(None, description="how to say it: the user turn before the text")
    num_inference_steps: int | None = Field(
        None, ge=1, le=1000, description="code2wav's ODE time points (more: slower; --max-steps)"
    )

    model_config = ConfigDict(
        extra="forbid",
        json_schema_extra={
            "examples": [{"model": "tiny-qwen-omni", "input": "hello there", "voice": "Chelsie", "seed": 1}]
        },
    )


class ChatAudioParams(StrictAudio):
    """A chat request's ``audio``: the voice and the format of ``message.audio.data``."""

    voice: str | VoiceID | None = None
    format: ChatAudioFormat = "wav"


class InputAudio(StrictAudio):
    data: str = Field(description="base64 of the file's bytes")
    format: InputAudioFormat


class InputAudioPart(StrictAudio):
    type: Literal["input_audio"]
    input_audio: InputAudio


class AssistantAudioRef(StrictAudio):
    """An earlier reply's ``audio`` sent back in the history: accepted, not read (the server keeps no audio
    between requests; the turn's ``content`` is its text)."""

    id: str


class AudioOut(BaseModel):
    """``message.audio`` of a chat reply."""

    id: str
    data: str = Field(description="base64 of the audio in the request's audio.format")
    expires_at: int = Field(description="the reply's time: the server keeps no audio for later turns")
    transcript: str
