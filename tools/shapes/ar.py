"""Training the AR model (``GlmImageForConditionalGeneration``): caption -> preview grid -> target grid.

A training sequence is exactly what the pipeline's ``generate`` sees and produces for a 128x128 T2I
request: the processor's prompt (ending in image start), the 16x16 preview codes, the 4x4 target codes
and the end token. Positions are passed explicitly as the 3-D rope index that
``GlmImageModel.get_rope_index`` gives generation: text 0..L-1 on all three axes, preview cell (i, j) at
(L, L+i, L+j), target cell (i, j) at (L+16, L+16+i, L+16+j), the end token at L+20.

Free-running generation, not teacher forcing, is what counts: small errors in the 256 preview tokens
must not move the target grid. So the inputs' preview is often corrupted (cells flipped, the whole
silhouette shifted) while the labels stay the true codes, and later in training the model's own greedy
previews replace the true ones (scheduled sampling). Target-code rows of the input embedding and the LM
head are parametrised as sums of colour, background and mask vectors while training, so a colour pair
never seen with a given outline still gets sensible codes; the sums are materialised when saved.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn
from torch.nn.utils import parametrize
from transformers import GlmImageForConditionalGeneration, GlmImageProcessor

from tools.shapes.model import IMAGE_END_ID
from tools.shapes.training import optimiser_step, resume, save_checkpoint
from tools.shapes.world import (
    COLOUR_PAIRS,
    MASKS,
    PREVIEW_BACKGROUND,
    PREVIEW_SHAPE,
    PREVIEW_SIDE,
    TARGET_CODES,
    TARGET_SIDE,
    Scene,
    quantise,
    render,
)

GENERATED = PREVIEW_SIDE * PREVIEW_SIDE + TARGET_SIDE * TARGET_SIDE + 1  # 273 = the pipeline's max_new_tokens


class FactorisedCodes(nn.Module):
    """Rows 0..479 of an embedding (or LM head) = colour + background + mask vectors + a free residual."""

    def __init__(self, dim: int, colours: int = 6) -> None:
        super().__init__()
        self.colour = nn.Parameter(torch.randn(colours, dim) * 0.02)
        self.background = nn.Parameter(torch.randn(colours, dim) * 0.02)
        self.mask = nn.Parameter(torch.randn(MASKS, dim) * 0.02)
        pairs = torch.tensor(COLOUR_PAIRS)
        codes = torch.arange(TARGET_CODES)
        self.register_buffer("colour_idx", pairs[codes // MASKS, 0], persistent=False)
        self.register_buffer("background_idx", pairs[codes // MASKS, 1], persistent=False)
        self.register_buffer("mask_idx", codes % MASKS, persistent=False)

    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        factored = (
            self.colour[self.colour_idx] + self.background[self.background_idx] + self.mask[self.mask_idx]
        )
        return torch.cat([weight[:TARGET_CODES] * 0.1 + factored, weight[TARGET_CODES:]], dim=0)


def factorise(module: nn.Module) -> None:
    """Parametrise ``module.weight``'s target-code rows (training only; see :func:`materialise`)."""
    parametrize.register_parametrization(module, "weight", FactorisedCodes(module.weight.shape[1]))


def materialise(module: nn.Module) -> None:
    if parametrize.is_parametrized(module, "weight"):
        parametrize.remove_parametrizations(module, "weight", leave_parametrized=True)


@dataclass
class ARExample:
    prompt: list[int]
    preview: torch.Tensor  # (256,)
    target: torch.Tensor  # (16,)


def prompt_ids(processor: GlmImageProcessor, caption: str) -> list[int]:
    """The pipeline's prompt for a 128x128 T2I request (what ``GlmImageARStage.prepare`` builds)."""
    inputs = processor.apply_chat_template(
        [[{"role": "user", "content": [{"type": "text", "text": caption}]}]],
        tokenize=True,
        target_h=128,
        target_w=128,
        return_dict=True,
        return_tensors="pt",
    )
    return inputs["input_ids"][0].tolist()


