"""Turning API payloads into engine requests: messages, data-URL images, sizes, generation fields."""

from __future__ import annotations

import base64
import binascii
import io
from typing import Any

from PIL import Image, UnidentifiedImageError

from engine import ChatTurn, GenerationParams, GenerationRequest
from engine.modality import OutputModality
from studio.api.audio_io import input_audio_clips, voice_name
from studio.api.errors import APIError
from studio.api.protocol import SIZE_PATTERN, ChatCompletionRequest
from studio.startup.limits import InputLimits


def decode_image_bytes(data: bytes, param: str, limits: InputLimits) -> Image.Image:
    """Bytes -> RGB PIL image; 413 when too large, 422 when not an image."""
    if len(data) > limits.max_image_bytes:
        raise APIError(
            413, f"{param}: the image is {len(data)} bytes; the limit is {limits.max_image_bytes}", param
        )
    try:
        with Image.open(io.BytesIO(data)) as opened:
            if opened.width * opened.height > limits.max_image_pixels:
                raise APIError(
                    413,
                    f"{param}: the image is {opened.width}x{opened.height}; the limit is "
                    f"{limits.max_image_pixels} pixels",
                    param,
                )
            opened.load()
            return opened.convert("RGB")
    except (UnidentifiedImageError, OSError, Image.DecompressionBombError) as exc:
        raise APIError(
            422, f"{param}: the data is not a decodable image ({exc})", param, "invalid_image"
        ) from exc


def decode_data_url(url: str, param: str, limits: InputLimits) -> Image.Image:
    if url.startswith(("http://", "https://")):
        raise APIError(
            400, f"{param}: only data: URLs are supported (this server does not fetch remote images)", param
        )
    if not url.startswith("data:"):
        raise APIError(400, f"{param}: expected a data:image/...;base64,... URL", param)
    header, sep, payload = url.partition(",")
    if not sep or ";base64" not in header or not header[5:].startswith("image/"):
        raise APIError(400, f"{param}: expected a base64 data:image/... URL (got {header[:40]!r})", param)
    if len(payload) * 3 // 4 > limits.max_image_bytes:
        raise APIError(413, f"{param}: the image is larger than {limits.max_image_bytes} bytes", param)
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise APIError(400, f"{param}: invalid base64 data ({exc})", param) from exc
    return decode_image_bytes(data, param, limits)


def first_lone_surrogate(text: str) -> int | None:
    """Where ``text`` holds a lone UTF-16 surrogate (JSON's ``"\\ud800"``), which is not Unicode text."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        return exc.start
    return None


def check_json_depth(data: Any, limits: InputLimits) -> None:
    """Arrays and objects nested within ``limits.max_json_depth`` (walked without recursion)."""
    stack: list[tuple[Any, str, int]] = [(data, "", 1)]
    while stack:
        item, path, depth = stack.pop()
        if isinstance(item, (dict, list)) and depth > limits.max_json_depth:
            raise APIError(
                400,
                f"The JSON body nests deeper than {limits.max_json_depth} levels (at {path or 'the top'}; "
                "--max-json-depth)",
                None,
                "json_too_deep",
            )
        if isinstance(item, dict):
            stack.extend(
                (child, f"{path}.{key}" if path else str(key), depth + 1) for key, child in item.items()
            )
        elif isinstance(item, list):
            stack.extend((child, f"{path}[{i}]", depth + 1) for i, child in enumerate(item))


def check_json_text(data: Any) -> None:
    """Every string and key is valid Unicode text (no lone surrogates); the error names its path."""
    stack: list[tuple[Any, str]] = [(data, "")]
    while stack:
        item, path = stack.pop()
        if isinstance(item, dict):
            for key, child in item.items():
                if first_lone_surrogate(key) is not None:
                    raise _surrogate_error(path or "body", key)
                stack.append((child, f"{path}.{key}" if path else key))
        elif isinstance(item, list):
            stack.extend((child, f"{path}[{i}]") for i, child in enumerate(item))
        elif isinstance(item, str) and first_lone_surrogate(item) is not None:
            raise _surrogate_error(path, item)


def _surrogate_error(param: str, text: str) -> APIError:
    index = first_lone_surrogate(text) or 0
    return APIError(
        400,
        f"{param}: contains a lone surrogate (U+{ord(text[index]):04X} at character {index}), which is not "
        "valid Unicode text; send the text as UTF-8 (in JSON, surrogates only in valid \\ud83d\\ude00 pairs)",
        param,
        "invalid_text",
    )


def check_text(text: str | None, param: str, limits: InputLimits) -> None:
    if text is not None and len(text) > limits.max_prompt_chars:
        raise APIError(
            400,
            f"{param} is {len(text)} characters; the limit is {limits.max_prompt_chars} (--max-prompt-chars)",
            param,
            "prompt_too_long",
        )


def check_generation_limits(fields: dict[str, Any], limits: InputLimits) -> None:
    """``n``, steps, width/height and the negative prompt against the server's limits (400 naming each)."""
    bounds = (
        ("n", limits.max_n, "--max-n"),
        ("num_inference_steps", limits.max_steps, "--max-steps"),
        ("height", limits.max_image_side, "--max-image-side"),
        ("width", limits.max_image_side, "--max-image-side"),
    )
    for key, limit, flag in bounds:
        value = fields.get(key)
        if isinstance(value, int) and value > limit:
            raise APIError(400, f"{key} is {value}; the limit is {limit} ({flag})", key, "over_limit")
    check_text(fields.get("negative_prompt"), "negative_prompt", limits)


