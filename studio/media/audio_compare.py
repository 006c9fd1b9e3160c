"""How two pieces of audio differ, sample for sample: each one's length, the largest sample difference and
the signal-to-noise ratio in dB. The History tab's Compare (studio/ui/compare.py) and Replay
(studio/replay/report.py) both use it, so they report the same figures (docs/speech.md "In the studio").

Samples are mono floats at full scale 1.0 (a 16-bit WAV's values / 32768, as libsndfile reads them).
``before`` is the reference: SNR is ``10 log10(sum(before^2) / sum((after - before)^2))``, ``inf`` when
the samples are equal. Audio of different lengths is compared over the longer one, the shorter padded
with silence (a replay whose talker stopped earlier differs by the sound it left out); audio at different
rates is not compared sample for sample (the figures are ``None``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import soundfile  # type: ignore[import-untyped]  # ships no type information


@dataclass(frozen=True)
class AudioDifference:
    """Two pieces of audio side by side (``before`` the reference, ``after`` the one compared with it)."""

    before_samples: int
    after_samples: int
    before_rate: int
    after_rate: int
    max_abs: float | None  # largest |after - before| (full scale 1.0); None at different rates
    snr_db: float | None  # inf: equal samples; -inf: a silent reference against sound; None: different rates

    @property
    def before_seconds(self) -> float:
        return self.before_samples / self.before_rate

    @property
    def after_seconds(self) -> float:
        return self.after_samples / self.after_rate

    @property
    def same_rate(self) -> bool:
        return self.before_rate == self.after_rate

    @property
    def same_length(self) -> bool:
        return self.same_rate and self.before_samples == self.after_samples

    @property
    def identical(self) -> bool:
        """Same rate, same length, the same value in every sample."""
        return self.same_length and self.max_abs == 0

    @property
    def note(self) -> str | None:
        """Why the figures are missing or what they cover, in words (None when nothing needs saying)."""
        if not self.same_rate:
            return (
                f"sample rates differ ({self.before_rate} Hz -> {self.after_rate} Hz): not compared sample "
                "for sample"
            )
        if not self.same_length:
            return (
                f"lengths differ ({self.before_seconds:.3f} s -> {self.after_seconds:.3f} s): compared over "
                "the longer, the shorter padded with silence"
            )
        return None

    def summary(self, before_label: str = "A", after_label: str = "B") -> str:
        """``"A 1.20 s, B 1.18 s · max sample difference 0.0123 · SNR 23.41 dB"``."""
        lengths = f"{before_label} {self.before_seconds:.2f} s, {after_label} {self.after_seconds:.2f} s"
        if self.max_abs is None:
            return f"{lengths} · {self.note}"
        verdict = " · identical samples" if self.identical else ""
        return (
            f"{lengths} · max sample difference {format_max(self.max_abs)} · SNR "
            f"{format_snr(self.snr_db)} dB{verdict}"
        )

    def to_dict(self) -> dict[str, Any]:
        """The figures as JSON values (infinities as the strings ``"inf"`` / ``"-inf"``)."""
        return {
            "before_seconds": self.before_seconds,
            "after_seconds": self.after_seconds,
            "before_rate": self.before_rate,
            "after_rate": self.after_rate,
            "max_abs": self.max_abs,
            "snr_db": json_snr(self.snr_db),
            "identical": self.identical,
            "note": self.note,
        }


def _mono(samples: np.ndarray, field: str) -> np.ndarray:
    values = np.asarray(samples, dtype=np.float64)
    if values.ndim == 2:  # (frames, channels), as libsndfile reads a multi-channel file
        values = values.mean(axis=1)
    if values.ndim != 1:
        raise ValueError(
            f"{field}: samples must be 1-D (mono) or (frames, channels), got shape {values.shape}"
        )
    if not np.isfinite(values).all():
        raise ValueError(f"{field}: samples must be finite (no NaN or infinity)")
    return values


def _rate(rate: int, field: str) -> int:
    if int(rate) != rate or rate <= 0:
        raise ValueError(f"{field}: the sample rate must be a positive whole number of Hz, got {rate!r}")
    return int(rate)


def audio_difference(
    before: np.ndarray, after: np.ndarray, before_rate: int, after_rate: int | None = None
) -> AudioDifference:
    """The difference of ``after`` from ``before`` (arrays of samples; ``after_rate`` defaults to
    ``before_rate``). Raises ``ValueError`` naming ``before`` or ``after`` for samples that are not mono
    finite numbers, or a rate that is not a positive integer."""
    a, b = _mono(before, "before"), _mono(after, "after")
    rate_a = _rate(before_rate, "before")
    rate_b = _rate(before_rate if after_rate is None else after_rate, "after")
    if rate_a != rate_b:
        return AudioDifference(a.size, b.size, rate_a, rate_b, None, None)
    length = max(a.size, b.size)
    if length == 0:
        return AudioDifference(0, 0, rate_a, rate_b, 0.0, math.inf)
    a = np.pad(a, (0, length - a.size))
    b = np.pad(b, (0, length - b.size))
    noise = b - a
    noise_power = float(np.dot(noise, noise))
    signal_power = float(np.dot(a, a))
    if noise_power == 0:
        snr = math.inf
    elif signal_power == 0:
        snr = -math.inf
    else:
        snr = 10.0 * math.log10(signal_power / noise_power)
    return AudioDifference(
        int(before.shape[0]), int(after.shape[0]), rate_a, rate_b, float(np.abs(noise).max()), snr
    )


def read_samples(path: Path | str) -> tuple[np.ndarray, int]:
    """An audio file's samples (float64, mono: channels averaged) and its rate, as libsndfile reads them."""
    samples, rate = soundfile.read(str(path), dtype="float64", always_2d=True)
    return samples.mean(axis=1), int(rate)


def file_difference(before: Path | str, after: Path | str) -> AudioDifference:
    """:func:`audio_difference` of two audio files (WAV, FLAC, ... : what libsndfile reads)."""
    a, rate_a = read_samples(before)
    b, rate_b = read_samples(after)
    return audio_difference(a, b, rate_a, rate_b)


def format_snr(value: float | None) -> str:
    if value is None:
        return "—"
    if math.isinf(value):
        return "inf" if value > 0 else "-inf"
    return f"{value:.2f}"


def format_max(value: float | None) -> str:
    """A sample difference to 4 significant digits (``0`` when there is none)."""
    if value is None:
        return "—"
    return "0" if value == 0 else f"{value:.4g}"


def json_snr(value: float | None) -> float | str | None:
    """An SNR as a JSON value: JSON has no infinity, so ``"inf"`` / ``"-inf"``."""
    if value is not None and math.isinf(value):
        return "inf" if value > 0 else "-inf"
    return value
