"""What a finished variant of a request returns: its final stages' outputs as a :class:`RunOutput`."""

from __future__ import annotations

from typing import Any

import torch

from engine.config import PipelineConfig
from engine.events import FinishReason, RunOutput
from engine.modality import OutputModality
from engine.workers import Variant


def run_output(config: PipelineConfig, wanted: tuple[OutputModality, ...], variant: Variant) -> RunOutput:
    """The variant's outputs of the ``wanted`` modalities, merged over the pipeline's final stages, with
    its finish reason (the last final stage's) and token counts (all its stages')."""
    merged: dict[str, Any] = {}
    for stage in config.final_stages:
        merged.update(variant.outputs.get(stage.stage_id, {}))
    text = merged.get("text") if OutputModality.TEXT in wanted else None
    images = tuple(merged.get("image") or ()) if OutputModality.IMAGE in wanted else ()
    token_ids = None
    if OutputModality.TOKEN_IDS in wanted and merged.get("token_ids") is not None:
        token_ids = tuple(int(i) for i in torch.as_tensor(merged["token_ids"]).reshape(-1).tolist())
    jobs = variant.jobs.values()
    last_ar = [j for sid, j in variant.jobs.items() if config.stage(sid).final_output]
    finish_reason = FinishReason(last_ar[-1].finish_reason) if last_ar else FinishReason.STOP
    return RunOutput(
        index=variant.index,
        seed=variant.seed,
        text=text,
        images=images,
        token_ids=token_ids,
        audio=merged["audio"].reshape(-1).numpy()
        if OutputModality.AUDIO in wanted and "audio" in merged
        else None,
        sample_rate=int(merged.get("sample_rate") or 0),
        finish_reason=finish_reason,
        input_tokens=sum(j.input_tokens for j in jobs),
        output_tokens=sum(j.output_tokens for j in jobs),
    )
