"""studio/media/audio_compare.py on synthetic signals whose figures are known in closed form: lengths, the
largest sample difference and SNR in dB (what the History tab's Compare and Replay report for audio)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import soundfile

from studio.media.audio_compare import audio_difference, file_difference, format_max, format_snr

RATE = 24000


def tone(seconds: float = 1.0, freq: float = 440.0, amplitude: float = 0.5) -> np.ndarray:
    t = np.arange(int(seconds * RATE)) / RATE
    return amplitude * np.sin(2 * np.pi * freq * t)


def test_the_same_samples_are_identical_with_infinite_snr() -> None:
    a = tone()
    d = audio_difference(a, a.copy(), RATE)
    assert d.identical and d.same_length and d.note is None
    assert (d.max_abs, d.snr_db) == (0.0, math.inf)
    assert d.before_seconds == d.after_seconds == 1.0
    assert d.summary() == "A 1.00 s, B 1.00 s · max sample difference 0 · SNR inf dB · identical samples"
    assert json.loads(json.dumps(d.to_dict()))["snr_db"] == "inf"


@pytest.mark.parametrize(("error", "snr"), [(0.01, 40.0), (0.1, 20.0), (0.5, 6.0206)])
def test_a_scaled_copy_has_the_snr_of_its_scale(error: float, snr: float) -> None:
    # after = before * (1 + e): the noise is e * before, so SNR = -20 log10(e) whatever the signal.
    a = tone()
    d = audio_difference(a, a * (1 + error), RATE)
    assert not d.identical and d.same_length
    assert d.snr_db == pytest.approx(snr, abs=1e-3)
    assert d.max_abs == pytest.approx(error * np.abs(a).max(), rel=1e-9)


def test_one_changed_sample_is_the_max_difference() -> None:
    a = tone()
    b = a.copy()
    b[1234] += 0.25
    d = audio_difference(a, b, RATE)
    assert d.max_abs == pytest.approx(0.25)
    power = float(np.sum(a**2))
    assert d.snr_db == pytest.approx(10 * math.log10(power / 0.25**2))


def test_a_shorter_take_is_compared_padded_with_silence() -> None:
    a = tone(1.0)
    b = a[: RATE // 2]  # the first half only
    d = audio_difference(a, b, RATE)
    assert not d.same_length and not d.identical
    assert (d.before_seconds, d.after_seconds) == (1.0, 0.5)
    # The noise is the half left out: SNR = 10 log10(whole power / second half's power) ~ 3 dB.
    expected = 10 * math.log10(np.sum(a**2) / np.sum(a[RATE // 2 :] ** 2))
    assert d.snr_db == pytest.approx(expected) and d.snr_db == pytest.approx(3.0103, abs=0.01)
    assert d.max_abs == pytest.approx(np.abs(a[RATE // 2 :]).max())
    assert d.note and "lengths differ (1.000 s -> 0.500 s)" in d.note
    assert "A 1.00 s, B 0.50 s" in d.summary()


def test_silence_against_sound_and_silence_against_silence() -> None:
    silence = np.zeros(RATE)
    sound = audio_difference(silence, tone(), RATE)
    assert sound.snr_db == -math.inf and sound.max_abs == pytest.approx(0.5, abs=1e-3)
    assert sound.to_dict()["snr_db"] == "-inf" and format_snr(sound.snr_db) == "-inf"
    quiet = audio_difference(silence, silence, RATE)
    assert quiet.identical and quiet.snr_db == math.inf
    empty = audio_difference(np.zeros(0), np.zeros(0), RATE)
    assert empty.identical and empty.before_seconds == 0


def test_different_rates_are_not_compared_sample_for_sample() -> None:
    d = audio_difference(tone(), tone()[::2], RATE, RATE // 2)
    assert (d.max_abs, d.snr_db) == (None, None) and not d.identical
    assert d.before_seconds == d.after_seconds == 1.0
    assert d.note and "sample rates differ (24000 Hz -> 12000 Hz)" in d.note
    assert d.summary().endswith(d.note)


def test_stereo_is_mixed_down_and_bad_input_names_the_side() -> None:
    a = tone()
    stereo = np.stack([a, a], axis=1)
    assert audio_difference(stereo, a, RATE).identical
    with pytest.raises(ValueError, match="after: samples must be 1-D"):
        audio_difference(a, np.zeros((2, 2, 2)), RATE)
    with pytest.raises(ValueError, match="before: samples must be finite"):
        audio_difference(np.array([0.0, np.nan]), a, RATE)
    with pytest.raises(ValueError, match="after: the sample rate must be a positive whole number"):
        audio_difference(a, a, RATE, 0)


def test_wav_files_are_compared_as_decoded(tmp_path: Path) -> None:
    a, b = tone(0.5), tone(0.5, amplitude=0.4)
    for name, samples in (("a.wav", a), ("b.wav", b)):
        soundfile.write(tmp_path / name, samples, RATE, subtype="PCM_16")
    d = file_difference(tmp_path / "a.wav", tmp_path / "b.wav")
    decoded_a, _ = soundfile.read(tmp_path / "a.wav", dtype="float64")
    decoded_b, _ = soundfile.read(tmp_path / "b.wav", dtype="float64")
    assert d.max_abs == pytest.approx(np.abs(decoded_a - decoded_b).max())
    assert d.max_abs == pytest.approx(0.1, abs=1e-3)  # the amplitudes differ by 0.1
    assert d.snr_db == pytest.approx(20 * math.log10(0.5 / 0.1), abs=0.01)  # scale 0.8: -20 log10(0.2)
    assert file_difference(tmp_path / "a.wav", tmp_path / "a.wav").identical
    assert format_max(d.max_abs) == f"{d.max_abs:.4g}"
