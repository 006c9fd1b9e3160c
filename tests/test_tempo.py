"""Speech tempo (engine/tempo.py): faster or slower, the pitch kept, streamed pieces equal to the whole."""

from __future__ import annotations

import numpy as np
import pytest

from engine.tempo import SLACK, Tempo, stretch

RATE = 24000


def voiced(seconds: float, pitch: float = 180.0, seed: int = 0) -> np.ndarray:
    """A voice-like test signal: a pitched tone with harmonics, syllable-like bursts, a little noise."""
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * RATE)) / RATE
    tone = sum(np.sin(2 * np.pi * pitch * k * t) / k for k in (1, 2, 3))
    bursts = 0.6 + 0.4 * np.sin(2 * np.pi * 3.0 * t)
    return (0.2 * tone * bursts + 0.01 * rng.standard_normal(t.size)).astype(np.float32)


def pitch_of(samples: np.ndarray) -> float:
    """The strongest frequency (Hz), to a resolution of RATE / len."""
    spectrum = np.abs(np.fft.rfft(samples * np.hanning(samples.size)))
    return float(np.argmax(spectrum)) * RATE / samples.size


def in_pieces(samples: np.ndarray, speed: float, sizes: list[int]) -> list[np.ndarray]:
    tempo, pieces, at = Tempo(speed), [], 0
    while at < samples.size:
        size = sizes[len(pieces) % len(sizes)]
        pieces.append(tempo.push(samples[at : at + size]))
        at += size
    pieces.append(tempo.finish())
    return pieces


@pytest.mark.parametrize("speed", [0.25, 0.5, 0.8, 1.25, 2.0, 3.0, 4.0])
def test_the_tempo_changes_and_the_pitch_does_not(speed):
    source = voiced(2.0)
    out = stretch(source, speed)
    assert out.dtype == np.float32
    assert out.size == round(source.size / speed) + SLACK
    assert abs(pitch_of(out) - pitch_of(source)) < 3.0  # 180 Hz stays 180 Hz (resampling would not)
    # Loud throughout, as the source is (nothing dropped in the middle, no silence appended).
    body = out[SLACK : out.size - SLACK]
    windows = body[: body.size // 480 * 480].reshape(-1, 480)
    assert np.sqrt(np.mean(windows.astype(np.float64) ** 2, axis=1)).min() > 0.02


@pytest.mark.parametrize("speed", [0.5, 1.5, 2.0, 4.0])
def test_pieces_pushed_one_by_one_are_the_whole_utterance_stretched(speed):
    source = voiced(1.5, seed=3)
    whole = stretch(source, speed)
    pieces = in_pieces(source, speed, [1000, 7, 4800, 333, 2880])
    assert np.array_equal(np.concatenate(pieces), whole)
    assert pieces[0].size == 0  # held back until a frame is full: fine for a stream, said in the docs
    assert sum(p.size for p in pieces[:-1]) > whole.size // 2  # most of it comes out while pushing


def test_speed_one_is_the_samples_as_they_are_and_silence_stays_empty():
    source = voiced(0.5)
    assert np.array_equal(stretch(source, 1.0), source)
    tempo = Tempo(2.0)
    assert tempo.finish().size == 0  # nothing spoken: nothing out, no slack
    with pytest.raises(RuntimeError, match="finished"):
        tempo.push(source)


@pytest.mark.parametrize("speed", [0.2, 4.5, float("nan")])
def test_a_speed_out_of_range_names_the_range(speed):
    with pytest.raises(ValueError, match="from 0.25 to 4"):
        Tempo(speed)
