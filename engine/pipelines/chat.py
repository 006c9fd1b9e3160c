"""AR-only chat: a causal LM with a chat template that streams text (``tiny-chat``, or any local chat LM)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from engine.config import PipelineConfig, ResolvedStage, StageTemplate
from engine.pipelines.base import PipelineFamily, read_json
from engine.request import GenerationRequest, RequestError
from engine.stages.ar_transformers import ARInputs, TransformersARStage
from engine.stages.base import StageJob, StageRunner

DEFAULT_MAX_TOKENS = 256


class ChatARStage(TransformersARStage):
    """Chat messages -> streamed text on transformers."""

    def load(self) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer  # ~2 s of imports, only when used

        self.tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        self.model = (
            AutoModelForCausalLM.from_pretrained(self.model_path, dtype=self.torch_dtype)
            .to(self.device)
            .eval()
        )
        self.loaded = True

    def close(self) -> None:
        self.model = None
        super().close()

    def decode(self, ids: torch.Tensor) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def prepare(self, job: StageJob) -> ARInputs:
        messages = [{"role": turn.role, "content": turn.text} for turn in job.inputs["messages"]]
        inputs = self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
        ).to(self.device)
        max_len = self.stage.engine_args.get("max_model_len") or self.model.config.max_position_embeddings
        prompt_len = int(inputs["input_ids"].shape[-1])
        max_new = int(job.params["max_tokens"])
        if prompt_len + max_new > int(max_len):
            raise RequestError(
                "max_tokens",
                f"prompt ({prompt_len} tokens) + max_tokens ({max_new}) exceeds the model length {max_len}",
            )
        return ARInputs(model_inputs=dict(inputs), max_new_tokens=max_new)


class ChatFamily(PipelineFamily):
    name = "chat"
    description = "AR-only chat model that streams text"
    templates = (
        StageTemplate(
            stage_id=0,
            kind="ar",
            input_sources=(),
            engine_output_type="text",
            final_output=True,
            final_output_type="text",
        ),
    )

    @classmethod
    def detect(cls, path: Path) -> bool:
        config = read_json(Path(path) / "config.json") or {}
        architectures = config.get("architectures") or []
        return (
            any(a.endswith("ForCausalLM") for a in architectures)
            and (Path(path) / "tokenizer_config.json").exists()
        )

    def create_runner(self, stage: ResolvedStage, model_path: Path, device: torch.device) -> StageRunner:
        from engine.stages.backends import ar_runner_class

        return ar_runner_class(stage, transformers_runner=ChatARStage, family=self.name)(
            stage, model_path, device
        )

    def complete_params(
        self, request: GenerationRequest, config: PipelineConfig, stage_params: dict[int, dict[str, Any]]
    ) -> None:
        for params in stage_params.values():
            params.setdefault("max_tokens", DEFAULT_MAX_TOKENS)
            if not 1 <= int(params["max_tokens"]) <= 32768:
                raise RequestError("max_tokens", f"must be from 1 to 32768, got {params['max_tokens']}")
