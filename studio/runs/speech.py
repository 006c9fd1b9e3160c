"""A speech request (text to speak, a voice, a tempo): the one definition ``POST /v1/audio/speech`` and the
studio's Speech panel share, so both make the same engine request and record it the same way
(docs/speech.md, "The API" and "In the studio").

The audio speaks ``text``: the thinker is made to say it as its reply (``GenerationRequest.speak_text``),
and the talker and code2wav voice that. ``instructions`` go before the text in the user's turn. Only
audio is asked for.
"""

from __future__ import annotations

from typing import Any

from engine import GenerationParams, GenerationRequest
from engine.modality import OutputModality


def speech_input_problem(text: str, max_chars: int) -> str | None:
    """Why ``text`` cannot be spoken (blank, longer than ``--max-speech-chars``), or None."""
    if not text.strip():
        return "input is blank: give the text to speak"
    if len(text) > max_chars:
        return f"input is {len(text)} characters; the limit is {max_chars} (--max-speech-chars)"
    return None


def speech_request(
    text: str,
    *,
    voice: str | None,
    speed: float = 1.0,
    seed: int | None = None,
    instructions: str | None = None,
    num_inference_steps: int | None = None,
) -> GenerationRequest:
    """The engine request that speaks ``text`` (``speed`` 1.0: as spoken, nothing stretched or recorded)."""
    prompt = text if not instructions else f"{instructions}\n\n{text}"
    return GenerationRequest(
        prompt,
        GenerationParams(
            seed=seed,
            voice=voice,
            num_inference_steps=num_inference_steps,
            speed=None if speed == 1.0 else speed,
        ),
        modalities=(OutputModality.AUDIO,),
        speak_text=text,
    )


def speech_payload(
    text: str,
    *,
    voice: str | None,
    response_format: str,
    speed: float = 1.0,
    seed: int | None = None,
    instructions: str | None = None,
) -> dict[str, Any]:
    """The recorded request of a speech run made outside the API, in the API's field names."""
    payload: dict[str, Any] = {"input": text, "voice": voice, "response_format": response_format}
    payload.update({"speed": speed, "seed": seed, "instructions": instructions})
    return {key: value for key, value in payload.items() if value is not None}
