"""Encoding audio once for everything that needs its bytes (API responses, the run store, downloads), and
decoding the audio clients send (docs/speech.md "Audio files").

Samples are float32 mono in -1..1 (code2wav's 24 kHz waveform). Every container is written and read by
libsndfile (through ``soundfile``): WAV and FLAC (16-bit PCM), MP3 (LAME) and Opus in OGG; rates change
only where a format needs another one, through ``soxr``. ``pcm`` is raw little-endian int16, no header.

WAV and FLAC outputs carry the run's recipe as PNGs do (docs/recipes.md): its canonical JSON under the key
``omni_studio`` (the PNG chunk's name), in the file's ``comment`` string (WAV: ``LIST``/``INFO`` ``ICMT``; FLAC: the Vorbis comment ``COMMENT``), with
the prompt as its ``title`` for players. No run id and no clock: the same samples and recipe give the
same bytes in every format (an OGG stream's serial number is derived from the audio, not drawn at random).

The float -> int16 rule, shared by WAV, FLAC, ``pcm`` and the stream helpers: clip to -1..1, multiply by
32767, round half to even (``numpy.rint``). So -1.0 is -32767 and 1.0 is 32767; -32768 is never written.
"""

from __future__ import annotations

import io
import json
import struct
import zlib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import PurePath
from typing import Any

import numpy as np
import soundfile  # type: ignore[import-untyped]  # ships no type information
import soxr  # type: ignore[import-untyped]  # ships no type information (only its C extension has stubs)
from PIL import Image

from studio.media.images import png_bytes

# The key our recipe sits under in a file's comment: the same name as the PNG text chunk (docs/recipes.md).
RECIPE_KEY = "omni_studio"
PCM16_SCALE = 32767  # see the float -> int16 rule above
PCM_RATE = 24000  # OpenAI's `pcm`: 24 kHz s16le mono, no header
OPUS_RATES = (8000, 12000, 16000, 24000, 48000)  # what libopus (and so libsndfile) encodes
MP3_RATES = (8000, 11025, 12000, 16000, 22050, 24000, 32000, 44100, 48000)  # MPEG-1, 2 and 2.5 Layer III
TITLE_CHARS = 100  # the prompt's first line, cut here, is the file's title
# libsndfile caps the buffer it builds a WAV header in and silently drops a string that would need more
# (measured with 1.2.2: a lone comment of 51,195 bytes is written, 51,196 is not), so a WAV recipe stays under this many bytes of
# UTF-8; encode_audio refuses a larger one rather than write a file without it. FLAC keeps its Vorbis
# comments in a metadata block of up to 16 MiB; libsndfile writes and reads back 8 MiB (tested).
RECIPE_MAX_BYTES = {"wav": 48 * 1024, "flac": 8 * 1024 * 1024}


@dataclass(frozen=True)
class AudioFormat:
    """One output format: its ``response_format`` name, HTTP content type, file extension, the sample rates
    it takes (``None``: any) and whether its files carry the recipe."""

    name: str
    content_type: str
    extension: str
    rates: tuple[int, ...] | None
    carries_recipe: bool


AUDIO_FORMATS: Mapping[str, AudioFormat] = {
    "wav": AudioFormat("wav", "audio/wav", ".wav", None, True),
    "flac": AudioFormat("flac", "audio/flac", ".flac", None, True),
    "mp3": AudioFormat("mp3", "audio/mpeg", ".mp3", MP3_RATES, False),
    "opus": AudioFormat("opus", "audio/ogg", ".ogg", OPUS_RATES, False),
    "pcm": AudioFormat("pcm", "audio/pcm", ".pcm", (PCM_RATE,), False),
}
# File extensions -> format: each format's own, and ``.opus`` (RFC 7845's name for an Ogg Opus file).
EXTENSIONS: Mapping[str, str] = {
    **{spec.extension: name for name, spec in AUDIO_FORMATS.items()},
    ".opus": "opus",
}
INPUT_FORMATS = ("wav", "mp3")  # OpenAI's input_audio.format values
# libsndfile's container names (soundfile's ``format``) that each input format covers.
_INPUT_CONTAINERS: Mapping[str, tuple[str, ...]] = {"wav": ("WAV", "WAVEX", "RF64"), "mp3": ("MP3",)}
# (libsndfile container, subtype) per output format; WAV and FLAC are written from int16 samples.
_CONTAINERS: Mapping[str, tuple[str, str]] = {
    "wav": ("WAV", "PCM_16"),
    "flac": ("FLAC", "PCM_16"),
    "mp3": ("MP3", "MPEG_LAYER_III"),
    "opus": ("OGG", "OPUS"),
}


