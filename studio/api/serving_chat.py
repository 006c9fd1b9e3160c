"""``POST /v1/chat/completions``: text, images and streamed progress in OpenAI's chat format.

Streaming rule for ``system_fingerprint`` (README.md, "The API"): exactly one chunk carries it: the terminal
chunk (the one with ``finish_reason``) when usage is not requested, the trailing usage chunk
(``choices: []``) when ``stream_options.include_usage`` is true.

Audio (docs/speech.md, "The API"): with ``audio`` among the modalities (or a model whose default includes
it) an output's audio is ``message.audio`` ``{id, data, expires_at, transcript}`` in ``audio.format``;
streamed, ``delta.audio`` objects carry base64 pcm16 ``data`` pieces as they are made, the text's deltas
as ``transcript`` (beside ``delta.content``), and a last one ``expires_at``.

Images come back as ``image_url`` parts of ``message.content`` (a list; in streams ``delta.content``) by
default, or with ``image_reply: "images"`` (per request, or ``--image-reply images`` for the server) with
``content`` a string and the same parts in ``message.images`` / ``delta.images``.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from engine.events import (
    AudioDelta,
    DiffusionStep,
    EngineEvent,
    RunFailed,
    RunFinished,
    RunOutput,
    StageStarted,
    TextDelta,
    TokenProgress,
)
from engine.modality import OutputModality
from studio.api.audio_io import (
    CHAT_FORMATS,
    b64,
    check_speaks,
    check_voice,
    encode_output,
    pcm16_b64,
    produced,
    voice_name,
)
from studio.api.errors import APIError
from studio.api.inputs import chat_to_engine_request
from studio.api.protocol import ChatCompletionRequest, completion_id, now
from studio.api.protocol_audio import STREAMABLE_CHAT_FORMATS
from studio.api.serving_base import (
    OpenAIServing,
    RunTracking,
    client_id,
    png_data_url,
    recorded,
    rejection_error,
    reply_headers,
    usage_of,
)
from studio.runs.service import RunRejected


def image_parts(output: RunOutput) -> list[dict[str, Any]]:
    return [{"type": "image_url", "image_url": {"url": png_data_url(image)}} for image in output.images]


def message_content(output: RunOutput) -> str | list[dict[str, Any]]:
    """Plain text for text-only outputs; otherwise a list of parts (text first, then images)."""
    if not output.images:
        return output.text or ""
    parts: list[dict[str, Any]] = []
    if output.text:
        parts.append({"type": "text", "text": output.text})
    return parts + image_parts(output)


def message(output: RunOutput, image_reply: str) -> dict[str, Any]:
    """The assistant message: images as content parts (``content``, the default) or, with ``images``, the
    text as a string and the images in ``message.images`` (the convention litellm and others read)."""
    if image_reply == "images":
        reply: dict[str, Any] = {"role": "assistant", "content": output.text or ""}
        if output.images:
            reply["images"] = image_parts(output)
        return reply
    return {"role": "assistant", "content": message_content(output)}


def audio_id(request_id: str, index: int) -> str:
    return f"audio_{request_id}_{index}"


def sse(data: dict[str, Any]) -> str:
    return f"data: {json.dumps(data, separators=(',', ':'))}\n\n"


class OpenAIServingChat(OpenAIServing):
    prompt_field = "messages"

    async def create(self, request: ChatCompletionRequest, payload: dict[str, Any], raw: Request | None):
        self.check_model(request.model)
        engine_request = chat_to_engine_request(request, self.context.limits)
        self.check_audio(request, engine_request.modalities)
        fields = {"voice": "audio.voice"}
        last = len(request.messages) - 1
        parts = request.messages[last].audio_parts()
        if parts:  # the engine's refusal of the audio names the first clip
            fields["input_audio"] = f"messages[{last}].content[{parts[0][0]}].input_audio"
        resolved, tracker = self.start_run(engine_request, payload, fields)
        image_reply = request.image_reply or self.context.image_reply
        audio_format = CHAT_FORMATS[request.audio.format if request.audio is not None else "wav"]
        if request.stream:
            include_usage = bool(request.stream_options and request.stream_options.include_usage)
            # A 429 (recorded) now, not an error chunk after a 200, when the client is at its limit or
            # the queue is full; the run itself still enforces both.
            problem = self.runs.admission_problem(self.engine, client_id(raw))
            if problem is not None:
                raise recorded(rejection_error(self.runs.reject(problem, tracker)), tracker)
            return StreamingResponse(
                self.stream(resolved, tracker, include_usage, client_id(raw), image_reply),
                media_type="text/event-stream",
                headers={
                    "Cache-Control": "no-cache",
                    "X-Accel-Buffering": "no",
                    **reply_headers(resolved, tracker),
                },
            )
        result = await self.run_to_completion(resolved, tracker, raw)
        created = now()
        choices = []
        for output in result.outputs:
            reply = message(output, image_reply)
            if output.audio is not None and output.audio.size:  # a reply with nothing to say has none
                try:
                    data = encode_output(output, audio_format, tracker)
                except APIError as exc:
                    raise recorded(exc, tracker) from exc
                reply["audio"] = {
                    "id": audio_id(resolved.request_id, output.index),
                    "data": b64(data),
                    "expires_at": created,  # the server keeps no audio for later turns
                    "transcript": output.text or "",
                }
            choices.append({"index": output.index, "message": reply, "finish_reason": output.finish_reason})
        body: dict[str, Any] = {
            "id": completion_id(),
            "object": "chat.completion",
            "created": created,
            "model": self.served_model_name,
            "choices": choices,
            "usage": usage_of(result),
        }
        if self.system_fingerprint is not None:
            body["system_fingerprint"] = self.system_fingerprint
        if resolved.warnings:
            body["warnings"] = list(resolved.warnings)
        return JSONResponse(body, headers=reply_headers(resolved, tracker))

    def check_audio(
        self, request: ChatCompletionRequest, modalities: tuple[OutputModality, ...] | None
    ) -> None:
        """Audio asked of a model that has no audio stage, an unknown ``audio.voice``, or a stream in a
        format that cannot be streamed: a 400 naming the field and what is allowed."""
        speaks = OutputModality.AUDIO in (modalities or produced(self.engine))
        if request.audio is not None or (modalities and OutputModality.AUDIO in modalities):
            check_speaks(self.engine, self.served_model_name, "modalities" if request.modalities else "audio")
        if request.audio is None:
            return
        check_voice(self.engine, self.served_model_name, voice_name(request.audio.voice), "audio.voice")
        if request.stream and speaks and request.audio.format not in STREAMABLE_CHAT_FORMATS:
            raise APIError(
                400,
                f"audio.format {request.audio.format!r} cannot be streamed: with stream true use "
                f"{' or '.join(STREAMABLE_CHAT_FORMATS)} (the pieces are pcm16 either way), or stream false",
                "audio.format",
                "unsupported_value",
            )

    async def stream(
        self,
        resolved,
        tracker: RunTracking,
        include_usage: bool,
        client: str | None = None,
        image_reply: str = "content",
    ) -> AsyncIterator[str]:
        chunk_id, created = completion_id(), now()
        n = resolved.n

        def chunk(choices: list[dict[str, Any]], **extra: Any) -> str:
            body = {
                "id": chunk_id,
                "object": "chat.completion.chunk",
                "created": created,
                "model": self.served_model_name,
                "choices": choices,
                **extra,
            }
            return sse(body)

        def delta(
            index: int,
            content: Any = None,
            images: list[dict[str, Any]] | None = None,
            audio: dict[str, Any] | None = None,
            **extra: Any,
        ) -> dict[str, Any]:
            d: dict[str, Any] = {} if content is None else {"content": content}
            if images is not None:
                d["images"] = images
            if audio is not None:
                d["audio"] = audio
            return {"index": index, "delta": d, "finish_reason": None, **extra}

        yield chunk(
            [
                {"index": i, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
                for i in range(n)
            ],
            **({"warnings": list(resolved.warnings)} if resolved.warnings else {}),
        )
        finished = False
        events = self.runs.events(
            self.engine, resolved, tracker, stopped="the client disconnected during the stream", client=client
        )
        speaks = OutputModality.AUDIO in resolved.modalities
        try:
            async for event in events:
                if speaks and isinstance(event, (TextDelta, AudioDelta)):
                    ident = {"id": audio_id(resolved.request_id, event.index)}
                    if isinstance(event, TextDelta):  # the text is what is spoken: its transcript too
                        yield chunk(
                            [delta(event.index, event.text, audio={**ident, "transcript": event.text})]
                        )
                    elif event.samples.size:
                        yield chunk([delta(event.index, audio={**ident, "data": pcm16_b64(event.samples)})])
                    continue
                piece = self._event_chunk(event, delta, chunk)
                if piece:
                    yield piece
                if isinstance(event, RunFinished):
                    for output in event.outputs:
                        if speaks and output.audio is not None and output.audio.size:
                            ident = {"id": audio_id(resolved.request_id, output.index)}
                            yield chunk([delta(output.index, audio={**ident, "expires_at": created})])
                        if output.images:  # text already streamed as deltas
                            parts = image_parts(output)
                            if image_reply == "images":
                                yield chunk([delta(output.index, images=parts)])
                            else:
                                yield chunk([delta(output.index, parts)])
                    fingerprint = (
                        {}
                        if self.system_fingerprint is None
                        else {"system_fingerprint": self.system_fingerprint}
                    )
                    terminal = [
                        {"index": o.index, "delta": {}, "finish_reason": o.finish_reason}
                        for o in event.outputs
                    ]
                    if include_usage:
                        yield chunk(terminal)
                        yield chunk([], usage=usage_of(event), **fingerprint)
                    else:
                        yield chunk(terminal, **fingerprint)
                    finished = True
                elif isinstance(event, RunFailed):
                    status = 400 if event.error_type == "invalid_request" else 500
                    error = APIError(status, event.message, None, event.error_type)
                    yield sse(error.body())
                    finished = True
        except RunRejected as exc:  # queue full / engine restarting before anything ran
            yield sse(rejection_error(exc).body())
            finished = True
        finally:
            if not finished:  # the client went away mid-stream
                tracker.fail("the client disconnected during the stream", cancelled=True)
            await events.aclose()  # cancels the engine request if it is still running
        yield "data: [DONE]\n\n"

    @staticmethod
    def _event_chunk(event: EngineEvent, delta, chunk) -> str | None:
        if isinstance(event, TextDelta):
            return chunk([delta(event.index, event.text)])
        if isinstance(event, StageStarted):
            progress = {"stage": event.stage_id, "kind": event.kind, "step": 0, "total": event.total}
            return chunk([delta(event.index)], progress=progress)
        if isinstance(event, (TokenProgress, DiffusionStep)):
            kind = "ar" if isinstance(event, TokenProgress) else "diffusion"
            progress = {"stage": event.stage_id, "kind": kind, "step": event.step, "total": event.total}
            extra: dict[str, Any] = {"progress": progress}
            if isinstance(event, DiffusionStep) and event.preview is not None:
                extra["preview"] = png_data_url(event.preview)
            return chunk([delta(event.index)], **extra)
        return None
