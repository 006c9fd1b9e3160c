"""The lean loop's token choice for several rows at once (docs/batching.md, "Token choice").

Each row of the lean loop picks its next token as ``generate`` would: its logits processors, then argmax
or a draw from the softmax with the row's own generator. Done row by row, that is ~0.1 ms of small calls
per row and token (most of a talker step at eight rows). Rows whose processors are the same (same kinds,
same settings: the deploy config's sampling, as a talker's rows share) can take each call together on
their stacked logits, provided every row gets the bits it gets alone: the processors below work row by
row (element-wise, or per row along the vocabulary), and :func:`choice_holds` checks that on the running
machine's kernels for each group's processors and row count before it is used (else row by row). The
draw stays per row, from each row's generator.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

import torch
from transformers import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    SuppressTokensLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

# Processors whose output row depends on that row's logits and ids only.
ROW_WISE = (
    RepetitionPenaltyLogitsProcessor,
    SuppressTokensLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
    MinPLogitsWarper,
)
CHECK_SEED = 0  # the random logits and ids the check compares on


def choice_key(processors: Sequence[Any], sample: bool) -> tuple[Any, ...] | None:
    """What rows must share to choose together: each processor's kind and settings, and whether they
    sample; None when a processor is not one of :data:`ROW_WISE` (or depends on where a row's prompt
    ends)."""
    key: list[Any] = [sample]
    for processor in processors:
        if not isinstance(processor, ROW_WISE):
            return None
        if getattr(processor, "prompt_ignore_length", None):  # reads the row's own prompt length
            return None
        settings = []
        for name, value in sorted(vars(processor).items()):
            if isinstance(value, torch.Tensor):
                value = (str(value.dtype), tuple(value.reshape(-1).tolist()))
            settings.append((name, value))
        key.append((type(processor).__name__, tuple(settings)))
    return tuple(key)


def seen_ids(sequences: Sequence[torch.Tensor]) -> torch.Tensor:
    """The rows' ids so far as one (rows, longest) tensor, each row padded with its own last id: a
    repeated id changes nothing a row-wise processor computes (the repetition penalty's scatter writes
    the same value for every copy of an id)."""
    longest = max(int(ids.numel()) for ids in sequences)
    rows = []
    for ids in sequences:
        pad = ids[-1:].expand(longest - int(ids.numel()))
        rows.append(torch.cat([ids, pad]))
    return torch.stack(rows)


def process(processors: Sequence[Any], seen: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
    """The processors in order on ``scores`` (rows, vocabulary) with the ids ``seen`` (rows, length)."""
    for processor in processors:
        scores = processor(cast(torch.LongTensor, seen), cast(torch.FloatTensor, scores))
    return scores


def choose(
    processors: Sequence[Any],
    sample: bool,
    logits: torch.Tensor,
    sequences: Sequence[torch.Tensor],
    generators: Sequence[torch.Generator | None],
) -> list[int]:
    """Each row's next token from its ``logits`` row, ids ``sequences`` and generator, the processors
    applied to all rows at once (call where :func:`choice_holds`)."""
    scores = process(processors, seen_ids(sequences), logits) if processors else logits
    if not sample:
        return [int(t) for t in torch.argmax(scores, dim=-1).tolist()]
    probs = torch.nn.functional.softmax(scores, dim=-1)
    return [
        int(torch.multinomial(probs[i : i + 1], num_samples=1, generator=generators[i])[0, 0])
        for i in range(probs.shape[0])
    ]


def choice_holds(
    processors: Sequence[Any], sample: bool, rows: int, vocabulary: int, like: torch.Tensor
) -> bool:
    """Whether ``rows`` rows choosing together with ``processors`` get, on this machine's kernels, the
    processed scores (and, sampling, the probabilities and draws) each row gets alone: random logits
    and ids of several lengths, every row compared bit for bit."""
    generator = torch.Generator().manual_seed(CHECK_SEED)
    logits = (torch.randn((rows, vocabulary), generator=generator) * 4).to(like)
    sequences = [
        torch.randint(0, vocabulary, (3 + 5 * i,), generator=generator).to(like.device) for i in range(rows)
    ]
    together = process(processors, seen_ids(sequences), logits.clone())
    alone = [process(processors, seq[None, :], logits[i : i + 1].clone()) for i, seq in enumerate(sequences)]
    if not all(torch.equal(together[i : i + 1], alone[i]) for i in range(rows)):
        return False
    if not sample:
        return True
    probs = torch.nn.functional.softmax(together, dim=-1)
    for i in range(rows):
        own = torch.nn.functional.softmax(alone[i], dim=-1)
        if not torch.equal(probs[i : i + 1], own):
            return False
        draws = [torch.Generator(device=like.device).manual_seed(i) for _ in range(2)]
        batched = torch.multinomial(probs[i : i + 1], num_samples=1, generator=draws[0])
        if not torch.equal(batched, torch.multinomial(own, num_samples=1, generator=draws[1])):
            return False
    return True