class AudioError(ValueError):
    """Audio this module cannot encode or decode. ``field`` names what was wrong (``input_audio.data``,
    ``format``...), and the message names it and the allowed values; ``too_large`` marks a size or length
    limit (the API answers those with 413, as for images)."""

    def __init__(self, field: str, message: str, *, too_large: bool = False) -> None:
        super().__init__(message)
        self.field = field
        self.too_large = too_large


# -- formats -----------------------------------------------------------------------------------------


def audio_format(fmt: str, field: str = "format") -> AudioFormat:
    """The :class:`AudioFormat` named ``fmt``; :class:`AudioError` naming ``field`` and the formats if none."""
    spec = AUDIO_FORMATS.get(fmt) if isinstance(fmt, str) else None
    if spec is None:
        raise AudioError(field, f"{field} must be one of {', '.join(AUDIO_FORMATS)}; got {fmt!r}")
    return spec


def format_for_filename(name: str, field: str = "--out") -> str:
    """The format an output file name asks for by its extension (``hi.wav`` -> ``wav``, case ignored)."""
    fmt = EXTENSIONS.get(PurePath(name).suffix.lower())
    if fmt is None:
        raise AudioError(
            field,
            f"{field} {name!r}: the file's extension picks the audio format; "
            f"use one of {', '.join(EXTENSIONS)}",
        )
    return fmt


def output_rate(fmt: str, sample_rate: int) -> int:
    """The rate ``fmt``'s file is written at: ``sample_rate`` when the format takes it, else the lowest rate
    it takes above it (the highest when none is), so nothing is thrown away that the format could keep."""
    rates = audio_format(fmt).rates
    if rates is None or sample_rate in rates:
        return sample_rate
    return next((rate for rate in rates if rate > sample_rate), rates[-1])


# -- encoding ----------------------------------------------------------------------------------------


def pcm16(samples: np.ndarray) -> np.ndarray:
    """``samples`` as int16 by the module's rule: clip to -1..1, times 32767, round half to even."""
    clipped = np.clip(np.asarray(samples, dtype=np.float32), -1.0, 1.0)
    return np.rint(clipped * np.float32(PCM16_SCALE)).astype(np.int16)


def encode_audio(
    samples: np.ndarray, sample_rate: int, fmt: str, recipe: Mapping[str, Any] | None = None
) -> bytes:
    """The bytes of an audio file of ``samples`` (float32 mono, -1..1) at ``sample_rate`` in ``fmt``.

    ``fmt`` is one of :data:`AUDIO_FORMATS` (wav, flac, mp3, opus, pcm). A format that does not take
    ``sample_rate`` gets the audio resampled (:func:`output_rate`). ``recipe`` (the run's recipe as a
    JSON object, e.g. ``json.loads(Recipe.to_json())``) goes into WAV and FLAC files (:func:`read_audio_recipe`
    reads it back); the other formats have nowhere to keep it. Deterministic: the same arguments give the
    same bytes. :class:`AudioError` for an unknown format, empty, multi-channel or non-finite samples, a
    bad rate, or a recipe larger than the format keeps.
    """
    spec = audio_format(fmt)
    sample_rate = _checked_rate(sample_rate)
    mono = _checked_samples(samples)
    rate = output_rate(fmt, sample_rate)
    if rate != sample_rate:
        mono = soxr.resample(mono, sample_rate, rate, quality="HQ").astype(np.float32, copy=False)
    if fmt == "pcm":
        return pcm16_chunk(mono)
    comment = _recipe_comment(fmt, recipe) if spec.carries_recipe and recipe is not None else None
    container, subtype = _CONTAINERS[fmt]
    buffer = io.BytesIO()
    with soundfile.SoundFile(
        buffer, "w", samplerate=rate, channels=1, format=container, subtype=subtype
    ) as sound:
        if comment is not None:
            # The short title first: libsndfile's reader gives up on a WAV's INFO list at a string over
            # 2 KiB, so strings before the recipe stay visible to libsndfile-based players.
            title = _title(recipe)
            if title:
                sound.title = title
            sound.comment = comment
        # WAV and FLAC are 16-bit: hand libsndfile the int16 samples so the file holds exactly what
        # `pcm` holds (its own float conversion clips what is below -1 to -32768, not -32767). The
        # lossy encoders take the clipped floats.
        sound.write(pcm16(mono) if subtype == "PCM_16" else np.clip(mono, -1.0, 1.0))
    data = buffer.getvalue()
    if container == "OGG":
        data = _fixed_ogg_serial(data, zlib.crc32(mono.tobytes(), zlib.crc32(struct.pack("<I", rate))))
    return data


