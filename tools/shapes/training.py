"""What the three training loops share: one optimiser step, and resumable checkpoints.

A checkpoint holds the model, the optimiser, the step and the random generator's state (a torch
``Generator`` or a numpy one), so a resumed run draws exactly the batches an uninterrupted one would.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
import torch

Rng = torch.Generator | np.random.Generator


def optimiser_step(
    opt: torch.optim.Optimizer,
    loss: torch.Tensor,
    params: Iterable[torch.nn.Parameter],
    max_norm: float = 1.0,
) -> None:
    """Backpropagate ``loss``, clip the gradient norm of ``params`` to ``max_norm``, step."""
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(params, max_norm)
    opt.step()


def _rng_state(rng: Rng) -> Any:
    return rng.get_state() if isinstance(rng, torch.Generator) else rng.bit_generator.state


def _set_rng_state(rng: Rng, state: Any) -> None:
    if isinstance(rng, torch.Generator):
        rng.set_state(state)
    else:
        rng.bit_generator.state = state


def save_checkpoint(
    ckpt: Path, model: torch.nn.Module, opt: torch.optim.Optimizer, rng: Rng, step: int
) -> None:
    torch.save(
        {"model": model.state_dict(), "opt": opt.state_dict(), "rng": _rng_state(rng), "step": step}, ckpt
    )


def resume(ckpt: Path, model: torch.nn.Module, opt: torch.optim.Optimizer, rng: Rng) -> int:
    """Load ``ckpt`` into ``model``, ``opt`` and ``rng`` if it exists; the step to continue from (0: none)."""
    if not ckpt.exists():
        return 0
    state = torch.load(ckpt, weights_only=False)
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["opt"])
    _set_rng_state(rng, state["rng"])
    return int(state["step"])
