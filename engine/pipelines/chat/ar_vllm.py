"""Chat stage 0 on vLLM (imported only when a stage runs on vLLM: importing vLLM takes seconds)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from engine.stages.ar_vllm import VllmARStage
from engine.stages.base import StageJob
from engine.stages.vllm_requests import VllmPrompt


class VllmChatARStage(VllmARStage):
    """Chat messages -> streamed text (``tiny-chat`` or any local chat LM vLLM supports)."""

    tokenizer: Any = None

    @property
    def vllm_model_path(self) -> Path:
        return self.model_path

    def load_helpers(self) -> None:
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(self.model_path)

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def prepare(self, job: StageJob) -> VllmPrompt:
        messages = [{"role": turn.role, "content": turn.text} for turn in job.inputs["messages"]]
        ids = self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, return_dict=True
        )
        return VllmPrompt(token_ids=list(ids["input_ids"]), max_tokens=int(job.params["max_tokens"]))
