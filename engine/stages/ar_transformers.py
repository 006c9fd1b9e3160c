"""Autoregressive stages on transformers: seeded ``generate`` with streamed progress, deltas and cancellation.

Model families subclass :class:`TransformersARStage` and say how a job becomes model inputs
(:meth:`prepare`) and what extra outputs it leaves (:meth:`finish`). This module owns the generation
loop: sampling parameters, seeding, per-token progress and text deltas, stop on cancel.

Jobs run one at a time. transformers samples from the process-global torch RNG (GLM-Image's own pipeline
reseeds it with the request seed before ``generate``), so batching requests with different seeds would
make each result depend on its neighbours. The vLLM backend batches continuously with per-request seeds.
"""

from __future__ import annotations

import threading
import time
from abc import abstractmethod
from dataclasses import dataclass, field
from typing import Any, cast

import torch
from transformers import StoppingCriteria, StoppingCriteriaList

from engine.events import FinishReason, TokenProgress
from engine.modality import OutputModality
from engine.stages.base import StageCancelled, StageJob, StageRunner

# The RNG is process-global: two AR stages (two engines in one process) must not interleave seeding.
GLOBAL_RNG_LOCK = threading.Lock()
PROGRESS_INTERVAL_S = 0.05


@dataclass
class ARInputs:
    """What :meth:`TransformersARStage.prepare` hands to ``generate``."""

    model_inputs: dict[str, Any]
    max_new_tokens: int
    generate_kwargs: dict[str, Any] = field(default_factory=dict)
    extra_outputs: dict[str, Any] = field(default_factory=dict)

    @property
    def prompt_length(self) -> int:
        return int(self.model_inputs["input_ids"].shape[-1])


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


class _StreamHook(StoppingCriteria):
    """Called by ``generate`` after every token: report progress and deltas, stop on cancel."""

    def __init__(self, stage: TransformersARStage, job: StageJob, prompt_length: int, total: int) -> None:
        self.stage = stage
        self.job = job
        self.prompt_length = prompt_length
        self.total = total
        self.seen = 0
        self.last_report = 0.0

    def __call__(self, input_ids: torch.LongTensor, scores: Any, **kwargs: Any) -> torch.BoolTensor:
        generated = input_ids[0, self.prompt_length :]
        new_ids = generated[self.seen :]
        if new_ids.numel():
            self.stage.emit_delta(self.job, new_ids, generated)
            self.seen = generated.numel()
        now = time.monotonic()
        if now - self.last_report >= PROGRESS_INTERVAL_S or self.seen >= self.total:
            self.last_report = now
            self.job.emit(
                TokenProgress(
                    self.job.request_id, self.job.index, self.stage.stage_id, step=self.seen, total=self.total
                )
            )
        stop = self.job.cancelled
        # torch annotates every tensor as Tensor; BoolTensor is the name transformers' signature uses.
        return cast(
            torch.BoolTensor,
            torch.full((input_ids.shape[0],), stop, dtype=torch.bool, device=input_ids.device),
        )


class TransformersARStage(StageRunner):
    """An AR stage whose model is a transformers ``generate``-capable model."""

    kind = "ar"
    backend = "transformers"

    model: Any = None

    @abstractmethod
    def prepare(self, job: StageJob) -> ARInputs:
        """Turn a job into model inputs and the number of tokens to generate."""

    def finish(self, job: StageJob, generated: torch.Tensor, prepared: ARInputs) -> dict[str, Any]:
        """Extra outputs after generation (e.g. source-image ids); default: those ``prepare`` left."""
        return dict(prepared.extra_outputs)

    def decode(self, ids: torch.Tensor) -> str:
        raise NotImplementedError(f"stage {self.stage_id} cannot produce text")

    @property
    def modalities(self) -> tuple[OutputModality, ...]:
        return self.stage.output_modalities

    def emit_delta(self, job: StageJob, new_ids: torch.Tensor, generated: torch.Tensor) -> None:
        """Add one DELTA step: new token ids and/or new text, per the stage's output modalities."""
        delta: dict[str, Any] = {}
        if OutputModality.TOKEN_IDS in self.modalities:
            delta["token_ids"] = new_ids.detach().cpu().clone()
        if OutputModality.TEXT in self.modalities:
            piece = job.advance_text(self.stage_id, self.decode(generated))
            if piece:
                delta["text"] = piece
        if delta:
            job.add_output(delta)

    def total_steps(self, job: StageJob) -> int:
        return int(job.scratch.get("max_new_tokens", 0))

    def run(self, jobs: list[StageJob]) -> None:
        for job in jobs:
            self._run_one(job)

    def _generation_limits(self, job: StageJob, prepared: ARInputs) -> dict[str, Any]:
        params = job.params
        limits: dict[str, Any] = {"max_new_tokens": prepared.max_new_tokens}
        if params.get("min_tokens"):
            limits["min_new_tokens"] = int(params["min_tokens"])
        stop_ids = list(params.get("stop_token_ids") or [])
        if params.get("ignore_eos"):
            limits["eos_token_id"] = stop_ids or None
        elif stop_ids:
            eos = self.model.generation_config.eos_token_id
            eos_list = [eos] if isinstance(eos, int) else list(eos or [])
            limits["eos_token_id"] = eos_list + [i for i in stop_ids if i not in eos_list]
        return limits

    def _run_one(self, job: StageJob) -> None:
        if job.cancelled:
            raise StageCancelled()
        prepared = self.prepare(job)
        job.scratch["max_new_tokens"] = prepared.max_new_tokens
        job.input_tokens = prepared.prompt_length
        hook = _StreamHook(self, job, prepared.prompt_length, prepared.max_new_tokens)
        kwargs = {
            **prepared.model_inputs,
            **sampling_kwargs(job.params),
            **self._generation_limits(job, prepared),
            **prepared.generate_kwargs,
            "stopping_criteria": StoppingCriteriaList([hook]),
        }
        seed = int(job.params["seed"])
        with GLOBAL_RNG_LOCK, torch.inference_mode():
            torch.manual_seed(seed)
            output = self.model.generate(**kwargs)
        if job.cancelled:
            raise StageCancelled()
        generated = output[0, prepared.prompt_length :].detach().cpu()
        if generated.numel() > hook.seen:  # the last token(s) after the final hook call
            self.emit_delta(job, generated[hook.seen :], generated)
        job.output_tokens = int(generated.numel())
        job.finish_reason = (
            FinishReason.LENGTH if generated.numel() >= prepared.max_new_tokens else FinishReason.STOP
        )
        extras = self.finish(job, generated, prepared)
        if extras:
            job.add_output(extras)
