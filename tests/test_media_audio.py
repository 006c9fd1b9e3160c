"""studio/media/audio.py: audio files as a listener gets them (docs/speech.md "Audio files").

Every test encodes real bytes with libsndfile and decodes them again with soundfile: lossless formats are
compared sample for sample after the int16 rule, lossy ones by SNR and pitch.
"""

from __future__ import annotations

import hashlib
import io
import json
import struct
import subprocess
import sys
from typing import Any

import numpy as np
import pytest
import soundfile
from PIL import Image

from studio.media.audio import (
    AUDIO_FORMATS,
    PCM_RATE,
    RECIPE_MAX_BYTES,
    AudioError,
    audio_summary,
    decode_input_audio,
    encode_audio,
    format_for_filename,
    pcm16_chunk,
    read_audio_recipe,
    streaming_wav_header,
    waveform_png,
)
from tests.conftest import REPO_ROOT

RATE = 24000  # code2wav's rate


def tone(seconds: float = 1.0, rate: int = RATE, freq: float = 440.0, amp: float = 0.5) -> np.ndarray:
    t = np.arange(int(seconds * rate)) / rate
    return (amp * np.sin(2 * np.pi * freq * t)).astype(np.float32)


def decode(data: bytes, dtype: str = "float32") -> tuple[np.ndarray, int, Any]:
    with soundfile.SoundFile(io.BytesIO(data)) as sound:
        return sound.read(dtype=dtype), sound.samplerate, sound.copy_metadata()


def snr_db(reference: np.ndarray, decoded: np.ndarray) -> float:
    n = min(len(reference), len(decoded))
    ref, out = reference[:n].astype(np.float64), decoded[:n].astype(np.float64)
    return float(10 * np.log10(np.sum(ref**2) / np.sum((ref - out) ** 2)))


def pitch(samples: np.ndarray, rate: int) -> float:
    spectrum = np.abs(np.fft.rfft(samples.astype(np.float64)))
    return float(np.argmax(spectrum) * rate / len(samples))


def riff_chunks(data: bytes) -> list[tuple[bytes, bytes]]:
    chunks, pos = [], 12
    while pos + 8 <= len(data):
        cid, size = data[pos : pos + 4], struct.unpack("<I", data[pos + 4 : pos + 8])[0]
        chunks.append((cid, data[pos + 8 : pos + 8 + size]))
        pos += 8 + size + (size & 1)
    return chunks


def info_ids(data: bytes) -> list[bytes]:
    (info,) = [body for cid, body in riff_chunks(data) if cid == b"LIST"]
    ids, pos = [], 4
    while pos + 8 <= len(info):
        size = struct.unpack("<I", info[pos + 4 : pos + 8])[0]
        ids.append(info[pos : pos + 4])
        pos += 8 + size + (size & 1)
    return ids


def sample_recipe(prompt: str = "say hello, café 你好\nsecond line") -> dict[str, Any]:
    """A recipe as RunRecipe makes it (json.loads(Recipe.to_json())), with a pipeline config as long as a
    three-stage one (over libsndfile's 2 KiB INFO reading limit)."""
    stage = {"engine_args": {"max_num_seqs": 4, "dtype": "float32"}, "kind": "ar", "model": "tiny"}
    return {
        "recipe": 1,
        "studio_version": "0.1.0",
        "model": "tiny-qwen-omni",
        "request": {"prompt": prompt},
        "parameters": {"seed": 7, "n": 1, "voice": "Ethan", "modalities": ["text", "audio"]},
        "config_hash": "ab" * 32,
        "config": {"stages": [dict(stage, stage_id=i, note="x" * 900) for i in range(3)]},
        "fingerprint": "omni-studio-test",
    }


# -- lossless formats --------------------------------------------------------------------------------


EDGES = np.array([0.0, 1.0, -1.0, 1.5, -2.0, 0.5, -0.5, 0.25], dtype=np.float32)
EDGES_INT16 = [0, 32767, -32767, 32767, -32767, 16384, -16384, 8192]  # clip, x32767, round half to even


