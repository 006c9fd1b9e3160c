"""The thinker's and talker's shared AR stage: one seeded RNG stream handed from stage to stage.

transformers' one-shot ``Qwen2_5OmniForConditionalGeneration.generate`` draws the thinker's samples,
the talker's and code2wav's starting noise from one RNG stream, seeded once. The split stages keep that
stream: the thinker seeds it with the request's seed, each stage hands its RNG state to the next with
its outputs (``rng_state``), and the next stage continues from it. So the split pipeline makes the
one-shot's samples, whatever ran between the stages (docs/speech.md, "Stages and hand-offs"). The
thinker and the talker decode their requests together in the lean loop, each row on a generator of its
own that starts (the thinker) or continues (the talker) the stream, and hands its state on.
"""

from __future__ import annotations

from typing import Any

import torch

from engine.pipelines.qwen_omni.checkpoint import rng_state, set_rng_state
from engine.stages.ar_transformers import (
    DECODE_STATE,
    GLOBAL_RNG_LOCK,
    ARInputs,
    TransformersARStage,
)
from engine.stages.base import StageCancelled, StageJob, intra_op_threads_for
from engine.streaming import publish_partial

GENERATOR_KEY = "rng_generator"  # job.scratch: a lean-loop row's generator


class OmniARStage(TransformersARStage):
    """An AR stage of Qwen2.5-Omni: ``generate`` per request, on the stream the previous stage left.

    Through ``generate`` jobs run one at a time (the talker's forward keeps rope offsets on its model
    between calls), so a request's tokens never depend on what else is queued. A stage
    with a lean decoder (talker_decoder.py, thinker_decoder.py in engine/pipelines/qwen_omni) decodes its
    rows together instead, each row drawing from a generator that continues the stream handed to it, else
    the seed's (:meth:`row_generator`) and handing on that generator's state (:meth:`finish`).
    ``prepare_job`` returns None for a job with nothing to generate (a silent reply).
    """

    def row_generator(self, job: StageJob, device: torch.device) -> torch.Generator:
        """The lean loop's generator for the row: the RNG state the previous stage handed on (what the
        global RNG holds in ``_run_one`` before ``generate``), else the seed's."""
        state = job.inputs.get("rng_state")
        if state is None:
            generator = super().row_generator(job, device)
        else:
            generator = torch.Generator(device=device)
            generator.set_state(state[device.type])
        job.scratch[GENERATOR_KEY] = generator
        return generator

    def finish(self, job: StageJob, generated: torch.Tensor, prepared: ARInputs) -> dict[str, Any]:
        """A lean-loop row's outputs: :meth:`outputs` (given the row's decode state) and the RNG state
        after its last draw, as the global RNG holds it after ``generate`` (a greedy row draws nothing:
        the state it was handed, or the seed's)."""
        generator: torch.Generator | None = job.scratch.pop(GENERATOR_KEY, None)
        if generator is None:
            generator = self.row_generator(job, prepared.model_inputs["input_ids"].device)
            job.scratch.pop(GENERATOR_KEY, None)
        after = {generator.device.type: generator.get_state()}
        state = job.scratch.pop(DECODE_STATE, None)
        return {**self.outputs(job, generated, prepared, state), "rng_state": after}

    def outputs(
        self, job: StageJob, generated: torch.Tensor, prepared: ARInputs, result: Any
    ) -> dict[str, Any]:
        """What the stage hands on besides its streamed deltas (``result``: what generate returned, or
        a lean-loop row's decode state)."""
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