def make_examples(processor: GlmImageProcessor, scenes: Sequence[Scene]) -> list[ARExample]:
    out = []
    for scene in scenes:
        codes = quantise(render(scene))
        out.append(
            ARExample(
                prompt_ids(processor, scene.caption),
                torch.from_numpy(codes.preview.reshape(-1)),
                torch.from_numpy(codes.target.reshape(-1)),
            )
        )
    return out


def grid_positions(prompt_len: int) -> torch.Tensor:
    """(3, 273) rope positions of the generated tokens (as get_rope_index's decode table)."""
    L = prompt_len
    i, j = torch.meshgrid(torch.arange(PREVIEW_SIDE), torch.arange(PREVIEW_SIDE), indexing="ij")
    preview = torch.stack([torch.full((PREVIEW_SIDE**2,), L), L + i.reshape(-1), L + j.reshape(-1)])
    t0 = L + PREVIEW_SIDE
    i, j = torch.meshgrid(torch.arange(TARGET_SIDE), torch.arange(TARGET_SIDE), indexing="ij")
    target = torch.stack([torch.full((TARGET_SIDE**2,), t0), t0 + i.reshape(-1), t0 + j.reshape(-1)])
    end = torch.full((3, 1), t0 + TARGET_SIDE)
    return torch.cat([preview, target, end], dim=1)


