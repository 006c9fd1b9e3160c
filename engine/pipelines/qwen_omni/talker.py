"""Stage 1, the talker: the thinker's conditioning (``thinker2talker``) -> codec ids.

transformers' ``Qwen2_5OmniTalkerForConditionalGeneration`` loaded alone from the checkpoint. Its prompt
is one codec mask id per prompt position, then pad and start, over the thinker's rows; each code it
generates reads one more row of the thinker's reply. It stops at the codec end or pad id, or at
``max_tokens`` (the deploy config's: a request's sampling fields are the thinker's).

On a CPU in float32 the stage decodes many requests' codes together in the lean loop
(engine/stages/ar_transformers.py, :class:`TalkerDecoder`), each exactly as ``generate`` alone would:
up to ``max_num_seqs`` streams per forward (docs/batching.md, docs/speech.md).
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.generation.logits_process import SuppressTokensLogitsProcessor

from engine.pipelines.qwen_omni.ar_stage import OmniARStage
from engine.pipelines.qwen_omni.checkpoint import omni_config
from engine.pipelines.qwen_omni.talker_decoder import TalkerDecoder
from engine.stages.ar_sampling import LEAN_PROCESSORS
from engine.stages.ar_transformers import ARInputs, FastDecoder
from engine.stages.base import StageJob


class TalkerStage(OmniARStage):
    """Thinker rows -> codec ids (``token_ids``), cut later at its stop ids by ``talker2code2wav``."""

    # generate suppresses the codec start id with transformers' processor; the lean loop applies it too.
    lean_processors = (*LEAN_PROCESSORS, SuppressTokensLogitsProcessor)
    _decoder: TalkerDecoder | None = None

    def load(self) -> None:
        from transformers import GenerationConfig, Qwen2_5OmniTalkerForConditionalGeneration

        config = omni_config(self.model_path).talker_config
        model = Qwen2_5OmniTalkerForConditionalGeneration.from_pretrained(
            self.model_path, config=config, dtype=self.torch_dtype
        )
        model.generation_config = GenerationConfig.from_model_config(config)  # as in the one-shot model
        self.model = model.to(self.device).eval()  # type: ignore[arg-type]  # transformers types `to` unbound
        self.codec = {
            "start": int(config.tts_codec_start_token_id),
            "end": int(config.tts_codec_end_token_id),
            "pad": int(config.tts_codec_pad_token_id),
            "mask": int(config.tts_codec_mask_token_id),
        }
        self.loaded = True

    def close(self) -> None:
        self.model = None
        self._decoder = None
        super().close()

    def fast_decoder(self) -> FastDecoder | None:
        """The lean decoder where it was checked: a CPU, float32, sdpa attention (else ``generate``)."""
        if self.model is None:
            return None
        if self._decoder is None or self._decoder.model is not self.model:
            self._decoder = TalkerDecoder(self.model, self.max_batch_size)
        return self._decoder if self._decoder.usable else None

    def lean_options(self, prepared: ARInputs) -> dict[str, Any] | None:
        """Generation options only (the start id suppressed, the stop ids, the pad id)."""
        if set(prepared.generate_kwargs) <= {"suppress_tokens", "eos_token_id", "pad_token_id"}:
            return dict(prepared.generate_kwargs)
        return None

    @property
    def stop_ids(self) -> list[int]:
        return [self.codec["pad"], self.codec["end"]]

    def prepare_job(self, job: StageJob) -> ARInputs | None:
        if job.inputs.get("silent"):
            return None
        # Known from the start, so the codes published while it generates are cut at them too
        # (talker2code2wav; engine/streaming.py).
        job.add_output({"stop_token_ids": self.stop_ids})
        return self.prepare(job)

    def prepare(self, job: StageJob) -> ARInputs:
        embeds = torch.as_tensor(job.inputs["prompt_embeds"]).to(self.device, self.torch_dtype)
        length = int(embeds.shape[1])  # the thinker's prompt + the voice's start + the first reply row
        codec = self.codec
        budget = int(job.params["max_tokens"])
        input_ids = torch.full((1, length), codec["mask"], dtype=torch.long, device=self.device)
        input_ids[0, -2], input_ids[0, -1] = codec["pad"], codec["start"]
        return ARInputs(
            # The forward's inputs (the lean decoder's prefill takes them as they are). ``inputs_embeds``
            # is a copy: given a mask, the forward adds the pad and start embeddings into its last two
            # rows in place. ``max_new_tokens`` is the budget generate also gets from the stage's limits,
            # and the lean decoder's cache capacity.
            model_inputs={
                "input_ids": input_ids,
                "inputs_embeds": embeds.clone(),
                "attention_mask": torch.ones((1, length), dtype=torch.long, device=self.device),
                "input_text_ids": torch.as_tensor(job.inputs["input_text_ids"]).to(self.device),
                "thinker_reply_part": torch.as_tensor(job.inputs["thinker_reply_part"]).to(
                    self.device, self.torch_dtype
                ),
                "use_audio_in_video": False,
                "max_new_tokens": budget,
            },
            max_new_tokens=budget,
            generate_kwargs={
                "suppress_tokens": [codec["start"]],
                "eos_token_id": self.stop_ids,
                "pad_token_id": codec["pad"],
            },
        )

    def outputs(
        self, job: StageJob, generated: torch.Tensor, prepared: ARInputs, result: Any
    ) -> dict[str, Any]:
        return {"stop_token_ids": self.stop_ids}

    def empty_outputs(self, job: StageJob) -> dict[str, Any]:
        return {"token_ids": torch.zeros(0, dtype=torch.long), "stop_token_ids": self.stop_ids}
