"""Training the DiT (``GlmImageTransformer2DModel``): prior codes -> image latents, by flow matching.

Inputs are exactly what ``GlmImagePipeline`` gives the transformer for a 128x128 request: normalised VAE
latents (16x16), the target codes upsampled 2x (8x8 ids, one per 16 px token), the glyph embedding of
the empty string (captions hold no quoted text), target size and crop. Noise follows the flow-matching
schedule the pipeline's scheduler integrates (``x_s = (1 - s) x0 + s noise``, the model predicts
``noise - x0`` at timestep ``1000 s - 1``). Prior tokens are dropped for a tenth of the samples, which is
the unconditional branch classifier-free guidance uses. Target-code rows of the prior embedding are a
sum of colour, background and mask vectors while training (materialised when saved).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import torch
from diffusers import GlmImageTransformer2DModel

from engine.processors import upsample_grid_ids
from tools.shapes.ar import factorise, materialise
from tools.shapes.training import optimiser_step, resume, save_checkpoint
from tools.shapes.world import TARGET_SIDE


def upsampled_prior(target: torch.Tensor) -> torch.Tensor:
    """(N, 4, 4) or (N, 16) target ids -> (N, 64) DiT prior ids, as ``ar2diffusion`` hands them over."""
    return torch.stack([upsample_grid_ids(t.reshape(-1), TARGET_SIDE, TARGET_SIDE) for t in target])


def dit_forward(
    dit: GlmImageTransformer2DModel,
    x: torch.Tensor,
    prior: torch.Tensor,
    drop: torch.Tensor,
    sigma: torch.Tensor,
    glyph: torch.Tensor,
) -> torch.Tensor:
    n = x.shape[0]
    return dit(
        hidden_states=x,
        encoder_hidden_states=glyph.expand(n, -1, -1),
        prior_token_id=prior,
        prior_token_drop=drop[:, None].expand_as(prior),
        timestep=sigma * 1000.0 - 1.0,
        target_size=torch.tensor([[128.0, 128.0]]).expand(n, -1),
        crop_coords=torch.zeros(n, 2),
        return_dict=False,
    )[0]


def train_dit(
    dit: GlmImageTransformer2DModel,
    latents: torch.Tensor,
    targets: torch.Tensor,
    glyph: torch.Tensor,
    *,
    steps: int,
    ckpt: Path,
    batch_size: int = 32,
    lr: float = 1e-3,
    drop_prob: float = 0.1,
    seed: int = 0,
    log: Callable[[str], None] = print,
) -> GlmImageTransformer2DModel:
    """``latents``: normalised (N, C, 16, 16); ``targets``: (N, 4, 4) ids; ``glyph``: (1, T, D) empty-prompt embeds."""
    factorise(dit.prior_token_embedding)
    prior_all = upsampled_prior(targets)
    opt = torch.optim.AdamW(dit.parameters(), lr=lr, weight_decay=0.01)
    gen = torch.Generator().manual_seed(seed)
    step = resume(ckpt, dit, opt, gen)
    if step:
        log(f"[dit] resumed at step {step}")
    t0 = time.time()
    dit.train()
    while step < steps:
        for group in opt.param_groups:
            group["lr"] = lr * min(1.0, (step + 1) / 200) * (0.05 + 0.95 * (1 - step / steps))
        idx = torch.randint(latents.shape[0], (batch_size,), generator=gen)
        x0, prior = latents[idx], prior_all[idx]
        noise = torch.randn(x0.shape, generator=gen)
        # Logit-normal noise levels (more weight mid-way) plus some uniform ones to cover the ends.
        sigma = torch.sigmoid(torch.randn(batch_size, generator=gen))
        uniform = torch.rand(batch_size, generator=gen) < 0.3
        sigma = torch.where(uniform, torch.rand(batch_size, generator=gen), sigma).clamp(1e-3, 1.0)
        xs = (1 - sigma.view(-1, 1, 1, 1)) * x0 + sigma.view(-1, 1, 1, 1) * noise
        drop = torch.rand(batch_size, generator=gen) < drop_prob
        pred = dit_forward(dit, xs, prior, drop, sigma, glyph)
        loss = (pred - (noise - x0)).square().mean()
        optimiser_step(opt, loss, dit.parameters())
        step += 1
        if step % 100 == 0:
            log(f"[dit] step {step}/{steps} loss {loss.item():.4f} {(time.time() - t0) / 60:.1f} min")
        if step % 500 == 0 or step == steps:
            save_checkpoint(ckpt, dit, opt, gen, step)
    materialise(dit.prior_token_embedding)
    dit.eval()
    return dit
