"""Training the talker (``Qwen2_5OmniTalkerForConditionalGeneration``): thinker rows -> codec ids.

Its inputs are exactly what ``thinker2talker`` (engine/processors.py) hands over at run time, computed
with the trained thinker (frozen): per position the thinker's last hidden state plus its input
embedding, the prompt's rows and the voice's start row as the prompt, then one reply row (then the
text-end row, then pads) added to each code it reads back. Teacher-forced: the whole code sequence in
one forward, the prompt's positions carrying the pad and start codec embeddings as generate adds them.
The tokenizer paces the reply (8 tokens a key, tools/dtmf/model.py), so the code at step ``t`` is the
tone of the key whose group row ``t`` belongs to (its first 5 rows) or silence (its last 3), then the
end id when the pad rows begin.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from engine.processors import thinker2talker
from tools.dtmf.thinker import FORMS, encode
from tools.dtmf.world import codes_of, random_keys
from tools.shapes.training import optimiser_step, resume, save_checkpoint


def talker_inputs(thinker: Any, tokenizer: Any, keys: list[str], form: str, bos: int) -> dict[str, Any]:
    """``thinker2talker``'s output for this request, its reply teacher-forced (as the stage computes it)."""
    prompt, reply = encode(tokenizer, keys, form)
    ids = torch.tensor([prompt + reply[:-1]])
    with torch.no_grad():
        out = thinker(input_ids=ids, attention_mask=torch.ones_like(ids), output_hidden_states=True)
        rows = (out.hidden_states[-1] + out.hidden_states[0])[0]
        text = [
            bos,
            tokenizer.convert_tokens_to_ids("<|tts_text_eod|>"),
            tokenizer.convert_tokens_to_ids("<|tts_pad|>"),
        ]
        embeds = thinker.get_input_embeddings()(torch.tensor(text))
    return thinker2talker(
        {
            "latent": rows,
            "prompt_token_ids": torch.tensor(prompt),
            "reply_token_ids": torch.tensor(reply),
            "speech_bos_id": bos,
            "speech_text_embeds": embeds,
            "stop_token_ids": [tokenizer.convert_tokens_to_ids("<|im_end|>")],
        },
        {},
    )


def sequence(talker: Any, inputs: dict[str, Any], codes: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(input embeddings (L, H) of the teacher-forced talker, targets (L,) with -100 off the codes)."""
    embed = talker.get_input_embeddings()
    config = talker.config
    prefill = inputs["prompt_embeds"][0].clone()
    prefill[-1] += embed.weight[config.tts_codec_start_token_id]
    prefill[-2] += embed.weight[config.tts_codec_pad_token_id]
    targets = [*codes, config.tts_codec_end_token_id]
    reply = inputs["thinker_reply_part"][0]
    steps = torch.arange(len(targets) - 1).clamp(max=reply.shape[0] - 1)
    decode = embed(torch.tensor(targets[:-1])) + reply[steps]
    labels = torch.full((prefill.shape[0] + len(targets) - 1,), -100, dtype=torch.long)
    labels[prefill.shape[0] - 1 :] = torch.tensor(targets)
    return torch.cat([prefill, decode]), labels


def talker_logits(talker: Any, embeds: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    hidden = talker.model(
        inputs_embeds=talker.thinker_to_talker_proj(embeds),
        attention_mask=mask,
        position_ids=positions[None].expand(3, -1, -1),
    ).last_hidden_state
    return talker.codec_head(hidden).float()


def make_batch(talker: Any, pool: list[tuple[dict[str, Any], list[int]]]) -> tuple[torch.Tensor, ...]:
    """Padded (embeds, labels, mask) of ``pool`` entries (thinker2talker inputs, codes)."""
    seqs = [sequence(talker, inputs, codes) for inputs, codes in pool]
    length = max(s.shape[0] for s, _ in seqs)
    embeds = torch.zeros(len(seqs), length, seqs[0][0].shape[-1])
    labels = torch.full((len(seqs), length), -100, dtype=torch.long)
    mask = torch.zeros(len(seqs), length, dtype=torch.long)
    for i, (e, lab) in enumerate(seqs):
        embeds[i, : e.shape[0]], labels[i, : e.shape[0]], mask[i, : e.shape[0]] = e, lab, 1
    return embeds, labels, mask


def make_pool(
    thinker: Any, tokenizer: Any, voice_bos: list[int], rng: np.random.Generator, n: int, held: bool
) -> list[tuple[dict[str, Any], list[int]]]:
    """``n`` requests' talker inputs (computed once: the thinker is frozen) and the codes that speak them."""
    pool = []
    for i in range(n):
        keys = random_keys(rng, held=held)
        inputs = talker_inputs(thinker, tokenizer, keys, FORMS[i % 3], voice_bos[(i // 3) % len(voice_bos)])
        pool.append((inputs, codes_of(keys)))
    return pool


def train_talker(
    talker: Any,
    thinker: Any,
    tokenizer: Any,
    voice_bos: list[int],
    *,
    steps: int,
    ckpt: Path,
    batch_size: int = 16,
    pool_size: int = 1500,
    lr: float = 2e-3,
    seed: int = 0,
    log: Callable[[str], None] = print,
) -> Any:
    opt = torch.optim.AdamW(talker.parameters(), lr=lr, weight_decay=0.01)
    gen = torch.Generator().manual_seed(seed)
    step = resume(ckpt, talker, opt, gen)
    t0 = time.time()
    pool = make_pool(thinker, tokenizer, voice_bos, np.random.default_rng(seed), pool_size, held=False)
    probe = make_pool(thinker, tokenizer, voice_bos, np.random.default_rng(seed + 1), 60, held=True)
    log(f"[talker] thinker rows of {len(pool)} requests in {(time.time() - t0) / 60:.1f} min")
    talker.train()
    while step < steps:
        for group in opt.param_groups:
            group["lr"] = lr * min(1.0, (step + 1) / 100) * (0.05 + 0.95 * (1 - step / steps))
        picks = torch.randint(len(pool), (batch_size,), generator=gen).tolist()
        embeds, labels, mask = make_batch(talker, [pool[i] for i in picks])
        logits = talker_logits(talker, embeds, mask)
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))
        optimiser_step(opt, loss, talker.parameters())
        step += 1
        if step % 100 == 0:
            talker.eval()
            with torch.no_grad():
                embeds, labels, mask = make_batch(talker, probe)
                pred = talker_logits(talker, embeds, mask).argmax(-1)
            talker.train()
            right = ((pred == labels) | (labels == -100)).all(dim=1).float().mean()
            log(
                f"[talker] step {step}/{steps} loss {loss.item():.4f} held-out sequences right "
                f"(teacher-forced) {right:.3f} {(time.time() - t0) / 60:.1f} min"
            )
        if step % 500 == 0 or step == steps:
            save_checkpoint(ckpt, talker, opt, gen, step)
    talker.eval()
    return talker
