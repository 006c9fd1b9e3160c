"""Training BigVGAN (``Qwen2_5OmniToken2WavBigVGANModel``): DiT frames -> 24 kHz DTMF waveforms.

Crops of training key sequences' frames (log-mel + phase channels, tools/dtmf/world.py) and their
sound, the frames a little noisy so a DiT's slightly-off frame still renders clean tones. Each tone
starts at phase 0 and the frames carry the phases, so the waveform is a function of the frames: the
loss is the waveform's L1 distance plus a multi-resolution spectral convergence; no adversary (a log
magnitude term, tried, drove the output towards silence: exact zeros between tones dominate it). One transposed convolution makes each frame's 480 samples (overlap-add of
learned waveforms, the phase channels weighting sinusoids), then BigVGAN's anti-aliased Snake blocks.
The convolutions start scaled to keep the signal's size through the stack (engine/tiny/qwen_omni.py
``audible_vocoder``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from engine.tiny.qwen_omni import audible_vocoder
from tools.dtmf.world import HOP, features, random_keys
from tools.shapes.training import optimiser_step, resume, save_checkpoint

RESOLUTIONS = ((256, 64), (512, 128), (1024, 256))


def stft_loss(out: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    loss = out.new_zeros(())
    for n_fft, hop in RESOLUTIONS:
        window = torch.hann_window(n_fft)
        a = torch.stft(out, n_fft, hop, window=window, return_complex=True).abs()
        b = torch.stft(ref, n_fft, hop, window=window, return_complex=True).abs()
        loss = loss + torch.linalg.norm(b - a) / torch.linalg.norm(b).clamp(min=1e-6)
    return loss / len(RESOLUTIONS)


def crops(rng: np.random.Generator, n: int, frames: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` (frames (n, 80, frames), audio (n, frames * HOP)) crops of training sequences."""
    mels: list[torch.Tensor] = []
    audios: list[torch.Tensor] = []
    while len(mels) < n:
        keys = random_keys(rng) + random_keys(rng)  # long enough to crop anywhere
        mel, audio = features(keys)
        if mel.shape[0] < frames:
            continue
        start = int(rng.integers(0, mel.shape[0] - frames + 1))
        mels.append(mel[start : start + frames].T)
        audios.append(audio[start * HOP : (start + frames) * HOP])
    return torch.stack(mels), torch.stack(audios)


def train_vocoder(
    vocoder: Any,
    *,
    steps: int,
    ckpt: Path,
    batch_size: int = 8,
    frames: int = 24,
    lr: float = 3e-3,
    mel_noise: float = 0.1,
    seed: int = 0,
    log: Callable[[str], None] = print,
) -> Any:
    opt = torch.optim.AdamW(vocoder.parameters(), lr=lr, betas=(0.8, 0.99))
    gen = torch.Generator().manual_seed(seed)
    if not ckpt.exists():
        audible_vocoder(vocoder, {"output_gain": 0.1}, seed)
    step = resume(ckpt, vocoder, opt, gen)
    rng = np.random.default_rng(seed + 7919 * step)
    t0 = time.time()
    vocoder.train()
    while step < steps:
        for group in opt.param_groups:
            group["lr"] = lr * min(1.0, (step + 1) / 100) * (0.05 + 0.95 * (1 - step / steps))
        mel, audio = crops(rng, batch_size, frames)
        noisy = mel + mel_noise * torch.rand(batch_size, 1, 1, generator=gen) * torch.randn(
            mel.shape, generator=gen
        )
        out = vocoder(noisy).reshape(batch_size, -1)
        loss = stft_loss(out, audio) + 10.0 * (out - audio).abs().mean()
        optimiser_step(opt, loss, vocoder.parameters(), max_norm=5.0)
        step += 1
        if step % 50 == 0:
            log(f"[vocoder] step {step}/{steps} loss {loss.item():.4f} {(time.time() - t0) / 60:.1f} min")
        if step % 250 == 0 or step == steps:
            save_checkpoint(ckpt, vocoder, opt, gen, step)
    vocoder.eval()
    return vocoder
