"""``POST /v1/audio/speech`` (OpenAI's speech API; docs/speech.md, "The API").

The audio speaks ``input``: the thinker is made to say it as its reply (``GenerationRequest.speak_text``)
and the talker and code2wav voice that. ``instructions`` go before the text in the user's turn. Without
``stream_format`` the reply is the whole file in ``response_format`` with its content type; ``audio``
streams raw pcm (``wav``: an open-ended WAV header first) as code2wav makes it; ``sse`` sends
``speech.audio.delta`` events (base64 pcm16) and one ``speech.audio.done`` with the usage.

The run goes the way every generation does (``OpenAIServing.start_run``, the run service's events): it is
recorded, queued fairly among clients, and cancelled when the client goes away. The reply's headers
carry the run id and ``X-System-Fingerprint`` (the body is audio: it has nowhere else to go).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request, Response
from fastapi.responses import StreamingResponse

from engine import ResolvedRequest
from engine.events import AudioDelta, RunFailed, RunFinished
from studio.api.audio_io import (
    check_speaks,
    check_voice,
    encode_output,
    pcm16_b64,
    voice_name,
)
from studio.api.errors import APIError
from studio.api.inputs import check_generation_limits, check_text
from studio.api.protocol_audio import STREAMABLE_SPEECH_FORMATS, SpeechRequest
from studio.api.serving_base import (
    OpenAIServing,
    RunTracking,
    client_id,
    fingerprint_headers,
    recorded,
    rejection_error,
    reply_headers,
    usage_of,
)
from studio.api.serving_chat import sse
from studio.media.audio import AUDIO_FORMATS, pcm16_chunk, streaming_wav_header
from studio.runs.service import RunRejected
from studio.runs.speech import speech_input_problem, speech_request


class StreamAborted(RuntimeError):
    """The run failed after a raw audio stream began: the connection is cut so the client sees a broken
    transfer, not a short file that looks whole."""


class OpenAIServingSpeech(OpenAIServing):
    prompt_field = "input"

    async def create(self, request: SpeechRequest, payload: dict[str, Any], raw: Request | None) -> Response:
        self.check_model(request.model)
        check_speaks(self.engine, self.served_model_name, "model")
        self.check_fields(request)
        voice = voice_name(request.voice)
        check_voice(self.engine, self.served_model_name, voice, "voice")
        engine_request = speech_request(
            request.input,
            voice=voice,
            speed=request.speed,
            seed=request.seed,
            instructions=request.instructions,
            num_inference_steps=request.num_inference_steps,
        )
        resolved, tracker = self.start_run(engine_request, payload)
        headers = {**reply_headers(resolved, tracker), **fingerprint_headers(self.system_fingerprint)}
        fmt = request.response_format
        if request.stream_format is None:
            result = await self.run_to_completion(resolved, tracker, raw)
            try:
                data = encode_output(result.outputs[0], fmt, tracker)
            except APIError as exc:
                raise recorded(exc, tracker) from exc
            return Response(data, media_type=AUDIO_FORMATS[fmt].content_type, headers=headers)
        # A 429 (recorded) now, not a broken stream after a 200 (as for chat streams).
        problem = self.runs.admission_problem(self.engine, client_id(raw))
        if problem is not None:
            raise recorded(rejection_error(self.runs.reject(problem, tracker)), tracker)
        headers.update({"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        if request.stream_format == "sse":
            return StreamingResponse(
                self.sse_events(resolved, tracker, client_id(raw)),
                media_type="text/event-stream",
                headers=headers,
            )
        return StreamingResponse(
            self.audio_bytes(resolved, tracker, fmt, client_id(raw)),
            media_type=AUDIO_FORMATS[fmt].content_type,
            headers=headers,
        )

    def check_fields(self, request: SpeechRequest) -> None:
        """``input`` (not blank, within ``--max-speech-chars``), ``instructions`` and a streamable
        ``response_format`` when streaming: a 400 naming the field and what is allowed."""
        limits = self.context.limits
        problem = speech_input_problem(request.input, limits.max_speech_chars)
        if problem is not None:
            code = "input_too_long" if request.input.strip() else None
            raise APIError(400, problem, "input", code)
        check_text(request.instructions, "instructions", limits)
        check_generation_limits(request.model_dump(include={"num_inference_steps"}), limits)
        if request.stream_format is not None and request.response_format not in STREAMABLE_SPEECH_FORMATS:
            raise APIError(
                400,
                f"response_format {request.response_format!r} cannot be streamed: with stream_format "
                f"{request.stream_format!r} use {' or '.join(STREAMABLE_SPEECH_FORMATS)} (or drop "
                "stream_format for the whole file)",
                "response_format",
                "unsupported_value",
            )

    async def _events(self, resolved: ResolvedRequest, tracker: RunTracking, client: str | None):
        """The run's events; closing it (the client went away) records the run cancelled and cancels it."""
        events = self.runs.events(
            self.engine, resolved, tracker, stopped="the client disconnected during the stream", client=client
        )
        try:
            async for event in events:
                yield event
        finally:
            await events.aclose()

    async def audio_bytes(
        self, resolved: ResolvedRequest, tracker: RunTracking, fmt: str, client: str | None
    ) -> AsyncIterator[bytes]:
        """``stream_format: audio``: pcm16 pieces as they come (``wav``: the open-ended header first)."""
        header_sent = fmt != "wav"
        events = self._events(resolved, tracker, client)
        try:
            async for event in events:
                if isinstance(event, AudioDelta):
                    piece = pcm16_chunk(event.samples)
                    if not header_sent:
                        piece = streaming_wav_header(event.sample_rate) + piece
                        header_sent = True
                    if piece:
                        yield piece
                elif isinstance(event, RunFailed):
                    raise StreamAborted(f"the run failed mid-stream: {event.message}")
                elif isinstance(event, RunFinished) and not header_sent:
                    rate = next((o.sample_rate for o in event.outputs if o.sample_rate), 0) or 24000
                    yield streaming_wav_header(rate)  # no audio at all: an empty WAV
        except RunRejected as exc:  # queue full / engine restarting after the admission check
            raise StreamAborted(rejection_error(exc).message) from exc
        finally:
            await events.aclose()

    async def sse_events(
        self, resolved: ResolvedRequest, tracker: RunTracking, client: str | None
    ) -> AsyncIterator[str]:
        """``stream_format: sse``: ``speech.audio.delta`` events, then ``speech.audio.done`` (or an error)."""
        events = self._events(resolved, tracker, client)
        try:
            async for event in events:
                if isinstance(event, AudioDelta) and event.samples.size:
                    yield sse({"type": "speech.audio.delta", "audio": pcm16_b64(event.samples)})
                elif isinstance(event, RunFinished):
                    usage = usage_of(event)
                    done: dict[str, Any] = {
                        "type": "speech.audio.done",
                        "usage": {
                            "input_tokens": usage["prompt_tokens"],
                            "output_tokens": usage["completion_tokens"],
                            "total_tokens": usage["total_tokens"],
                        },
                    }
                    if self.system_fingerprint is not None:
                        done["system_fingerprint"] = self.system_fingerprint
                    yield sse(done)
                elif isinstance(event, RunFailed):
                    status = 400 if event.error_type == "invalid_request" else 500
                    yield sse(APIError(status, event.message, None, event.error_type).body())
        except RunRejected as exc:
            yield sse(rejection_error(exc).body())
        finally:
            await events.aclose()
