"""Training code2wav's DiT (``Qwen2_5OmniToken2WavDiTModel``): codec ids -> log-mel, by flow matching.

Exactly the flow the code2wav stage integrates (``engine/pipelines/qwen_omni/code2wav.py``): the state
goes from noise at time 0 to the mel at time 1, ``x_t = (1 - t) noise + t mel``, and the DiT predicts the
velocity ``mel - noise`` given the codes (one frame each: log-mel + phase channels, tools/dtmf/world.py),
a voice's speaker embedding and reference mel. Times are drawn like the sampler's grid (``1 - cos(pi u / 2)``, dense near 0) half the time and
uniformly otherwise. One batch in ten drops the codes and the voice together: classifier-free
guidance's unconditional branch. Crops of 48 codes (2 attention blocks) of training sequences' sound.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tools.dtmf.world import codes_of, features, random_keys
from tools.shapes.training import optimiser_step, resume, save_checkpoint


def crops(rng: np.random.Generator, n: int, codes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` (codes (n, codes), frames (n, codes, 80)) crops; a third start where an utterance starts."""
    ids: list[torch.Tensor] = []
    mels: list[torch.Tensor] = []
    while len(ids) < n:
        keys = random_keys(rng) + random_keys(rng) + random_keys(rng)
        sequence = codes_of(keys)
        if len(sequence) < codes:
            continue
        mel, _ = features(keys)
        start = 0 if rng.random() < 0.33 else int(rng.integers(0, len(sequence) - codes + 1))
        ids.append(torch.tensor(sequence[start : start + codes]))
        mels.append(mel[start : start + codes])
    return torch.stack(ids), torch.stack(mels)


def train_dit(
    dit: Any,
    voices: list[tuple[torch.Tensor, torch.Tensor]],
    *,
    steps: int,
    ckpt: Path,
    batch_size: int = 16,
    codes: int = 48,
    lr: float = 2e-3,
    seed: int = 0,
    log: Callable[[str], None] = print,
) -> Any:
    """``voices``: (speaker embedding (1, E), reference mel (1, frames, 80)) per voice of spk_dict.pt."""
    opt = torch.optim.AdamW(dit.parameters(), lr=lr, weight_decay=0.01)
    gen = torch.Generator().manual_seed(seed)
    step = resume(ckpt, dit, opt, gen)
    rng = np.random.default_rng(seed + 7919 * step)
    t0 = time.time()
    dit.train()
    while step < steps:
        for group in opt.param_groups:
            group["lr"] = lr * min(1.0, (step + 1) / 100) * (0.05 + 0.95 * (1 - step / steps))
        ids, mel = crops(rng, batch_size, codes)
        voice = [voices[int(i)] for i in rng.integers(0, len(voices), batch_size)]
        speaker = torch.cat([s for s, _ in voice]).unsqueeze(1).expand(-1, mel.shape[1], -1)
        reference = torch.cat([r for _, r in voice])
        u = torch.rand(batch_size, generator=gen)
        grid = 1 - torch.cos(math.pi / 2 * u)
        t = torch.where(
            torch.rand(batch_size, generator=gen) < 0.5, grid, torch.rand(batch_size, generator=gen)
        )
        noise = torch.randn(mel.shape, generator=gen)
        x = (1 - t.view(-1, 1, 1)) * noise + t.view(-1, 1, 1) * mel
        drop = step % 10 == 9
        pred = dit(
            hidden_states=x,
            condition_vector=reference,
            speaker_embedding=speaker,
            quantized_code=ids,
            time_step=t,
            drop_audio_conditioning=drop,
            drop_code=drop,
            apply_cfg=False,
        )
        loss = (pred - (mel - noise)).square().mean()
        optimiser_step(opt, loss, dit.parameters())
        step += 1
        if step % 100 == 0:
            log(f"[dit] step {step}/{steps} loss {loss.item():.4f} {(time.time() - t0) / 60:.1f} min")
        if step % 500 == 0 or step == steps:
            save_checkpoint(ckpt, dit, opt, gen, step)
    dit.eval()
    return dit


def sampler_times(steps: int) -> torch.Tensor:
    """code2wav's ODE time points (engine/pipelines/qwen_omni/code2wav.py: linspace, swayed toward 0)."""
    times = torch.linspace(0, 1, steps)
    return times - (torch.cos(math.pi / 2 * times) - 1 + times)


def finetune_dit(
    dit: Any,
    voices: list[tuple[torch.Tensor, torch.Tensor]],
    *,
    steps: int,
    ckpt: Path,
    ode_steps: int = 10,
    batch_size: int = 8,
    codes: int = 48,
    lr: float = 5e-4,
    seed: int = 1,
    log: Callable[[str], None] = print,
) -> Any:
    """Fine-tune the DiT through the sampler the deploy preset runs: Runge-Kutta 4 over ``ode_steps``
    time points without guidance, from fresh noise, the loss on the frame it ends at (backpropagated
    through every evaluation). Flow matching alone left a few noise draws rendering a broken tone."""
    from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import RungeKutta4ODESolver

    opt = torch.optim.AdamW(dit.parameters(), lr=lr, weight_decay=0.01)
    gen = torch.Generator().manual_seed(seed)
    step = resume(ckpt, dit, opt, gen)
    rng = np.random.default_rng(seed + 7919 * step)
    times = sampler_times(ode_steps)
    t0 = time.time()
    dit.train()
    while step < steps:
        for group in opt.param_groups:
            group["lr"] = lr * (0.1 + 0.9 * (1 - step / steps))
        ids, mel = crops(rng, batch_size, codes)
        voice = [voices[int(i)] for i in rng.integers(0, len(voices), batch_size)]
        speaker = torch.cat([s for s, _ in voice]).unsqueeze(1).expand(-1, mel.shape[1], -1)
        reference = torch.cat([r for _, r in voice])

        def velocity(
            t: torch.Tensor,
            x: torch.Tensor,
            ids: torch.Tensor = ids,
            speaker: torch.Tensor = speaker,
            reference: torch.Tensor = reference,
        ) -> torch.Tensor:
            return dit(
                hidden_states=x,
                condition_vector=reference,
                speaker_embedding=speaker,
                quantized_code=ids,
                time_step=t.reshape(1).expand(x.shape[0]),
                drop_audio_conditioning=False,
                drop_code=False,
                apply_cfg=False,
            )

        noise = torch.randn(mel.shape, generator=gen)
        end = RungeKutta4ODESolver(function=velocity, initial_value=noise).integrate(times)[-1]
        loss = (end - mel).square().mean()
        optimiser_step(opt, loss, dit.parameters())
        step += 1
        if step % 25 == 0:
            log(f"[dit-sampler] step {step}/{steps} loss {loss.item():.5f} {(time.time() - t0) / 60:.1f} min")
        if step % 100 == 0 or step == steps:
            save_checkpoint(ckpt, dit, opt, gen, step)
    dit.eval()
    return dit
