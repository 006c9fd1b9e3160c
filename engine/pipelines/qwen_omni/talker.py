"""Stage 1, the talker: the thinker's conditioning (``thinker2talker``) -> codec ids.

transformers' ``Qwen2_5OmniTalkerForConditionalGeneration`` loaded alone from the checkpoint. Its prompt
is one codec mask id per prompt position, then pad and start, over the thinker's rows; each code it
generates reads one more row of the thinker's reply. It stops at the codec end or pad id, or at
``max_tokens`` (the deploy config's: a request's sampling fields are the thinker's).
"""

from __future__ import annotations

from typing import Any

import torch

from engine.pipelines.qwen_omni.ar_stage import OmniARStage
from engine.pipelines.qwen_omni.checkpoint import omni_config
from engine.stages.ar_transformers import ARInputs
from engine.stages.base import StageJob


class TalkerStage(OmniARStage):
    """Thinker rows -> codec ids (``token_ids``), cut later at its stop ids by ``talker2code2wav``."""

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
        super().close()

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
        input_ids = torch.full((1, length), codec["mask"], dtype=torch.long, device=self.device)
        input_ids[0, -2], input_ids[0, -1] = codec["pad"], codec["start"]
        return ARInputs(
            # The talker's first forward adds the pad and start embeddings into the last two rows in
            # place: a copy, so the hand-off's tensors stay as they were.
            model_inputs={
                "input_ids": input_ids,
                "inputs_embeds": embeds.clone(),
                "attention_mask": torch.ones((1, length), dtype=torch.long, device=self.device),
            },
            max_new_tokens=int(job.params["max_tokens"]),
            generate_kwargs={
                "input_text_ids": torch.as_tensor(job.inputs["input_text_ids"]).to(self.device),
                "thinker_reply_part": torch.as_tensor(job.inputs["thinker_reply_part"]).to(
                    self.device, self.torch_dtype
                ),
                "suppress_tokens": [codec["start"]],
                "eos_token_id": self.stop_ids,
                "pad_token_id": codec["pad"],
                "use_audio_in_video": False,
            },
        )

    def outputs(
        self, job: StageJob, generated: torch.Tensor, prepared: ARInputs, result: Any
    ) -> dict[str, Any]:
        return {"stop_token_ids": self.stop_ids}

    def empty_outputs(self, job: StageJob) -> dict[str, Any]:
        return {"token_ids": torch.zeros(0, dtype=torch.long), "stop_token_ids": self.stop_ids}
