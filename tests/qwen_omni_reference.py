"""transformers' one-shot Qwen2.5-Omni ``generate``, called as the split engine's stages run: the reference
the engine's samples are compared with (tests/test_qwen_omni.py, tests/test_qwen_omni_speak.py)."""

from __future__ import annotations

from typing import Any

import torch

THINKER_MAX, TALKER_MAX = 24, 60  # the preset's budgets (assets/deploy/tiny-qwen-omni.yaml)


def generate_one_shot(
    model: Any, inputs: dict[str, Any], *, seed: int, voice: str, temperature: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``model.generate(..., return_audio)`` on ``inputs`` with the preset's budgets and the thinker's
    sampling (greedy when ``temperature`` is 0), seeded, on one intra-op thread (the stages' thread count,
    docs/batching.md: the same kernels). Returns the thinker's sequences and the waveform."""
    talker = model.config.talker_config
    thinker = (
        {"thinker_do_sample": True, "thinker_temperature": temperature, "thinker_top_k": 40}
        if temperature
        else {"thinker_do_sample": False}
    )
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        torch.manual_seed(seed)
        return model.generate(
            **inputs,
            speaker=voice,
            thinker_max_new_tokens=THINKER_MAX,
            talker_max_new_tokens=TALKER_MAX,
            talker_eos_token_id=[talker.tts_codec_pad_token_id, talker.tts_codec_end_token_id],
            **thinker,
        )
    finally:
        torch.set_num_threads(before)
