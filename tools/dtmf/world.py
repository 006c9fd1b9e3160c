"""The DTMF world of `tiny-qwen-omni-dtmf`: key sequences, their sound, codes, mels and the held-out split.

A request dials 1 to 10 keys (``0``-``9``, ``*``, ``#``) separated by spaces: ``dial 4 1 7``. Its speech is
each key's DTMF tone (ITU-T Q.23: a row and a column frequency) for 100 ms, then 60 ms of silence, at
24 kHz. At the talker's 20 ms per codec id (480 samples) that is 5 tone codes and 3
silence codes per key.

**What code2wav renders.** Its DiT makes, per 20 ms code, one 80-channel frame that BigVGAN turns into
480 samples: 66 log-mel bins of the sound (0-12 kHz) and 14 *phase channels*, the cosine and sine of
each DTMF frequency's phase at the frame's start (0 when the frequency is silent). BigVGAN is a stack of
convolutions: from the same frame over and over it can only make a waveform that repeats every frame,
the harmonics of 50 Hz, and a log-mel holds no phase to tell it more (770 Hz is 20 Hz from the nearest
harmonic). With the phases in the frame it continues each sinusoid across frames; each tone starts at
phase 0, so the phases are a function of the code (the key, and which 20 ms of its tone it is).

Codec ids: 0 is never spoken (code2wav's DiT uses it for a dropped code), ``1 + 5 k + p`` the p-th
20 ms of key ``k``'s tone (``KEYS`` order), 61 silence; the talker's start, end, pad and mask ids
follow (``recipe.yaml``).

Held out: the key sequences whose CRC-32 is 0 mod 5 (a fifth) are never trained on by any stage.
"""

from __future__ import annotations

import math
import zlib

import numpy as np
import torch

KEYS = "123456789*0#"
ROWS = (697.0, 770.0, 852.0, 941.0)
COLUMNS = (1209.0, 1336.0, 1477.0)
SAMPLE_RATE = 24_000
SAMPLES_PER_CODE = 480  # 20 ms: one DiT frame per code, BigVGAN makes 480 samples of each
TONE_CODES, GAP_CODES = 5, 3  # 100 ms tone, 60 ms silence
CODES_PER_KEY = TONE_CODES + GAP_CODES
SILENCE_CODE = 1 + 5 * 12
AMPLITUDE = 0.35  # each of the two sinusoids
MAX_KEYS = 10

# The frame the DiT makes and BigVGAN reads: log-mel bins (natural log of magnitudes, scaled to a
# sinusoid's amplitude: BigVGAN's input processing clips above ~2.3), then the phase channels, placed
# at PHASE_CENTRE +- PHASE_SCALE (inside the range BigVGAN's input processing keeps linear).
N_FFT, WIN, HOP, N_MELS = 1024, 960, SAMPLES_PER_CODE, 66
FREQUENCIES = ROWS + COLUMNS
FEATURES = N_MELS + 2 * len(FREQUENCIES)  # 80: the DiT's mel_dim
PHASE_CENTRE, PHASE_SCALE = -5.0, 3.0
LOG_FLOOR = 1e-5


