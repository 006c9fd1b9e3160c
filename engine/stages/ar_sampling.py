"""Sampling options of the transformers AR stages: vLLM-style parameters -> ``generate`` options, and the
logits processors the lean decode loop applies itself (engine/stages/ar_transformers.py,
docs/batching.md)."""

from __future__ import annotations

from typing import Any

from transformers.generation.logits_process import (
    MinNewTokensLengthLogitsProcessor,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)


def sampling_kwargs(params: dict[str, Any]) -> dict[str, Any]:
    """vLLM-style sampling parameters -> ``generate`` keyword arguments (only those that are set)."""
    kwargs: dict[str, Any] = {}
    temperature = params.get("temperature")
    if temperature is not None and temperature == 0:
        kwargs["do_sample"] = False
        return kwargs
    kwargs["do_sample"] = True
    if temperature is not None:
        kwargs["temperature"] = float(temperature)
    if params.get("top_p") is not None:
        kwargs["top_p"] = float(params["top_p"])
    if params.get("top_k") is not None:
        kwargs["top_k"] = max(0, int(params["top_k"]))  # vLLM's -1 and transformers' 0 both mean "off"
    if params.get("min_p") is not None:
        kwargs["min_p"] = float(params["min_p"])
    if params.get("repetition_penalty") is not None:
        kwargs["repetition_penalty"] = float(params["repetition_penalty"])
    return kwargs


# Logits processors the lean loop applies itself (in the order transformers builds them); any other one
# (a model's generation_config asking for more) sends the request to ``generate``. A family may add its
# own (``TransformersARStage.lean_processors``).
LEAN_PROCESSORS: tuple[type, ...] = (
    RepetitionPenaltyLogitsProcessor,
    MinNewTokensLengthLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
    MinPLogitsWarper,
)