def _checked_rate(sample_rate: int) -> int:
    if not isinstance(sample_rate, (int, np.integer)) or isinstance(sample_rate, bool) or sample_rate < 1:
        raise AudioError("sample_rate", f"sample_rate must be a positive integer; got {sample_rate!r}")
    return int(sample_rate)


def _checked_samples(samples: np.ndarray) -> np.ndarray:
    mono = np.asarray(samples, dtype=np.float32)
    if mono.ndim != 1:
        raise AudioError("samples", f"samples must be mono (one dimension); got shape {mono.shape}")
    if mono.size == 0:
        raise AudioError("samples", "samples is empty: there is no audio to encode")
    if not np.isfinite(mono).all():
        raise AudioError("samples", "samples holds values that are not finite numbers (NaN or infinity)")
    return np.ascontiguousarray(mono)


def _recipe_comment(fmt: str, recipe: Mapping[str, Any]) -> str:
    """The file's comment: ``{"omni_studio": recipe}`` as canonical JSON (sorted keys, no spaces, UTF-8)."""
    text = json.dumps(
        {RECIPE_KEY: recipe}, sort_keys=True, ensure_ascii=False, separators=(",", ":"), default=str
    )
    size, limit = len(text.encode()), RECIPE_MAX_BYTES[fmt]
    if size > limit:
        raise AudioError(
            "recipe",
            f"recipe: {size} bytes of JSON do not fit a {fmt.upper()} file's comment "
            f"(at most {limit} bytes); FLAC keeps up to {RECIPE_MAX_BYTES['flac']} bytes",
            too_large=True,
        )
    return text


def _title(recipe: Mapping[str, Any] | None) -> str:
    """The prompt's first line, cut to :data:`TITLE_CHARS` (what players show as the title)."""
    request = recipe.get("request") if recipe is not None else None
    prompt = request.get("prompt") if isinstance(request, Mapping) else None
    if not isinstance(prompt, str):
        return ""
    lines = prompt.strip().splitlines()
    return lines[0][:TITLE_CHARS] if lines else ""


# An OGG page's CRC is CRC-32 with polynomial 0x04C11DB7, no bit reflection, initial value 0 and no final
# XOR; zlib's CRC-32 is the bit-reflected twin, so reflecting every input byte and the result turns one
# into the other. (RFC 3533 section 6: the CRC covers the whole page with its CRC field zeroed.)
_REFLECT_BYTE = bytes(int(f"{i:08b}"[::-1], 2) for i in range(256))


def _ogg_crc(page: bytes) -> int:
    reflected = zlib.crc32(page.translate(_REFLECT_BYTE), 0xFFFFFFFF) ^ 0xFFFFFFFF
    return int(f"{reflected:032b}"[::-1], 2)


def _fixed_ogg_serial(data: bytes, serial: int) -> bytes:
    """``data`` (one OGG logical stream) with every page's serial number set to ``serial``.

    libsndfile gives each stream a random serial number, so two encodes of the same audio differ in those
    4 bytes and in each page's CRC (measured: nothing else differs). RFC 3533 asks only that streams sharing one physical stream have
    different serials; a file here holds one stream, and a serial derived from the audio keeps the bytes a
    function of the input (and differs between different files, should anyone chain them).
    """
    out = bytearray(data)
    pos = 0
    while pos < len(out):
        if out[pos : pos + 4] != b"OggS" or pos + 27 > len(out):
            raise RuntimeError(f"libsndfile wrote an OGG page we cannot read at byte {pos}")
        segments = out[pos + 26]
        end = pos + 27 + segments + sum(out[pos + 27 : pos + 27 + segments])
        out[pos + 14 : pos + 18] = struct.pack("<I", serial)
        out[pos + 22 : pos + 26] = b"\0\0\0\0"
        out[pos + 22 : pos + 26] = struct.pack("<I", _ogg_crc(bytes(out[pos:end])))
        pos = end
    return bytes(out)


# -- reading the recipe back -----------------------------------------------------------------------


