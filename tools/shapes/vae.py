"""Training the VAE (``AutoencoderKL``) on pictures of the world, then normalising its latents.

1. Autoencoder: reconstruction (L1 + MSE) with a small KL term, on training-split scenes jittered in
   position and size (so the decoder has seen more than 360 exact layouts).
2. Latent statistics: per-channel mean/std of the encoder's latents over the training scenes, written to
   the config (``latents_mean`` / ``latents_std``): the DiT works in that normalised space.
3. Decoder fine-tune with the encoder frozen, on the normalised latents plus a little noise, so slightly
   wrong DiT latents still decode to clean palette colours.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import torch
from diffusers import AutoencoderKL

from tools.shapes.training import optimiser_step, resume, save_checkpoint
from tools.shapes.world import SHAPE_SIZE, Scene, render


def jittered_render(scene: Scene, rng: np.random.Generator, jitter: float) -> np.ndarray:
    """``scene`` with its shape moved by up to ``jitter`` px and resized by up to +-15% (jitter 0: exact)."""
    if jitter <= 0:
        return render(scene)
    dx, dy = rng.uniform(-jitter, jitter, 2)
    return render(scene, offset=(float(dx), float(dy)), shape_size=SHAPE_SIZE * rng.uniform(0.85, 1.15))


def to_tensor(images: Sequence[np.ndarray]) -> torch.Tensor:
    """uint8 HWC images -> float NCHW in [-1, 1] (the pipeline's VAE range)."""
    return torch.from_numpy(np.stack(images)).permute(0, 3, 1, 2).float() / 127.5 - 1.0


def train_autoencoder(
    vae: AutoencoderKL,
    scenes: Sequence[Scene],
    *,
    steps: int,
    ckpt: Path,
    batch_size: int = 8,
    lr: float = 2e-3,
    kl_weight: float = 1e-6,
    log: Callable[[str], None] = print,
) -> None:
    opt = torch.optim.AdamW(vae.parameters(), lr=lr, weight_decay=0.0)
    rng = np.random.default_rng(0)
    step = resume(ckpt, vae, opt, rng)
    t0 = time.time()
    vae.train()
    while step < steps:
        for group in opt.param_groups:
            group["lr"] = lr * min(1.0, (step + 1) / 100) * (0.1 + 0.9 * (1 - step / steps))
        batch = [scenes[i] for i in rng.integers(len(scenes), size=batch_size)]
        x = to_tensor([jittered_render(s, rng, jitter=8.0 if rng.random() < 0.7 else 0.0) for s in batch])
        posterior = vae.encode(x).latent_dist
        recon = vae.decode(posterior.sample()).sample
        rec = (recon - x).abs().mean() + (recon - x).square().mean()
        kl = posterior.kl().mean()
        loss = rec + kl_weight * kl
        optimiser_step(opt, loss, vae.parameters())
        step += 1
        if step % 50 == 0:
            log(
                f"[vae] step {step}/{steps} rec {rec.item():.4f} kl {kl.item():.1f} {(time.time() - t0) / 60:.1f} min"
            )
        if step % 250 == 0 or step == steps:
            save_checkpoint(ckpt, vae, opt, rng, step)


@torch.no_grad()
def encode_scenes(vae: AutoencoderKL, scenes: Sequence[Scene], batch_size: int = 32) -> torch.Tensor:
    """Raw (unnormalised) latent modes of the exact scenes: (N, C, 16, 16)."""
    vae.eval()
    out = []
    for start in range(0, len(scenes), batch_size):
        x = to_tensor([render(s) for s in scenes[start : start + batch_size]])
        out.append(vae.encode(x).latent_dist.mode())
    return torch.cat(out)


def set_latent_stats(vae: AutoencoderKL, latents: torch.Tensor) -> None:
    """Per-channel mean/std into the config: the pipeline decodes ``latents * std + mean``."""
    mean = latents.mean(dim=(0, 2, 3))
    std = latents.std(dim=(0, 2, 3))
    vae.register_to_config(
        latents_mean=[round(float(v), 6) for v in mean], latents_std=[round(float(v), 6) for v in std]
    )


def _latent_stats(vae: AutoencoderKL) -> tuple[torch.Tensor, torch.Tensor]:
    """The config's per-channel mean and std, shaped (1, C, 1, 1)."""
    return (
        torch.tensor(vae.config.latents_mean).view(1, -1, 1, 1),
        torch.tensor(vae.config.latents_std).view(1, -1, 1, 1),
    )


def normalise(vae: AutoencoderKL, latents: torch.Tensor) -> torch.Tensor:
    mean, std = _latent_stats(vae)
    return (latents - mean) / std


def denormalise(vae: AutoencoderKL, latents: torch.Tensor) -> torch.Tensor:
    mean, std = _latent_stats(vae)
    return latents * std + mean


def finetune_decoder(
    vae: AutoencoderKL,
    scenes: Sequence[Scene],
    *,
    steps: int,
    ckpt: Path,
    batch_size: int = 8,
    lr: float = 5e-4,
    latent_noise: float = 0.1,
    log: Callable[[str], None] = print,
) -> None:
    """Decoder (and post-quant conv) only; the encoder, and so the latent space the DiT learns, stay fixed."""
    vae.encoder.requires_grad_(False)
    if vae.quant_conv is not None:
        vae.quant_conv.requires_grad_(False)
    params = [p for p in vae.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    rng = np.random.default_rng(0)
    step = resume(ckpt, vae, opt, rng)
    t0 = time.time()
    while step < steps:
        for group in opt.param_groups:
            group["lr"] = lr * (0.1 + 0.9 * (1 - step / steps))
        batch = [scenes[i] for i in rng.integers(len(scenes), size=batch_size)]
        x = to_tensor([jittered_render(s, rng, jitter=8.0 if rng.random() < 0.3 else 0.0) for s in batch])
        with torch.no_grad():
            vae.encoder.eval()
            z = normalise(vae, vae.encode(x).latent_dist.mode())
            z = z + latent_noise * torch.from_numpy(rng.standard_normal(z.shape).astype(np.float32))
        vae.decoder.train()
        recon = vae.decode(denormalise(vae, z)).sample
        loss = (recon - x).abs().mean() + (recon - x).square().mean()
        optimiser_step(opt, loss, params)
        step += 1
        if step % 50 == 0:
            log(f"[vae-dec] step {step}/{steps} rec {loss.item():.4f} {(time.time() - t0) / 60:.1f} min")
        if step % 250 == 0 or step == steps:
            save_checkpoint(ckpt, vae, opt, rng, step)
    vae.requires_grad_(True)
    vae.eval()