@pytest.mark.parametrize("fmt", ["wav", "flac"])
def test_wav_and_flac_hold_the_int16_samples_that_pcm_holds(fmt):
    samples = np.concatenate([EDGES, tone(0.5)])
    data = encode_audio(samples, RATE, fmt, None)
    decoded, rate, _ = decode(data, "int16")
    assert rate == RATE and decoded.dtype == np.int16
    assert decoded[: len(EDGES)].tolist() == EDGES_INT16
    pcm = np.frombuffer(encode_audio(samples, RATE, "pcm", None), dtype="<i2")
    assert np.array_equal(decoded, pcm)  # every lossless copy holds the same samples


def test_pcm_is_24khz_int16_without_a_header():
    samples = tone(0.5, rate=16000)
    data = encode_audio(samples, 16000, "pcm", None)
    pcm = np.frombuffer(data, dtype="<i2")
    assert len(pcm) == PCM_RATE // 2  # 0.5 s at OpenAI's 24 kHz, resampled from 16 kHz
    assert pitch(pcm, PCM_RATE) == pytest.approx(440, abs=2)
    at_rate = encode_audio(EDGES, PCM_RATE, "pcm", None)
    assert np.frombuffer(at_rate, dtype="<i2").tolist() == EDGES_INT16  # no header: the samples alone


# -- lossy formats ------------------------------------------------------------------------------------


@pytest.mark.parametrize(("fmt", "container"), [("mp3", "MP3"), ("opus", "OGG")])
def test_lossy_formats_decode_close_to_the_input(fmt, container):
    samples = tone(1.0)
    data = encode_audio(samples, RATE, fmt, sample_recipe())
    info = soundfile.info(io.BytesIO(data))
    assert info.format == container and info.samplerate == RATE
    decoded, _, _ = decode(data)
    assert abs(len(decoded) - len(samples)) <= RATE // 50
    assert snr_db(samples, decoded) > 10
    assert pitch(decoded, RATE) == pytest.approx(440, abs=2)
    assert read_audio_recipe(data) is None  # only WAV and FLAC carry the recipe


@pytest.mark.parametrize(
    ("fmt", "rate", "written"),
    [("opus", 44100, 48000), ("opus", 22050, 24000), ("mp3", 22050, 22050), ("mp3", 96000, 48000)],
)
def test_a_rate_the_format_lacks_is_resampled(fmt, rate, written):
    data = encode_audio(tone(1.0, rate=rate), rate, fmt, None)
    decoded, decoded_rate, _ = decode(data)
    assert decoded_rate == written
    assert abs(len(decoded) - written) <= written // 50
    assert pitch(decoded, written) == pytest.approx(440, abs=2)


# -- the recipe ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["wav", "flac"])
def test_wav_and_flac_carry_the_recipe_and_the_prompt_as_title(fmt):
    recipe = sample_recipe()
    assert len(json.dumps(recipe)) > 2048
    data = encode_audio(tone(0.2), RATE, fmt, recipe)
    assert read_audio_recipe(data) == recipe
    _, _, metadata = decode(data)
    assert metadata["title"] == "say hello, café 你好"  # what players show: the prompt's first line
    assert read_audio_recipe(encode_audio(tone(0.2), RATE, fmt, None)) is None


def test_files_without_our_recipe_read_as_none():
    buffer = io.BytesIO()
    with soundfile.SoundFile(buffer, "w", samplerate=RATE, channels=1, format="WAV") as sound:
        sound.comment = "recorded in the kitchen"
        sound.write(tone(0.1))
    assert read_audio_recipe(buffer.getvalue()) is None
    buffer = io.BytesIO()
    with soundfile.SoundFile(buffer, "w", samplerate=RATE, channels=1, format="FLAC") as sound:
        sound.comment = json.dumps({"other_tool": {"a": 1}})
        sound.write(tone(0.1))
    assert read_audio_recipe(buffer.getvalue()) is None
    assert read_audio_recipe(b"not audio at all") is None
    assert read_audio_recipe(b"RIFF\x10\x00\x00\x00WAVELIST\xff\xff") is None  # cut short
    assert read_audio_recipe(b"fLaC\x00\x00") is None