def read_audio_recipe(data: bytes) -> dict[str, Any] | None:
    """The recipe :func:`encode_audio` wrote into a WAV or FLAC file, or ``None`` when the bytes hold none
    (another format, another program's comment, not audio at all).

    WAV is read chunk by chunk here because libsndfile's reader skips ``INFO`` strings over 2 KiB (a
    recipe with its pipeline config is longer); FLAC's Vorbis comments are read by libsndfile.
    """
    if data[:4] == b"RIFF" and data[8:12] == b"WAVE":
        comment = _riff_info(data).get(b"ICMT")
    elif data[:4] == b"fLaC":
        try:
            with soundfile.SoundFile(io.BytesIO(data)) as sound:
                comment = sound.comment or None
        except (soundfile.LibsndfileError, RuntimeError):
            return None
    else:
        return None
    if not comment:
        return None
    try:
        body = json.loads(comment)
    except ValueError:
        return None
    recipe = body.get(RECIPE_KEY) if isinstance(body, dict) else None
    return recipe if isinstance(recipe, dict) else None


def _riff_info(data: bytes) -> dict[bytes, str]:
    """The ``LIST``/``INFO`` strings of a RIFF WAVE file (id -> text without its NUL padding)."""
    strings: dict[bytes, str] = {}
    pos = 12
    while pos + 8 <= len(data):
        chunk, size = data[pos : pos + 4], struct.unpack("<I", data[pos + 4 : pos + 8])[0]
        body = data[pos + 8 : pos + 8 + size]
        if chunk == b"LIST" and body[:4] == b"INFO":
            inner = 4
            while inner + 8 <= len(body):
                key, length = body[inner : inner + 4], struct.unpack("<I", body[inner + 4 : inner + 8])[0]
                strings[key] = body[inner + 8 : inner + 8 + length].rstrip(b"\0").decode("utf-8", "replace")
                inner += 8 + length + (length & 1)
        pos += 8 + size + (size & 1)  # chunks are padded to an even length
    return strings


# -- streaming ---------------------------------------------------------------------------------------


def pcm16_chunk(samples: np.ndarray) -> bytes:
    """A piece of a pcm16 stream: ``samples`` (float32 mono) as little-endian int16 bytes, at their own
    rate (no resampling: the stream's rate is the model's, 24 kHz for code2wav). The float -> int16 rule is
    the module's, so the pieces of a stream join into the very bytes ``encode_audio(..., "pcm")`` makes."""
    return pcm16(samples).astype("<i2").tobytes()


_UNKNOWN_SIZE = 0xFFFFFFFF


def streaming_wav_header(sample_rate: int) -> bytes:
    """The 44-byte header of a 16-bit mono WAV stream whose length is not known yet (``stream_format:
    audio`` with ``wav``); :func:`pcm16_chunk` pieces follow it.

    The ``RIFF`` and ``data`` sizes are 0xFFFFFFFF, the largest a 32-bit field holds, because they cannot
    be filled in after the bytes have left; it is the usual marker of a WAV of unknown length. Players and
    decoders read it as "data runs to the end of the stream": they play what arrives and stop at the end
    of the connection (libsndfile notes the mismatch and takes the data's real length; tested). A file
    saved from the stream plays the same way; a tool that trusts the sizes may call it damaged.
    """
    sample_rate = _checked_rate(sample_rate)
    channels, bits = 1, 16
    block = channels * bits // 8
    fmt_chunk = struct.pack(
        "<4sIHHIIHH", b"fmt ", 16, 1, channels, sample_rate, sample_rate * block, block, bits
    )
    return (
        struct.pack("<4sI4s", b"RIFF", _UNKNOWN_SIZE, b"WAVE")
        + fmt_chunk
        + struct.pack("<4sI", b"data", _UNKNOWN_SIZE)
    )


# -- decoding what clients send ----------------------------------------------------------------------


