"""The chat family: one AR stage that streams text; checkpoint detection, runners per backend, token limits."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from engine.config import PipelineConfig, ResolvedStage, StageTemplate
from engine.pipelines.base import PipelineFamily, read_json
from engine.pipelines.chat.ar_transformers import ChatARStage
from engine.request import GenerationRequest, RequestError
from engine.stages.backends import select_ar_backend
from engine.stages.base import StageRunner

DEFAULT_MAX_TOKENS = 256


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
        if select_ar_backend(stage, self.name) == "vllm":
            # vLLM costs seconds to import: only a stage that runs on it loads the runner's module.
            from engine.pipelines.chat.ar_vllm import VllmChatARStage

            return VllmChatARStage(stage, model_path, device)
        return ChatARStage(stage, model_path, device)

    def complete_params(
        self, request: GenerationRequest, config: PipelineConfig, stage_params: dict[int, dict[str, Any]]
    ) -> None:
        for params in stage_params.values():
            params.setdefault("max_tokens", DEFAULT_MAX_TOKENS)
            if not 1 <= int(params["max_tokens"]) <= 32768:
                raise RequestError("max_tokens", f"must be from 1 to 32768, got {params['max_tokens']}")