def test_a_recipe_is_kept_up_to_the_format_limit_and_refused_past_it():
    recipe = sample_recipe(prompt="語" * 100 + "\n")  # the longest title too (300 bytes)
    base = len(json.dumps({"omni_studio": recipe}, ensure_ascii=False, separators=(",", ":")).encode())
    recipe["parameters"]["pad"] = ""
    room = RECIPE_MAX_BYTES["wav"] - base - len(',"pad":""')
    recipe["parameters"]["pad"] = "p" * room
    data = encode_audio(tone(0.1), RATE, "wav", recipe)
    assert read_audio_recipe(data) == recipe
    recipe["parameters"]["pad"] += "p"
    with pytest.raises(AudioError, match=f"at most {RECIPE_MAX_BYTES['wav']} bytes") as error:
        encode_audio(tone(0.1), RATE, "wav", recipe)
    assert error.value.field == "recipe" and error.value.too_large
    recipe["parameters"]["pad"] = "p" * (RECIPE_MAX_BYTES["flac"] - base - len(',"pad":""'))
    assert read_audio_recipe(encode_audio(tone(0.1), RATE, "flac", recipe)) == recipe


# -- determinism ---------------------------------------------------------------------------------------


def test_no_clock_in_the_files():
    recipe = sample_recipe()
    wav = encode_audio(tone(0.2), RATE, "wav", recipe)
    assert [cid for cid, _ in riff_chunks(wav)] == [b"fmt ", b"LIST", b"data"]
    assert info_ids(wav) == [b"INAM", b"ICMT"]  # no ICRD (date) or ISFT
    _, _, flac_tags = decode(encode_audio(tone(0.2), RATE, "flac", recipe))
    assert set(flac_tags) == {"title", "comment"}  # no DATE


_HASHES = """
import hashlib, json, sys
import numpy as np
from studio.media.audio import AUDIO_FORMATS, encode_audio
t = np.arange(12000) / 24000
samples = (0.5 * np.sin(2 * np.pi * 440.0 * t)).astype(np.float32)  # tone(0.5), computed the same way
recipe = json.loads(sys.argv[1])
print(json.dumps({f: hashlib.sha256(encode_audio(samples, 24000, f, recipe)).hexdigest() for f in AUDIO_FORMATS}))
"""