def parse_size(size: str | None, fields: dict[str, Any], param: str = "size") -> None:
    """``'WxH'`` -> ``fields['width'/'height']``; a conflict with explicit height/width is an error."""
    if size is None or size == "auto":
        return
    match = SIZE_PATTERN.match(size)
    if match is None:
        raise APIError(400, f"{param} must be 'WIDTHxHEIGHT', e.g. '1024x1024'", param)
    width, height = int(match.group(1)), int(match.group(2))
    for key, value in (("width", width), ("height", height)):
        if fields.get(key) is not None and fields[key] != value:
            raise APIError(400, f"{param} {size!r} disagrees with {key}={fields[key]}", param)
        fields[key] = value


def params_from_fields(fields: dict[str, Any]) -> GenerationParams:
    return GenerationParams(
        seed=fields.get("seed"),
        height=fields.get("height"),
        width=fields.get("width"),
        num_inference_steps=fields.get("num_inference_steps"),
        guidance_scale=fields.get("guidance_scale"),
        negative_prompt=fields.get("negative_prompt"),
        max_tokens=fields.get("max_tokens"),
        temperature=fields.get("temperature"),
        top_p=fields.get("top_p"),
        top_k=fields.get("top_k"),
        n=fields.get("n") or 1,
        preview_every=fields.get("preview_every") or 0,
        voice=fields.get("voice"),
    )


def chat_modalities(request: ChatCompletionRequest) -> tuple[OutputModality, ...] | None:
    """The modalities a chat request asks for: its ``modalities``; text and audio when it gives only
    ``audio``; ``None`` (the model's default) when it gives neither. ``audio`` without ``audio`` among the
    modalities is a 400 naming ``audio``."""
    if request.modalities:
        modalities = tuple(OutputModality(m) for m in request.modalities)
        if request.audio is not None and OutputModality.AUDIO not in modalities:
            raise APIError(
                400,
                f"audio is only read when modalities includes 'audio' (got {request.modalities}); add "
                "'audio' to modalities or drop audio",
                "audio",
            )
        return modalities
    if request.audio is not None:
        return (OutputModality.TEXT, OutputModality.AUDIO)
    return None


def chat_to_engine_request(request: ChatCompletionRequest, limits: InputLimits) -> GenerationRequest:
    """The newest user message is the prompt (its image the I2I source, its ``input_audio`` parts the
    audio the model hears); earlier turns are history."""
    if len(request.messages) > limits.max_messages:
        raise APIError(
            400,
            f"messages has {len(request.messages)} entries; the limit is {limits.max_messages} (--max-messages)",
            "messages",
            "over_limit",
        )
    for index, message in enumerate(request.messages):
        check_text(message.text(), f"messages[{index}].content", limits)
    last = request.messages[-1]
    if last.role != "user":
        raise APIError(400, f"the last message must come from the user (got role {last.role!r})", "messages")
    images = last.image_urls()
    if len(images) > 1:
        raise APIError(400, f"at most one image per request (got {len(images)})", "messages")
    index = len(request.messages) - 1
    image = decode_data_url(images[0], f"messages[{index}].content.image_url", limits) if images else None
    prompt = last.text()
    _, clips = input_audio_clips(request, limits)
    if not prompt.strip() and image is None and not clips:
        raise APIError(400, "the last user message has no text", "messages")
    history = tuple(
        ChatTurn("system" if m.role == "developer" else m.role, m.text()) for m in request.messages[:-1]
    )
    fields = request.generation()
    parse_size(fields.pop("size", None), fields)
    check_generation_limits(fields, limits)
    if request.audio is not None:
        fields["voice"] = voice_name(request.audio.voice)
    extra: dict[str, Any] = {"input_audio": tuple(clips)} if clips else {}
    return GenerationRequest(
        prompt,
        params_from_fields(fields),
        image=image,
        history=history,
        modalities=chat_modalities(request),
        **extra,
    )