def key_frequencies(key: str) -> tuple[float, float]:
    i = KEYS.index(key)
    return ROWS[i // 3], COLUMNS[i % 3]


def codes_of(keys: list[str]) -> list[int]:
    """The codec ids that speak ``keys``: per key its 5 tone codes, then 3 silence codes."""
    out: list[int] = []
    for key in keys:
        k = KEYS.index(key)
        out += [1 + TONE_CODES * k + p for p in range(TONE_CODES)] + [SILENCE_CODE] * GAP_CODES
    return out


def tone_audio(keys: list[str]) -> np.ndarray:
    """The float32 waveform of ``keys``: tones (both sinusoids at phase 0 at their start) and gaps."""
    t = np.arange(TONE_CODES * SAMPLES_PER_CODE) / SAMPLE_RATE
    pieces = []
    for key in keys:
        low, high = key_frequencies(key)
        pieces += [AMPLITUDE * (np.sin(2 * math.pi * low * t) + np.sin(2 * math.pi * high * t))]
        pieces += [np.zeros(GAP_CODES * SAMPLES_PER_CODE)]
    return np.concatenate(pieces).astype(np.float32) if pieces else np.zeros(0, np.float32)


def phase_channels(keys: list[str]) -> torch.Tensor:
    """(codes, 14): per frame and DTMF frequency the cosine and sine of its phase at the frame's start."""
    rows = []
    for key in keys:
        present = key_frequencies(key)
        for p in range(TONE_CODES):
            start = p * SAMPLES_PER_CODE / SAMPLE_RATE
            row = []
            for freq in FREQUENCIES:
                on = freq in present
                phase = 2 * math.pi * freq * start
                row += [math.cos(phase) if on else 0.0, math.sin(phase) if on else 0.0]
            rows.append(row)
        rows += [[0.0] * (2 * len(FREQUENCIES))] * GAP_CODES
    return PHASE_CENTRE + PHASE_SCALE * torch.tensor(rows, dtype=torch.float32).reshape(
        -1, 2 * len(FREQUENCIES)
    )


def features(keys: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """(frames (codes, 80) for the DiT to make, the waveform (codes * 480,) BigVGAN should make of them)."""
    audio = torch.from_numpy(tone_audio(keys))
    return torch.cat([log_mel(audio), phase_channels(keys)], dim=-1), audio


_MEL_BASIS: torch.Tensor | None = None


def mel_basis() -> torch.Tensor:
    """(N_MELS, N_FFT // 2 + 1) triangular filters evenly spaced on the HTK mel scale, 0 to 12 kHz."""
    global _MEL_BASIS
    if _MEL_BASIS is None:

        def to_mel(hz: np.ndarray) -> np.ndarray:
            return 2595.0 * np.log10(1.0 + hz / 700.0)

        edges_mel = np.linspace(0.0, to_mel(np.array(SAMPLE_RATE / 2)), N_MELS + 2)
        edges = 700.0 * (10 ** (edges_mel / 2595.0) - 1.0)
        bins = np.linspace(0, SAMPLE_RATE / 2, N_FFT // 2 + 1)
        lower = (bins[None, :] - edges[:-2, None]) / (edges[1:-1, None] - edges[:-2, None])
        upper = (edges[2:, None] - bins[None, :]) / (edges[2:, None] - edges[1:-1, None])
        basis = np.maximum(0.0, np.minimum(lower, upper))
        _MEL_BASIS = torch.from_numpy(basis).float()
    return _MEL_BASIS


def log_mel(audio: torch.Tensor) -> torch.Tensor:
    """(..., samples) -> (..., frames, N_MELS) with frames = samples // HOP (centred frames, cut)."""
    frames = audio.shape[-1] // HOP
    pad = (N_FFT - HOP) // 2
    padded = torch.nn.functional.pad(audio.reshape(-1, 1, audio.shape[-1]), (pad, pad), mode="reflect")
    spec = torch.stft(
        padded.reshape(-1, padded.shape[-1]),
        N_FFT,
        HOP,
        WIN,
        window=torch.hann_window(WIN),
        center=False,
        return_complex=True,
    ).abs() * (4.0 / WIN)  # a sinusoid of amplitude a peaks near a (Hann window sum WIN / 2)
    mel = torch.log(torch.clamp(mel_basis() @ spec, min=LOG_FLOOR))[..., :frames]
    return mel.transpose(-1, -2).reshape(*audio.shape[:-1], frames, N_MELS)


def held_out(keys: list[str]) -> bool:
    """True for the fifth of key sequences no stage trains on (CRC-32 of ``'4 1 7'`` is 0 mod 5)."""
    return zlib.crc32(" ".join(keys).encode()) % 5 == 0


def random_keys(rng: np.random.Generator, held: bool | None = False) -> list[str]:
    """A random sequence of 1-10 keys: training only (``held=False``), held out only (True), or any (None)."""
    while True:
        n = int(rng.integers(1, MAX_KEYS + 1))
        keys = [KEYS[int(i)] for i in rng.integers(0, len(KEYS), n)]
        if held is None or held_out(keys) == held:
            return keys