def decode_input_audio(
    data: bytes,
    fmt: str,
    *,
    max_bytes: int,
    max_seconds: float,
    target_rate: int = 16000,
    field: str = "input_audio",
) -> np.ndarray:
    """An ``input_audio`` part's audio as float32 mono at ``target_rate`` (16 kHz: what Whisper's feature
    extractor takes): channels mixed down by their mean, the rate changed by soxr.

    ``fmt`` is OpenAI's ``input_audio.format`` (wav or mp3) and must match what the bytes are. Errors are
    :class:`AudioError` naming ``{field}.format`` or ``{field}.data``: an unknown format, bytes that are not
    that format, more than ``max_bytes`` bytes or ``max_seconds`` seconds (``too_large``), no audio.
    """
    format_field, data_field = f"{field}.format", f"{field}.data"
    if fmt not in INPUT_FORMATS:
        raise AudioError(
            format_field, f"{format_field} must be one of {', '.join(INPUT_FORMATS)}; got {fmt!r}"
        )
    if len(data) > max_bytes:
        raise AudioError(
            data_field, f"{data_field} is {len(data)} bytes; the limit is {max_bytes} bytes", too_large=True
        )
    try:
        with soundfile.SoundFile(io.BytesIO(data)) as sound:
            container, rate = sound.format, int(sound.samplerate)
            if container not in _INPUT_CONTAINERS[fmt]:
                raise AudioError(
                    format_field,
                    f"{format_field} is {fmt!r} but {data_field} holds a {container} file; "
                    f"send one of {', '.join(INPUT_FORMATS)} and name it",
                )
            # Read at most one frame past the limit, so a long (or lying) file costs no more than that.
            limit = int(max_seconds * rate)
            frames = sound.read(frames=limit + 1, dtype="float32", always_2d=True)
    except (soundfile.LibsndfileError, RuntimeError, EOFError) as exc:
        raise AudioError(data_field, f"{data_field} is not a readable {fmt} file ({exc})") from None
    if len(frames) > limit:
        raise AudioError(
            data_field,
            f"{data_field} is longer than {max_seconds:g} seconds, the limit for input audio",
            too_large=True,
        )
    if len(frames) == 0:
        raise AudioError(data_field, f"{data_field} holds no audio (0 samples)")
    if not np.isfinite(frames).all():
        raise AudioError(data_field, f"{data_field} holds samples that are not finite numbers")
    mono = frames.mean(axis=1, dtype=np.float32)
    if rate != target_rate:
        mono = soxr.resample(mono, rate, target_rate, quality="HQ")
    return np.ascontiguousarray(mono, dtype=np.float32)


# -- summaries and pictures --------------------------------------------------------------------------


def audio_summary(samples: np.ndarray, sample_rate: int) -> dict[str, float]:
    """``duration_s``, ``peak`` (largest absolute sample) and ``rms`` of float32 mono ``samples``, for
    history listings (0 for no samples)."""
    mono = np.asarray(samples, dtype=np.float64).reshape(-1)
    if mono.size == 0:
        return {"duration_s": 0.0, "peak": 0.0, "rms": 0.0}
    return {
        "duration_s": mono.size / sample_rate,
        "peak": float(np.abs(mono).max()),
        "rms": float(np.sqrt(np.mean(mono * mono))),
    }


WAVE_COLOR = (37, 99, 235)
BACKGROUND = (255, 255, 255)
SECOND_TICK = (226, 232, 240)
MIN_TICK_SPACING = 8  # pixels between whole-second ticks, below which they are left out


def waveform_png(samples: np.ndarray, sample_rate: int, width: int, height: int) -> bytes:
    """A ``width`` x ``height`` PNG of ``samples``: each pixel column spans the smallest to the largest
    sample of its slice of time (+1 at the top, -1 at the bottom, silence a line through the middle),
    with faint ticks at whole seconds when they are at least :data:`MIN_TICK_SPACING` pixels apart."""
    if width < 1 or height < 1:
        raise AudioError("size", f"width and height must be at least 1 pixel; got {width}x{height}")
    mono = np.clip(np.asarray(samples, dtype=np.float32).reshape(-1), -1.0, 1.0)
    pixels = np.empty((height, width, 3), dtype=np.uint8)
    pixels[:] = BACKGROUND
    if mono.size == 0:
        return png_bytes(Image.fromarray(pixels, "RGB"))
    seconds = mono.size / sample_rate
    if width / seconds >= MIN_TICK_SPACING:
        for second in range(1, int(seconds) + 1):
            column = int(second / seconds * width)
            if column < width:
                pixels[:, column] = SECOND_TICK
    # Column c covers samples [c * n // width, (c + 1) * n // width), at least one sample each.
    starts = (np.arange(width) * mono.size) // width
    highs, lows = np.maximum.reduceat(mono, starts), np.minimum.reduceat(mono, starts)
    top = np.rint((1.0 - highs) / 2.0 * (height - 1)).astype(np.int64)
    bottom = np.rint((1.0 - lows) / 2.0 * (height - 1)).astype(np.int64)
    rows = np.arange(height)[:, None]
    pixels[(rows >= top[None, :]) & (rows <= bottom[None, :])] = WAVE_COLOR
    return png_bytes(Image.fromarray(pixels, "RGB"))


__all__ = [
    "AUDIO_FORMATS",
    "EXTENSIONS",
    "INPUT_FORMATS",
    "PCM_RATE",
    "RECIPE_KEY",
    "RECIPE_MAX_BYTES",
    "AudioError",
    "AudioFormat",
    "audio_format",
    "audio_summary",
    "decode_input_audio",
    "encode_audio",
    "format_for_filename",
    "output_rate",
    "pcm16",
    "pcm16_chunk",
    "read_audio_recipe",
    "streaming_wav_header",
    "waveform_png",
]