def corrupt_preview(preview: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """A plausibly wrong preview: some cells flipped and/or the silhouette shifted by one cell."""
    grid = preview.reshape(PREVIEW_SIDE, PREVIEW_SIDE).clone()
    if torch.rand((), generator=gen) < 0.5:
        dy, dx = torch.randint(-1, 2, (2,), generator=gen).tolist()
        grid = torch.roll(grid, shifts=(dy, dx), dims=(0, 1))
    rate = float(torch.rand((), generator=gen)) * 0.08
    flips = torch.rand(grid.shape, generator=gen) < rate
    grid = torch.where(flips, PREVIEW_SHAPE + PREVIEW_BACKGROUND - grid, grid)
    return grid.reshape(-1)


def corrupt_target(target: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """Target codes with wrong colour pairs and mask bits here and there.

    Teacher-forced, every target code after the first could simply copy its colours from the one
    before; free-running, the first one is then a guess that all the others repeat. Wrong colours in
    the inputs (labels stay true) make every position read the colours from the caption.
    """
    n = target.numel()
    pair, mask = target // MASKS, target % MASKS
    share = 1.0 if torch.rand((), generator=gen) < 0.3 else 0.3
    swap = torch.rand(n, generator=gen) < share
    pair = torch.where(swap, torch.randint(len(COLOUR_PAIRS), (n,), generator=gen), pair)
    bits = (torch.rand(n, 4, generator=gen) < 0.05).long() * torch.tensor([1, 2, 4, 8])
    return pair * MASKS + (mask ^ bits.sum(-1))


@dataclass
class ARBatch:
    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    position_ids: torch.Tensor  # (3, B, S)
    labels: torch.Tensor  # next-token labels aligned with input positions (-100: no loss)
    weights: torch.Tensor


def make_batch(
    examples: Sequence[ARExample], shown: Sequence[torch.Tensor] | None = None, target_weight: float = 4.0
) -> ARBatch:
    """Left-padded batch. ``shown`` (optional, (272,) each) replaces the true preview + target in the
    inputs only; the labels are always the true codes."""
    seqs, poss, labs, wts = [], [], [], []
    for k, ex in enumerate(examples):
        L = len(ex.prompt)
        generated = torch.cat([ex.preview, ex.target, torch.tensor([IMAGE_END_ID])])
        grids = shown[k] if shown is not None else generated[:-1]
        inputs = torch.cat([torch.tensor(ex.prompt), grids, torch.tensor([IMAGE_END_ID])])
        text_pos = torch.arange(L).expand(3, L)
        positions = torch.cat([text_pos, grid_positions(L)], dim=1)
        # The output at input position p predicts token p+1: the image start (L-1) predicts preview[0].
        labels = torch.full((inputs.numel(),), -100, dtype=torch.long)
        labels[L - 1 : L - 1 + GENERATED] = generated
        weights = torch.zeros(inputs.numel())
        weights[L - 1 : L - 1 + GENERATED] = 1.0
        weights[L - 1 + PREVIEW_SIDE**2 : L - 1 + GENERATED] = target_weight
        seqs.append(inputs)
        poss.append(positions)
        labs.append(labels)
        wts.append(weights)
    width = max(s.numel() for s in seqs)
    B = len(seqs)
    input_ids = torch.zeros(B, width, dtype=torch.long)
    mask = torch.zeros(B, width, dtype=torch.long)
    position_ids = torch.ones(3, B, width, dtype=torch.long)
    labels = torch.full((B, width), -100, dtype=torch.long)
    weights = torch.zeros(B, width)
    for b, (s, p, lab, w) in enumerate(zip(seqs, poss, labs, wts, strict=True)):
        n = s.numel()
        input_ids[b, width - n :] = s
        mask[b, width - n :] = 1
        position_ids[:, b, width - n :] = p
        labels[b, width - n :] = lab
        weights[b, width - n :] = w
    return ARBatch(input_ids, mask, position_ids, labels, weights)


def _logits(model: GlmImageForConditionalGeneration, batch: ARBatch) -> torch.Tensor:
    out = model(
        input_ids=batch.input_ids, attention_mask=batch.attention_mask, position_ids=batch.position_ids
    )
    return out.logits.float()


def batch_loss(model: GlmImageForConditionalGeneration, batch: ARBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """Weighted next-token loss and per-token argmax correctness (teacher-forced accuracy)."""
    logits = _logits(model, batch)
    valid = batch.labels >= 0
    ce = nn.functional.cross_entropy(logits[valid], batch.labels[valid], reduction="none")
    w = batch.weights[valid]
    loss = (ce * w).sum() / w.sum()
    correct = logits[valid].argmax(-1) == batch.labels[valid]
    return loss, correct


@torch.no_grad()
def parallel_decode(
    model: GlmImageForConditionalGeneration,
    examples: Sequence[ARExample],
    start: Sequence[torch.Tensor] | None = None,
    iterations: int | None = None,
) -> torch.Tensor:
    """Greedy decoding by fixed-point (Jacobi) iteration: (N, 273) generated ids.

    Each pass re-predicts every grid token from the previous pass's tokens in one parallel forward. Run
    to convergence (``iterations=None``) the result is exactly greedy ``generate``'s (a fixed point means
    every token is the argmax given the tokens before it), at a fraction of the cost; a few passes from
    the true codes give the model's own slightly-wrong grids for scheduled sampling.
    """
    was_training = model.training
    model.eval()
    n = len(examples)
    if start is None:
        current = torch.full((n, GENERATED - 1), PREVIEW_BACKGROUND, dtype=torch.long)
    else:
        current = torch.stack(list(start))
    limit = iterations if iterations is not None else GENERATED
    out = None
    for _ in range(limit):
        batch = make_batch(examples, list(current))
        logits = _logits(model, batch)
        width = batch.input_ids.shape[1]
        # Generated tokens are predicted at the last 273 input positions but one (the end's output is unused).
        out = logits[:, width - GENERATED - 1 : width - 1].argmax(-1)
        if torch.equal(out[:, :-1], current):
            break
        current = out[:, :-1]
    model.train(was_training)
    return out


def probe_scores(model: GlmImageForConditionalGeneration, examples: Sequence[ARExample]) -> dict[str, float]:
    """Exact-match rates of greedy free-running grids (preview, target) and the share of right target cells."""
    gen = torch.cat([parallel_decode(model, examples[i : i + 48]) for i in range(0, len(examples), 48)])
    n_prev = PREVIEW_SIDE**2
    truth_p = torch.stack([e.preview for e in examples])
    truth_t = torch.stack([e.target for e in examples])
    target = gen[:, n_prev : n_prev + TARGET_SIDE**2]
    return {
        "preview": (gen[:, :n_prev] == truth_p).all(1).float().mean().item(),
        "target": (target == truth_t).all(1).float().mean().item(),
        "target_cells": (target == truth_t).float().mean().item(),
        "ends": (gen[:, -1] == IMAGE_END_ID).float().mean().item(),
    }


def lr_at(step: int, total: int, peak: float, warmup: int = 200) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return peak * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def train_ar(
    model: GlmImageForConditionalGeneration,
    processor: GlmImageProcessor,
    train: Sequence[Scene],
    evals: dict[str, Sequence[Scene]],
    *,
    steps: int,
    ckpt: Path,
    batch_size: int = 16,
    lr: float = 3e-3,
    own_from: float = 0.3,
    eval_every: int = 500,
    seed: int = 0,
    log: Callable[[str], None] = print,
) -> GlmImageForConditionalGeneration:
    """Train (resuming from ``ckpt`` if it exists); returns the model with materialised embeddings.

    Each sample's inputs show the true preview, a corrupted one, or (after ``own_from`` of the steps)
    the model's own greedy preview after two parallel passes; target inputs are corrupted half the time.
    """
    lm = model.model.language_model
    factorise(lm.embed_tokens)
    factorise(model.lm_head)
    examples = make_examples(processor, train)
    eval_sets = {name: make_examples(processor, sc) for name, sc in evals.items()}
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01, betas=(0.9, 0.98))
    gen = torch.Generator().manual_seed(seed)
    step = resume(ckpt, model, opt, gen)
    if step:
        log(f"[ar] resumed at step {step}")
    t0 = time.time()
    model.train()
    n_prev = PREVIEW_SIDE**2
    while step < steps:
        for group in opt.param_groups:
            group["lr"] = lr_at(step, steps, lr)
        idx = torch.randint(len(examples), (batch_size,), generator=gen).tolist()
        batch_ex = [examples[i] for i in idx]
        kinds = torch.rand(batch_size, generator=gen)
        shown = [torch.cat([ex.preview, ex.target]) for ex in batch_ex]
        own = [k for k in range(batch_size) if step >= own_from * steps and kinds[k] < 0.35]
        if own:
            decoded = parallel_decode(
                model, [batch_ex[k] for k in own], [shown[k] for k in own], iterations=2
            )
            for k, row in zip(own, decoded, strict=True):
                shown[k] = torch.cat([row[:n_prev], batch_ex[k].target])
        for k, ex in enumerate(batch_ex):
            preview, target = shown[k][:n_prev], shown[k][n_prev:]
            if k not in own and kinds[k] < 0.7:
                preview = corrupt_preview(ex.preview, gen)
            if torch.rand((), generator=gen) < 0.5:
                target = corrupt_target(ex.target, gen)
            shown[k] = torch.cat([preview, target])
        loss, correct = batch_loss(model, make_batch(batch_ex, shown))
        optimiser_step(opt, loss, model.parameters())
        step += 1
        if step % 50 == 0:
            log(
                f"[ar] step {step}/{steps} loss {loss.item():.4f} tf-acc {correct.float().mean().item():.4f} "
                f"{(time.time() - t0) / 60:.1f} min"
            )
        if step % eval_every == 0 or step == steps:
            for name, exs in eval_sets.items():
                scores = " ".join(f"{k} {v:.3f}" for k, v in probe_scores(model, exs).items())
                log(f"[ar] step {step} greedy free-running {name}: {scores}")
            save_checkpoint(ckpt, model, opt, gen, step)
    model.eval()
    materialise(lm.embed_tokens)
    materialise(model.lm_head)
    return model
