"""The qwen-omni thinker on vLLM, for text-only requests (imported only when the thinker runs on vLLM).

vLLM 0.32's own ``Qwen2_5OmniThinkerForConditionalGeneration`` cannot be imported here: its module
imports vLLM's Qwen2-VL code, which imports transformers' Qwen2-VL image processor, which needs
torchvision (left out of the CPU install on purpose, docs/vllm.md). A text-only request needs none of
the thinker's audio or vision towers: its prompt is text, and with every position id the same on the
three M-RoPE axes (text has no grid) the thinker's rotary embedding is the ordinary one. So this stage
serves the thinker's language model alone, as vLLM's ``Qwen2ForCausalLM`` over the checkpoint's
``thinker.model.*`` and ``thinker.lm_head.*`` weights (architecture :data:`TEXT_THINKER_ARCHITECTURE`,
given to vLLM by an ``hf_overrides`` hook that also drops ``mrope_section``).

What it does not do (docs/speech.md, "vLLM for the thinker"): speech (the talker needs the thinker's
hidden states per position, which vLLM does not return, only tokens and logprobs) and audio in (no audio
tower). Such requests are refused naming the field. Greedy ids equal the transformers thinker's
(tests/test_qwen_omni_vllm.py).
"""

from __future__ import annotations

from collections.abc import Iterable
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch

from engine.pipelines.qwen_omni.checkpoint import omni_config
from engine.pipelines.qwen_omni.thinker import chat_messages
from engine.request import RequestError
from engine.stages.ar_vllm import VllmARStage, VllmStartError
from engine.stages.base import StageJob
from engine.stages.vllm_api import EngineArgs
from engine.stages.vllm_requests import VllmPrompt

TEXT_THINKER_ARCHITECTURE = "OmniStudioQwen2_5OmniTextThinker"


@lru_cache(maxsize=1)
def text_thinker_class() -> type:
    """The thinker's language model as a plain Qwen2 LM (vLLM's ``Qwen2ForCausalLM``): the checkpoint's
    ``thinker.model.*`` and ``thinker.lm_head.*`` weights; the audio and vision towers, the talker and
    token2wav are skipped. Made on first use, after ``engine.stages.vllm_api`` has set vLLM's logging."""
    from vllm.model_executor.models.qwen2 import Qwen2ForCausalLM
    from vllm.model_executor.models.utils import AutoWeightsLoader, WeightsMapper

    class QwenOmniTextThinker(Qwen2ForCausalLM):
        hf_to_vllm_mapper = WeightsMapper(
            orig_to_new_prefix={
                "thinker.model.": "model.",
                "thinker.lm_head.": "lm_head.",
                "thinker.": None,
                "talker.": None,
                "token2wav.": None,
            }
        )

        def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
            return set(AutoWeightsLoader(self).load_weights(weights, mapper=self.hf_to_vllm_mapper))

    return QwenOmniTextThinker


def text_thinker_config(config: Any) -> Any:
    """vLLM's ``hf_overrides`` hook: our architecture, and the text config's rope without
    ``mrope_section`` (text positions are equal on the three axes, so it is the plain rotary)."""
    text = config.get_text_config()
    rope = getattr(text, "rope_parameters", None)
    if rope:
        text.rope_parameters = {k: v for k, v in dict(rope).items() if k != "mrope_section"}
    config.architectures = [TEXT_THINKER_ARCHITECTURE]
    return config


def register() -> None:
    """Register :func:`text_thinker_class` with vLLM in this process (idempotent)."""
    from vllm import ModelRegistry

    if TEXT_THINKER_ARCHITECTURE not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model(TEXT_THINKER_ARCHITECTURE, text_thinker_class())


def cpu_head_sizes() -> list[int]:
    """The head sizes vLLM's CPU attention runs."""
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    return list(CPUAttentionBackend.get_supported_head_sizes())


class VllmThinkerStage(VllmARStage):
    """Stage 0 of qwen-omni on vLLM: chat messages -> streamed text, for ``modalities: text`` only."""

    tokenizer: Any = None

    @property
    def vllm_model_path(self) -> Path:
        return self.model_path

    def load_helpers(self) -> None:
        from transformers import AutoTokenizer

        if self.device.type == "cpu":
            text = omni_config(self.model_path).thinker_config.text_config
            head = int(getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads)
            sizes = cpu_head_sizes()
            if head not in sizes:
                raise VllmStartError(
                    f"vLLM's CPU attention cannot run the thinker of {self.model_path.name}: its head size "
                    f"is {head}, vLLM's CPU attention takes {', '.join(map(str, sizes))}. Run the thinker "
                    "on transformers with `backend: transformers` (docs/speech.md, 'vLLM for the thinker')."
                )
        register()
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_path)

    def engine_args(self, driver: str) -> EngineArgs:
        if driver != "inproc":
            # The architecture is registered in this process only; vLLM's engine-core process would not
            # know it (docs/speech.md, "vLLM for the thinker").
            raise VllmStartError(
                f"the qwen-omni thinker runs on vLLM's in-process driver only, not {driver!r}"
            )
        args = super().engine_args(driver)
        args.hf_overrides = text_thinker_config
        return args

    def decode(self, ids: list[int]) -> str:
        return str(self.tokenizer.decode(ids, skip_special_tokens=True))

    def prepare(self, job: StageJob) -> VllmPrompt:
        refused = (
            ("modalities", bool(job.params.get("speak")), "speech needs the thinker's hidden states"),
            ("input_audio", bool(job.params.get("input_audio")), "audio in needs the thinker's audio tower"),
            ("speak_text", job.params.get("speak_text") is not None, "speaking given text is speech"),
        )
        for field, asked, why in refused:
            if asked:
                raise RequestError(
                    field,
                    f"the thinker runs on vLLM here, which makes text only ({why}, which vLLM does not "
                    "give); ask for modalities ['text'], or run the thinker with backend: transformers",
                )
        messages = chat_messages(list(job.inputs["messages"]), speak=False)
        encoded = self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, return_dict=True
        )
        return VllmPrompt(token_ids=list(encoded["input_ids"]), max_tokens=int(job.params["max_tokens"]))
