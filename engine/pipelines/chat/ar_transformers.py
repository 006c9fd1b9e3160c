"""Chat stage 0 on transformers: chat messages -> streamed text."""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

import torch

from engine.request import RequestError
from engine.stages.ar_transformers import ARInputs, TransformersARStage
from engine.stages.base import StageJob

if TYPE_CHECKING:
    from transformers import BatchEncoding


class ChatARStage(TransformersARStage):
    """Chat messages -> streamed text on transformers."""

    def load(self) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer  # ~2 s of imports, only when used

        self.tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        self.model = (
            AutoModelForCausalLM.from_pretrained(self.model_path, dtype=self.torch_dtype)
            .to(self.device)  # type: ignore[arg-type]  # transformers types the wrapped `to` as unbound
            .eval()
        )
        self.loaded = True

    def close(self) -> None:
        self.model = None
        super().close()

    def decode(self, ids: torch.Tensor) -> str:
        return cast(str, self.tokenizer.decode(ids, skip_special_tokens=True))  # one sequence: one string

    def prepare(self, job: StageJob) -> ARInputs:
        messages = [{"role": turn.role, "content": turn.text} for turn in job.inputs["messages"]]
        encoded = self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
        )
        inputs = cast("BatchEncoding", encoded).to(self.device)  # return_dict=True: a BatchEncoding
        max_len = self.stage.engine_args.max_model_len or self.model.config.max_position_embeddings
        prompt_len = int(inputs["input_ids"].shape[-1])
        max_new = int(job.params["max_tokens"])
        if prompt_len + max_new > int(max_len):
            raise RequestError(
                "max_tokens",
                f"prompt ({prompt_len} tokens) + max_tokens ({max_new}) exceeds the model length {max_len}",
            )
        return ARInputs(model_inputs=dict(inputs), max_new_tokens=max_new)
