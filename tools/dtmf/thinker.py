"""Training the thinker (``Qwen2_5OmniThinkerForConditionalGeneration``): ``dial 4 1 7`` -> ``4 1 7``.

Sequences are exactly what the thinker stage builds: the chat template over the request's turns (the
speech system prompt first when the reply is spoken), then the reply and ``<|im_end|>``. Three kinds of
request, equally often: a text chat (``dial K``), a spoken chat (system prompt, ``dial K``) and
``/v1/audio/speech`` (system prompt, ``K``; its reply is teacher-forced at run time, trained here so the
hidden states the talker reads stay familiar). The loss is on the reply's tokens only.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from engine.pipelines.qwen_omni.thinker import SPEECH_SYSTEM_PROMPT
from tools.dtmf.world import random_keys
from tools.shapes.training import optimiser_step, resume, save_checkpoint

FORMS = ("chat", "spoken", "speech")


def messages_for(keys: list[str], form: str) -> list[dict[str, str]]:
    text = " ".join(keys)
    turns = [{"role": "user", "content": text if form == "speech" else f"dial {text}"}]
    if form != "chat":
        turns.insert(0, {"role": "system", "content": SPEECH_SYSTEM_PROMPT})
    return turns


def encode(tokenizer: Any, keys: list[str], form: str) -> tuple[list[int], list[int]]:
    """(prompt ids, reply ids ending with <|im_end|>) as the thinker stage makes them."""
    prompt = tokenizer.apply_chat_template(
        messages_for(keys, form), add_generation_prompt=True, return_dict=True
    )
    reply = tokenizer(" ".join(keys), add_special_tokens=False, split_special_tokens=True)["input_ids"]
    return list(prompt["input_ids"]), [*reply, tokenizer.convert_tokens_to_ids("<|im_end|>")]


def batch_of(tokenizer: Any, samples: list[tuple[list[str], str]]) -> dict[str, torch.Tensor]:
    rows = [encode(tokenizer, keys, form) for keys, form in samples]
    length = max(len(p) + len(r) for p, r in rows)
    ids = torch.full((len(rows), length), tokenizer.pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(rows), length), dtype=torch.long)
    labels = torch.full((len(rows), length), -100, dtype=torch.long)
    for i, (prompt, reply) in enumerate(rows):
        seq = prompt + reply
        ids[i, : len(seq)] = torch.tensor(seq)
        mask[i, : len(seq)] = 1
        labels[i, len(prompt) - 1 : len(seq) - 1] = torch.tensor(reply)  # position t predicts t + 1
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def reply_accuracy(thinker: Any, tokenizer: Any, samples: list[tuple[list[str], str]]) -> tuple[float, float]:
    """Teacher-forced (token accuracy, whole-reply accuracy) over ``samples``."""
    batch = batch_of(tokenizer, samples)
    with torch.no_grad():
        logits = thinker(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    labels = batch["labels"]
    right = (logits.argmax(-1) == labels) | (labels == -100)
    tokens = ((logits.argmax(-1) == labels) & (labels != -100)).sum() / (labels != -100).sum()
    return float(tokens), float(right.all(dim=1).float().mean())


def train_thinker(
    thinker: Any,
    tokenizer: Any,
    *,
    steps: int,
    ckpt: Path,
    batch_size: int = 24,
    lr: float = 2e-3,
    seed: int = 0,
    log: Callable[[str], None] = print,
) -> Any:
    opt = torch.optim.AdamW(thinker.parameters(), lr=lr, weight_decay=0.01)
    gen = torch.Generator().manual_seed(seed)
    step = resume(ckpt, thinker, opt, gen)
    rng = np.random.default_rng(seed + step)
    probe = [(random_keys(np.random.default_rng(10_000 + i), held=True), FORMS[i % 3]) for i in range(60)]
    t0 = time.time()
    thinker.train()
    while step < steps:
        for group in opt.param_groups:
            group["lr"] = lr * min(1.0, (step + 1) / 100) * (0.05 + 0.95 * (1 - step / steps))
        samples = [(random_keys(rng), FORMS[int(rng.integers(3))]) for _ in range(batch_size)]
        batch = batch_of(tokenizer, samples)
        logits = thinker(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        loss = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), batch["labels"].reshape(-1), ignore_index=-100
        )
        optimiser_step(opt, loss, thinker.parameters())
        step += 1
        if step % 100 == 0:
            thinker.eval()
            tokens, whole = reply_accuracy(thinker, tokenizer, probe)
            thinker.train()
            log(
                f"[thinker] step {step}/{steps} loss {loss.item():.4f} held-out tokens {tokens:.3f} "
                f"replies {whole:.3f} {(time.time() - t0) / 60:.1f} min"
            )
        if step % 500 == 0 or step == steps:
            save_checkpoint(ckpt, thinker, opt, gen, step)
    thinker.eval()
    return thinker
