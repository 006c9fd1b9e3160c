"""Qwen2.5-Omni's hand-offs fed known outputs: thinker2talker's prompt and reply rows, talker2code2wav's cut."""

from __future__ import annotations

import pytest
import torch

from engine.processors import INPUT_PROCESSORS, talker2code2wav, thinker2talker

H = 4


def thinker_outputs(prompt_len: int, reply: list[int], stops=(9,)) -> dict:
    """Rows numbered by position (row i is all i), special embeddings 100, 200, 300."""
    rows = torch.arange(prompt_len + len(reply) - 1, dtype=torch.float32)[:, None].repeat(1, H)
    return {
        "latent": rows,
        "prompt_token_ids": torch.arange(prompt_len) + 50,
        "reply_token_ids": torch.tensor(reply),
        "speech_bos_id": 77,
        "speech_text_embeds": torch.tensor([100.0, 200.0, 300.0])[:, None].repeat(1, H),
        "stop_token_ids": list(stops),
        "rng_state": {"cpu": torch.get_rng_state()},
    }


def test_thinker2talker_builds_the_talkers_prompt_and_reply_rows():
    inputs = thinker2talker(thinker_outputs(3, [5, 6, 7, 9]), {})
    # prompt rows 0-2, the voice's start (100), the first reply row (3)
    assert inputs["prompt_embeds"][0, :, 0].tolist() == [0, 1, 2, 100, 3]
    assert inputs["input_text_ids"][0].tolist() == [50, 51, 52, 77, 5]
    # the rest of the reply (rows 4, 5), then text end (200) where the stop id sat, then pads (300)
    assert inputs["thinker_reply_part"][0, :, 0].tolist() == [4, 5, 200, 300]
    assert "rng_state" in inputs


def test_a_reply_cut_by_its_budget_still_ends_with_text_end_then_pad():
    inputs = thinker2talker(thinker_outputs(2, [5, 6, 7]), {})
    assert inputs["thinker_reply_part"][0, :, 0].tolist() == [3, 200, 300]


def test_a_one_token_reply_is_silent():
    assert thinker2talker(thinker_outputs(2, [9]), {}) == {"silent": True}


def test_thinker2talker_names_what_is_missing():
    outputs = thinker_outputs(2, [5, 6])
    del outputs["latent"]
    with pytest.raises(ValueError, match="'latent'"):
        thinker2talker(outputs, {})


def test_talker2code2wav_cuts_at_the_first_stop_id():
    cut = talker2code2wav({"token_ids": torch.tensor([4, 8, 102, 5]), "stop_token_ids": [102, 101]}, {})
    assert cut["codes"].tolist() == [[4, 8]]
    whole = talker2code2wav({"token_ids": torch.tensor([4, 8]), "stop_token_ids": [102, 101]}, {})
    assert whole["codes"].tolist() == [[4, 8]]
    assert set(INPUT_PROCESSORS) >= {"thinker2talker", "talker2code2wav"}