def test_same_input_same_bytes_in_every_format_and_process():
    here = {f: encode_audio(tone(0.5), RATE, f, sample_recipe()) for f in AUDIO_FORMATS}
    again = {f: encode_audio(tone(0.5), RATE, f, sample_recipe()) for f in AUDIO_FORMATS}
    assert here == again  # libsndfile draws a random OGG serial; ours is fixed
    other = subprocess.run(
        [sys.executable, "-c", _HASHES, json.dumps(sample_recipe())],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    assert json.loads(other.stdout) == {f: hashlib.sha256(data).hexdigest() for f, data in here.items()}
    assert encode_audio(tone(0.5, amp=0.4), RATE, "opus", None) != here["opus"]


# -- formats, names and errors ----------------------------------------------------------------------


def test_formats_table_and_file_names():
    assert {f: (s.content_type, s.extension) for f, s in AUDIO_FORMATS.items()} == {
        "wav": ("audio/wav", ".wav"),
        "flac": ("audio/flac", ".flac"),
        "mp3": ("audio/mpeg", ".mp3"),
        "opus": ("audio/ogg", ".ogg"),
        "pcm": ("audio/pcm", ".pcm"),
    }
    assert [
        format_for_filename(n) for n in ("hi.wav", "out/HI.FLAC", "a.mp3", "b.ogg", "c.opus", "d.pcm")
    ] == [
        "wav",
        "flac",
        "mp3",
        "opus",
        "opus",
        "pcm",
    ]
    for name in ("hi.mp4", "hi", "wav"):
        with pytest.raises(
            AudioError, match=r"--out .*use one of \.wav, \.flac, \.mp3, \.ogg, \.pcm, \.opus"
        ) as error:
            format_for_filename(name)
        assert error.value.field == "--out"


@pytest.mark.parametrize(
    ("samples", "rate", "fmt", "field", "message"),
    [
        (tone(0.1), RATE, "aac", "format", "format must be one of wav, flac, mp3, opus, pcm; got 'aac'"),
        (np.zeros(0, np.float32), RATE, "wav", "samples", "no audio to encode"),
        (np.zeros((10, 2), np.float32), RATE, "wav", "samples", r"mono .*\(10, 2\)"),
        (np.array([0.1, np.nan], np.float32), RATE, "flac", "samples", "not finite"),
        (tone(0.1), 0, "wav", "sample_rate", "positive integer; got 0"),
    ],
)
def test_encoding_errors_name_the_field(samples, rate, fmt, field, message):
    with pytest.raises(AudioError, match=message) as error:
        encode_audio(samples, rate, fmt, None)
    assert error.value.field == field


# -- streaming -------------------------------------------------------------------------------------------


def test_a_streamed_wav_plays_as_the_whole_file():
    samples = np.concatenate([EDGES, tone(0.7)])
    header = streaming_wav_header(RATE)
    assert len(header) == 44 and struct.unpack("<I", header[4:8]) == struct.unpack("<I", header[40:44]) == (
        0xFFFFFFFF,
    )
    pieces = [pcm16_chunk(piece) for piece in np.array_split(samples, 7)]  # as the talker's chunks arrive
    stream = header + b"".join(pieces)
    decoded, rate, _ = decode(stream, "int16")
    assert rate == RATE
    assert np.array_equal(decoded, np.frombuffer(encode_audio(samples, RATE, "pcm", None), dtype="<i2"))
    assert decoded[: len(EDGES)].tolist() == EDGES_INT16
    whole, _, _ = decode(encode_audio(samples, RATE, "wav", None), "int16")
    assert np.array_equal(decoded, whole)


# -- audio in ------------------------------------------------------------------------------------------


LIMITS = {"max_bytes": 10_000_000, "max_seconds": 30}


def wav_bytes(samples: np.ndarray, rate: int, subtype: str = "PCM_16") -> bytes:
    buffer = io.BytesIO()
    soundfile.write(buffer, samples, rate, format="WAV", subtype=subtype)
    return buffer.getvalue()


def test_stereo_44k_wav_becomes_mono_16k():
    left, right = tone(1.0, 44100, amp=0.6), tone(1.0, 44100, amp=0.2)
    audio = decode_input_audio(wav_bytes(np.stack([left, right], axis=1), 44100), "wav", **LIMITS)
    assert audio.dtype == np.float32 and audio.ndim == 1 and len(audio) == 16000
    assert pitch(audio, 16000) == pytest.approx(440, abs=2)
    middle = audio[1000:-1000]  # away from the resampler's edges
    assert np.sqrt(np.mean(middle**2)) == pytest.approx(0.4 / np.sqrt(2), rel=0.01)  # the channels' mean


def test_mp3_input_is_decoded_and_resampled():
    data = encode_audio(tone(1.0), RATE, "mp3", None)
    audio = decode_input_audio(data, "mp3", **LIMITS, target_rate=16000)
    assert abs(len(audio) - 16000) <= 320 and pitch(audio, 16000) == pytest.approx(440, abs=2)
    ints = (np.arange(-5000, 5000) * 3).astype(np.int16)
    same_rate = decode_input_audio(wav_bytes(ints, RATE), "wav", **LIMITS, target_rate=RATE)
    assert np.array_equal(same_rate, ints / np.float32(32768))  # no resampling at the target rate


def test_input_audio_errors_name_the_field_and_the_limit():
    field = "messages[0].content[1].input_audio"
    cases: list[tuple[bytes, str, dict[str, Any], str, str, bool]] = [
        (wav_bytes(tone(0.1), RATE), "ogg", {}, "format", "must be one of wav, mp3; got 'ogg'", False),
        (b"\x00" * 400, "wav", {}, "data", "is not a readable wav file", False),
        (b"", "mp3", {}, "data", "is not a readable mp3 file", False),
        (
            encode_audio(tone(0.5), RATE, "mp3", None),
            "wav",
            {},
            "format",
            "is 'wav' but .* holds a MP3 file",
            False,
        ),
        (wav_bytes(tone(0.1), RATE), "mp3", {}, "format", "is 'mp3' but .* holds a WAV file", False),
        (
            wav_bytes(tone(1.0), RATE),
            "wav",
            {"max_bytes": 1000},
            "data",
            "is 48044 bytes; the limit is 1000 bytes",
            True,
        ),
        (wav_bytes(tone(3.0), RATE), "wav", {"max_seconds": 2.5}, "data", "is longer than 2.5 seconds", True),
        (wav_bytes(np.zeros(0, np.float32), RATE), "wav", {}, "data", "holds no audio", False),
        (
            wav_bytes(np.array([0.1, np.inf], np.float32), RATE, "FLOAT"),
            "wav",
            {},
            "data",
            "holds samples that are not finite",
            False,
        ),
    ]
    for data, fmt, limits, part, message, too_large in cases:
        with pytest.raises(AudioError, match=f"{part} {message}") as error:
            decode_input_audio(data, fmt, **{**LIMITS, **limits}, field=field)
        assert (error.value.field, error.value.too_large) == (f"{field}.{part}", too_large), message
    assert (
        len(decode_input_audio(wav_bytes(tone(2.5), RATE), "wav", max_bytes=10**7, max_seconds=2.5)) == 40000
    )


# -- summaries and pictures --------------------------------------------------------------------------


def test_audio_summary():
    summary = audio_summary(np.concatenate([tone(1.0), np.zeros(RATE // 2, np.float32)]), RATE)
    assert summary["duration_s"] == 1.5
    assert summary["peak"] == pytest.approx(0.5, abs=1e-4)
    assert summary["rms"] == pytest.approx(0.5 / np.sqrt(2) * np.sqrt(1 / 1.5), rel=1e-3)
    assert audio_summary(np.zeros(0, np.float32), RATE) == {"duration_s": 0.0, "peak": 0.0, "rms": 0.0}


def test_waveform_png_draws_min_and_max_per_column():
    samples = np.concatenate([np.zeros(RATE, np.float32), tone(1.0, amp=0.5)])  # 1 s silence, 1 s tone
    width, height = 200, 81
    with Image.open(io.BytesIO(waveform_png(samples, RATE, width, height))) as image:
        assert image.size == (width, height)
        pixels = np.asarray(image.convert("RGB"))
    background = pixels[0, 0]
    drawn = np.any(pixels != background, axis=2)
    silent = np.flatnonzero(drawn[:, 40])
    assert silent.tolist() == [40]  # silence: one pixel on the middle row
    loud = np.flatnonzero(drawn[:, 150])
    assert (loud.min(), loud.max()) == (20, 60)  # +0.5 and -0.5 of the -1..1 height
    tick = drawn[:, 100]
    assert tick.all() and len({tuple(p) for p in pixels[[0, 40], 100]}) == 2  # the 1 s tick, the wave over it
    few = waveform_png(np.array([0.0, 1.0, -1.0], np.float32), RATE, 30, 11)  # fewer samples than columns
    with Image.open(io.BytesIO(few)) as image:
        small = np.any(np.asarray(image.convert("RGB")) != background, axis=2)
    # one sample per column: 0.0 on the middle row, then +1 at the top, then -1 at the bottom
    assert [np.flatnonzero(small[:, c]).tolist() for c in (0, 9, 10, 19, 20, 29)] == [
        [5],
        [5],
        [0],
        [0],
        [10],
        [10],
    ]
