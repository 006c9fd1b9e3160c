"""Audio at the API's edge (docs/speech.md, "The API"): checks of a request that speaks against the served
model (an audio stage, its voices), the audio a reply carries (encoded once by studio/media/audio.py,
WAV and FLAC with the run's recipe), and the ``input_audio`` parts a chat request sends.

Errors are 400s (413 past a size limit) naming the client's field and the allowed values.
"""

from __future__ import annotations

import base64
import binascii
import json
from typing import Any

import numpy as np

from engine import OmniEngine
from engine.events import RunOutput
from engine.modality import OutputModality, format_output_modalities
from studio.api.errors import APIError
from studio.api.protocol import ChatCompletionRequest
from studio.api.protocol_audio import VoiceID
from studio.media.audio import AUDIO_FORMATS, AudioError, decode_input_audio, encode_audio, pcm16_chunk
from studio.recipes import recipe as recipes
from studio.startup.limits import InputLimits

# chat's ``audio.format`` names -> studio/media/audio.py's (OpenAI calls raw 16-bit pcm ``pcm16`` there)
CHAT_FORMATS = {"wav": "wav", "mp3": "mp3", "flac": "flac", "opus": "opus", "pcm16": "pcm"}


def produced(engine: OmniEngine) -> tuple[OutputModality, ...]:
    """What the served model outputs (a request's ``modalities`` picks among these)."""
    return engine.family.final_modalities(engine.config)


def voices(engine: OmniEngine) -> tuple[str, ...]:
    """The served model's voices, the default first (empty: it does not speak)."""
    return tuple(engine.family.voices(engine.model.path))


def check_speaks(engine: OmniEngine, model_name: str, param: str) -> None:
    """400 naming ``param`` and the model's modalities when the served model has no audio stage."""
    made = produced(engine)
    if OutputModality.AUDIO not in made:
        raise APIError(
            400,
            f"{param}: {model_name} produces {format_output_modalities(made)}, no audio (it has no audio "
            "stage); ask a model that speaks (GET /v1/models lists each model's modalities)",
            param,
            "no_audio_stage",
        )


def voice_name(voice: str | VoiceID | None) -> str | None:
    return voice.id if isinstance(voice, VoiceID) else voice


def check_voice(engine: OmniEngine, model_name: str, voice: str | None, param: str) -> None:
    """400 naming ``param`` and the model's voices when ``voice`` is not one of them."""
    known = voices(engine)
    if voice is not None and known and voice not in known:
        raise APIError(
            400,
            f"{param}: {model_name} has no voice {voice!r}; allowed: {', '.join(known)}",
            param,
            "unknown_voice",
        )


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def pcm16_b64(samples: np.ndarray) -> str:
    """A streamed piece: base64 of the samples as little-endian int16 (the pieces join into ``pcm``)."""
    return b64(pcm16_chunk(samples))


def output_recipe(output: RunOutput, tracker: Any) -> dict[str, Any] | None:
    """The recipe of ``output`` as a JSON object (what WAV and FLAC files carry): the one the run service
    stamped on it (``studio.recipes.recipe.audio_recipe``), so the reply's file is the run store's bytes;
    else built from the run's recipe; ``None`` when the run has none."""
    stamped = getattr(recipes, "audio_recipe", None)
    if stamped is not None:
        found = stamped(output)
        if found is not None:
            return dict(found)
    recipe = getattr(tracker, "recipe", None)
    if recipe is None or not hasattr(recipe, "for_seed"):
        return None
    value = json.loads(recipe.for_seed(output.seed).to_json())
    return value if isinstance(value, dict) else None


def encode_output(output: RunOutput, fmt: str, tracker: Any) -> bytes:
    """``output``'s audio as a ``fmt`` file (``AUDIO_FORMATS`` names), WAV and FLAC with the recipe."""
    if output.audio is None or output.audio.size == 0:
        raise APIError(500, "the model made no audio (0 samples) for this request", None, "no_audio")
    recipe = output_recipe(output, tracker) if AUDIO_FORMATS[fmt].carries_recipe else None
    try:
        return encode_audio(output.audio, output.sample_rate, fmt, recipe)
    except AudioError as exc:
        raise APIError(500, f"could not encode the audio: {exc}", None, "engine_error") from exc


# -- audio in ------------------------------------------------------------------------------------------


def input_audio_clips(
    request: ChatCompletionRequest, limits: InputLimits
) -> tuple[list[str], list[np.ndarray]]:
    """The newest user message's ``input_audio`` parts decoded (float32 mono 16 kHz), with their field
    paths. Audio in an earlier message is refused: the engine hears the newest turn's clips only."""
    paths: list[str] = []
    clips: list[np.ndarray] = []
    last = len(request.messages) - 1
    for i, message in enumerate(request.messages):
        for j, part in message.audio_parts():
            field = f"messages[{i}].content[{j}].input_audio"
            if i != last:
                raise APIError(
                    400,
                    f"{field}: only the last message's audio is heard; send earlier turns as text",
                    field,
                )
            clips.append(decode_clip(part.input_audio.data, part.input_audio.format, field, limits))
            paths.append(field)
    return paths, clips


def decode_clip(data: str, fmt: str, field: str, limits: InputLimits) -> np.ndarray:
    """One ``input_audio`` part: base64 -> bytes -> samples, within ``--max-audio-bytes`` and
    ``--max-audio-seconds`` (413 past them, 400 for anything else, naming the field)."""
    data_field = f"{field}.data"
    if len(data) * 3 // 4 > limits.max_audio_bytes:
        raise APIError(
            413,
            f"{data_field} is larger than {limits.max_audio_bytes} bytes (--max-audio-bytes)",
            data_field,
            "audio_too_large",
        )
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise APIError(400, f"{data_field}: invalid base64 data ({exc})", data_field) from exc
    try:
        return decode_input_audio(
            raw,
            fmt,
            max_bytes=limits.max_audio_bytes,
            max_seconds=limits.max_audio_seconds,
            field=field,
        )
    except AudioError as exc:
        if exc.too_large:
            flag = "--max-audio-seconds" if "seconds" in str(exc) else "--max-audio-bytes"
            raise APIError(413, f"{exc} ({flag})", exc.field, "audio_too_large") from exc
        raise APIError(400, str(exc), exc.field, "invalid_audio") from exc
