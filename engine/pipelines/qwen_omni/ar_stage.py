"""The thinker's and talker's shared AR loop: ``generate`` one request at a time on one seeded stream.

transformers' one-shot ``Qwen2_5OmniForConditionalGeneration.generate`` draws the thinker's samples,
the talker's and code2wav's starting noise from one RNG stream, seeded once. The split stages keep that
stream: the thinker seeds it with the request's seed, each stage hands its RNG state to the next with
its outputs (``rng_state``), and the next stage continues from it. So the split pipeline makes the
one-shot's samples, whatever ran between the stages (docs/speech.md, "Stages and hand-offs").
"""

from __future__ import annotations

from typing import Any

import torch

from engine.pipelines.qwen_omni.checkpoint import rng_state, set_rng_state
from engine.stages.ar_transformers import (
    GLOBAL_RNG_LOCK,
    ARInputs,
    TransformersARStage,
)
from engine.stages.base import StageCancelled, StageJob, intra_op_threads_for
from engine.streaming import publish_partial


class OmniARStage(TransformersARStage):
    """An AR stage of Qwen2.5-Omni: ``generate`` per request, on the stream the previous stage left.

    Jobs run one at a time (the talker's rope offsets live on the model between calls), so a request's
    tokens never depend on what else is queued; ``max_num_seqs`` bounds how many a batch takes.
    """

    def prepare_job(self, job: StageJob) -> ARInputs | None:
        """The job's generate inputs, or None when it has nothing to generate (a silent reply)."""
        return self.prepare(job)

    def outputs(
        self, job: StageJob, generated: torch.Tensor, prepared: ARInputs, result: Any
    ) -> dict[str, Any]:
        """What the stage hands on besides its streamed deltas (``result``: what generate returned)."""
        return dict(prepared.extra_outputs)

    def empty_outputs(self, job: StageJob) -> dict[str, Any]:
        """The outputs of a job with nothing to generate."""
        return {}

    def emit_delta(self, job: StageJob, new_ids: torch.Tensor, generated: torch.Tensor) -> None:
        """Add the DELTA, then hand the outputs so far to a stage that consumes this one in chunks
        (code2wav reading the talker's codes; engine/streaming.py)."""
        super().emit_delta(job, new_ids, generated)
        publish_partial(job)

    @property
    def intra_op_threads(self) -> int | None:
        return None if self.model is None else intra_op_threads_for([self.model], self.device)

    def _run_one(self, job: StageJob, prepared: ARInputs | None = None) -> None:
        if job.cancelled:
            raise StageCancelled()
        prepared = prepared or self.prepare_job(job)
        state = job.inputs.get("rng_state")
        if prepared is None:
            job.add_output({**self.empty_outputs(job), **({"rng_state": state} if state is not None else {})})
            return
        kwargs, hook = self.generate_call(job, prepared)
        with GLOBAL_RNG_LOCK, torch.inference_mode():
            if state is None:
                torch.manual_seed(int(job.params["seed"]))
            else:
                set_rng_state(state, self.device)
            result = self.model.generate(**kwargs)
            after = rng_state(self.device)
        sequences = result if isinstance(result, torch.Tensor) else result.sequences
        generated = self.generated_tokens(job, sequences, prepared, hook)
        job.add_output({**self.outputs(job, generated, prepared, result), "rng_state": after})
