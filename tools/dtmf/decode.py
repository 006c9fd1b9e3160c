"""A Goertzel DTMF decoder: 24 kHz samples -> the keys they dial (ITU-T Q.23 tones).

The samples are cut into 25 ms frames every 10 ms; per frame the Goertzel recurrence measures the
amplitude at the four row and three column frequencies. A frame holds a key when its strongest row and
strongest column each beat the rest of their group by ``DOMINANCE`` (6 dB), are within ``TWIST`` of each
other, and together carry at least ``ENERGY_SHARE`` of the frame's energy (so noise or speech with a
little energy near a DTMF frequency is no key). Runs of at least ``MIN_TONE_FRAMES`` frames of the same
key are one press; a press needs a frame without a key before the next (two presses of one key need a
gap). Used by bench/dtmf_eval.py and tests/test_tiny_qwen_omni_dtmf.py (tools/ is never imported by the
libraries; it holds the world the model was trained on, and this decoder judges it).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

KEYS = "123456789*0#"
ROWS = (697.0, 770.0, 852.0, 941.0)
COLUMNS = (1209.0, 1336.0, 1477.0)
FRAME_S, HOP_S = 0.025, 0.010
DOMINANCE = 4.0  # power ratio (6 dB) of the strongest row/column over the next in its group
TWIST = 6.3  # power ratio (8 dB) allowed between the row and the column tone
ENERGY_SHARE = 0.6  # of the frame's energy in the two tones
MIN_RMS = 0.01  # quieter frames are silence
MIN_TONE_FRAMES = 4  # 40 ms (with 25 ms frames: a tone of >= 55 ms)


@dataclass(frozen=True)
class Press:
    key: str
    start_s: float
    end_s: float


def goertzel_amplitudes(frames: np.ndarray, freqs: tuple[float, ...], rate: int) -> np.ndarray:
    """(n, L) Hann-windowed frames -> (n, len(freqs)) sinusoid amplitudes by the Goertzel recurrence."""
    length = frames.shape[1]
    window = np.hanning(length)
    x = frames * window
    coeff = 2.0 * np.cos(2.0 * np.pi * np.asarray(freqs) / rate)
    s1 = np.zeros((frames.shape[0], len(freqs)))
    s2 = np.zeros_like(s1)
    for sample in x.T:
        s0 = sample[:, None] + coeff * s1 - s2
        s2, s1 = s1, s0
    power = s1 * s1 + s2 * s2 - coeff * s1 * s2
    return 2.0 * np.sqrt(np.maximum(power, 0.0)) / window.sum()


def frame_keys(samples: np.ndarray, rate: int = 24_000) -> list[str | None]:
    """The key each 25 ms frame (10 ms hop) holds, or None."""
    samples = np.asarray(samples, dtype=np.float64).reshape(-1)
    length, hop = int(FRAME_S * rate), int(HOP_S * rate)
    if samples.size < length:
        return []
    count = 1 + (samples.size - length) // hop
    frames = np.stack([samples[i * hop : i * hop + length] for i in range(count)])
    amps = goertzel_amplitudes(frames, ROWS + COLUMNS, rate)
    rows, cols = amps[:, :4] ** 2, amps[:, 4:] ** 2
    energy = np.mean(frames**2, axis=1)
    keys: list[str | None] = []
    for i in range(count):
        r, c = int(rows[i].argmax()), int(cols[i].argmax())
        second_r = np.partition(rows[i], -2)[-2]
        second_c = np.partition(cols[i], -2)[-2]
        share = (rows[i, r] + cols[i, c]) / 2.0 / max(energy[i], 1e-12)
        ok = (
            energy[i] >= MIN_RMS**2
            and rows[i, r] >= DOMINANCE * second_r
            and cols[i, c] >= DOMINANCE * second_c
            and max(rows[i, r], cols[i, c]) <= TWIST * min(rows[i, r], cols[i, c])
            and share >= ENERGY_SHARE
        )
        keys.append(KEYS[3 * r + c] if ok else None)
    return keys


def presses(samples: np.ndarray, rate: int = 24_000) -> list[Press]:
    """The key presses in ``samples``: runs of >= MIN_TONE_FRAMES frames of one key."""
    out: list[Press] = []
    keys = frame_keys(samples, rate)
    i = 0
    while i < len(keys):
        key = keys[i]
        j = i
        while j < len(keys) and keys[j] == key:
            j += 1
        if key is not None and j - i >= MIN_TONE_FRAMES:
            out.append(Press(key, i * HOP_S, (j - 1) * HOP_S + FRAME_S))
        i = j
    return out


def decode(samples: np.ndarray, rate: int = 24_000) -> str:
    """The keys dialled, space-separated as the model's text reply (``'4 1 7'``; '' for none)."""
    return " ".join(p.key for p in presses(samples, rate))


def synthetic(
    keys: str,
    rate: int = 24_000,
    tone_s: float = 0.1,
    gap_s: float = 0.06,
    snr_db: float | None = None,
    seed: int = 0,
) -> np.ndarray:
    """Reference DTMF audio for the decoder's controls: ``keys`` ('4 1 7') as tones and gaps, white noise at
    ``snr_db`` (of the tones' power) when given."""
    rng = np.random.default_rng(seed)
    t = np.arange(int(tone_s * rate)) / rate
    pieces = [np.zeros(int(gap_s * rate))]
    for key in keys.split():
        i = KEYS.index(key)
        low, high = ROWS[i // 3], COLUMNS[i % 3]
        phase = rng.uniform(0, 2 * np.pi, 2)
        pieces += [0.35 * (np.sin(2 * np.pi * low * t + phase[0]) + np.sin(2 * np.pi * high * t + phase[1]))]
        pieces += [np.zeros(int(gap_s * rate))]
    audio = np.concatenate(pieces)
    if snr_db is not None:
        noise_power = 0.35**2 / 10 ** (snr_db / 10)  # two tones of amplitude 0.35: power 2 * 0.35^2 / 2
        audio = audio + rng.normal(0, np.sqrt(noise_power), audio.size)
    return audio.astype(np.float32)
