"""The lean loop's token choice for several rows at once (engine/stages/token_choice.py, docs/batching.md
"Token choice"): rows that share their processors choose together only where the running machine's
kernels give each row its alone bits (the check catches a processor that mixes rows), and then each row
gets the token it gets alone, from its own generator."""

from __future__ import annotations

import torch
from transformers import (
    LogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    SuppressTokensLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from engine.stages.token_choice import choice_holds, choice_key, choose, process

VOCABULARY = 300


def talker_like(temperature: float = 0.9) -> list:
    """The tiny talker's processors (its deploy config's sampling and its suppressed start id)."""
    return [
        RepetitionPenaltyLogitsProcessor(1.05),
        SuppressTokensLogitsProcessor([7]),
        TemperatureLogitsWarper(temperature),
        TopKLogitsWarper(40),
        TopPLogitsWarper(0.8),
    ]


class MixesRows(LogitsProcessor):
    """Not row-wise: every row is shifted by the batch's mean (a negative control for the check)."""

    def __call__(self, input_ids, scores):
        return scores - scores.mean()


def test_rows_share_a_key_only_with_the_same_processors_and_sampling():
    assert choice_key(talker_like(), True) == choice_key(talker_like(), True)
    assert choice_key(talker_like(), True) != choice_key(talker_like(), False)
    assert choice_key(talker_like(), True) != choice_key(talker_like(0.7), True)
    assert choice_key([*talker_like(), MixesRows()], True) is None  # not known to be row-wise


def test_the_check_refuses_a_processor_that_mixes_rows():
    like = torch.zeros(1)
    assert not choice_holds([TemperatureLogitsWarper(0.9), MixesRows()], True, 4, VOCABULARY, like)


def test_where_the_check_holds_each_row_gets_its_alone_token():
    generator = torch.Generator().manual_seed(5)
    for sample in (True, False):
        processors = talker_like()
        for rows in (2, 3, 8):
            if not choice_holds(processors, sample, rows, VOCABULARY, torch.zeros(1)):
                continue  # this machine's kernels: the loop picks row by row (tested end to end)
            logits = torch.randn((rows, VOCABULARY), generator=generator) * 3
            sequences = [torch.randint(0, VOCABULARY, (4 + 3 * i,), generator=generator) for i in range(rows)]
            seeds = [100 + i for i in range(rows)]
            together = choose(
                processors, sample, logits, sequences, [torch.Generator().manual_seed(s) for s in seeds]
            )
            for i in range(rows):
                scores = process(processors, sequences[i][None, :], logits[i : i + 1])
                if sample:
                    probs = torch.nn.functional.softmax(scores, dim=-1)
                    own = torch.Generator().manual_seed(seeds[i])
                    alone = int(torch.multinomial(probs, num_samples=1, generator=own)[0, 0])
                else:
                    alone = int(torch.argmax(scores, dim=-1)[0])
                assert together[i] == alone, (sample, rows, i)
