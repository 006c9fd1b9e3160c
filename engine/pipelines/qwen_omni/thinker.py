"""Stage 0, the thinker: chat messages -> streamed text and, when the request speaks, its ``latent``.

The thinker is transformers' ``Qwen2_5OmniThinkerForConditionalGeneration`` loaded alone from the
checkpoint. For speech it generates with hidden states on and emits, per position it computed, its last
hidden state plus its input embedding (``latent``), with the ids and the three text embeddings the
talker's prompt needs; ``thinker2talker`` (engine/processors.py) builds the talker's inputs from them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

import torch

from engine.pipelines.qwen_omni.ar_stage import OmniARStage
from engine.pipelines.qwen_omni.checkpoint import load_speakers, omni_config
from engine.request import RequestError
from engine.stages.ar_transformers import ARInputs
from engine.stages.base import StageJob

if TYPE_CHECKING:
    from transformers import BatchEncoding

# The released model speaks only under this system prompt (its model card); a speaking request without
# a system turn gets it.
SPEECH_SYSTEM_PROMPT = (
    "You are Qwen, a virtual human developed by the Qwen Team, Alibaba Group, capable of perceiving "
    "auditory and visual inputs, as well as generating text and speech."
)


def chat_messages(turns: list[Any], speak: bool) -> list[dict[str, str]]:
    """The request's turns as chat-template messages (the speech system prompt first when speaking)."""
    messages = [{"role": turn.role, "content": turn.text} for turn in turns]
    if speak and not any(message["role"] == "system" for message in messages):
        messages.insert(0, {"role": "system", "content": SPEECH_SYSTEM_PROMPT})
    return messages


class ThinkerStage(OmniARStage):
    """Chat messages -> text (+ the talker's conditioning when speaking)."""

    def load(self) -> None:
        from transformers import (
            AutoTokenizer,
            GenerationConfig,
            Qwen2_5OmniThinkerForConditionalGeneration,
        )

        config = omni_config(self.model_path)
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        model = Qwen2_5OmniThinkerForConditionalGeneration.from_pretrained(
            self.model_path, config=config.thinker_config, dtype=self.torch_dtype
        )
        # The one-shot model's thinker keeps the generation config made from its own configuration (the
        # folder's generation_config.json is the whole model's): the same here, so the same tokens.
        model.generation_config = GenerationConfig.from_model_config(config.thinker_config)
        self.model = model.to(self.device).eval()  # type: ignore[arg-type]  # transformers types `to` unbound
        talker = config.talker_config
        self.text_ids = (talker.tts_text_end_token_id, talker.tts_text_pad_token_id)
        self.voice_bos = {name: int(s["bos_token"]) for name, s in load_speakers(self.model_path).items()}
        self.loaded = True

    def close(self) -> None:
        self.model = None
        super().close()

    def decode(self, ids: torch.Tensor) -> str:
        return cast(str, self.tokenizer.decode(ids, skip_special_tokens=True))

    def prepare(self, job: StageJob) -> ARInputs:
        speak = bool(job.params.get("speak"))
        messages = chat_messages(list(job.inputs["messages"]), speak)
        encoded = self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
        )
        batch = cast("BatchEncoding", encoded)  # return_dict=True: a BatchEncoding
        model_inputs = {k: batch[k].to(self.device) for k in ("input_ids", "attention_mask")}
        prompt_len = int(model_inputs["input_ids"].shape[-1])
        max_len = (
            self.stage.engine_args.max_model_len or self.model.config.text_config.max_position_embeddings
        )
        max_new = int(job.params["max_tokens"])
        if prompt_len + max_new > int(max_len):
            raise RequestError(
                "max_tokens",
                f"prompt ({prompt_len} tokens) + max_tokens ({max_new}) exceeds the model length {max_len}",
            )
        generate_kwargs: dict[str, Any] = {"use_audio_in_video": False}
        if speak:
            generate_kwargs.update(output_hidden_states=True, return_dict_in_generate=True)
        return ARInputs(model_inputs=model_inputs, max_new_tokens=max_new, generate_kwargs=generate_kwargs)

    def outputs(
        self, job: StageJob, generated: torch.Tensor, prepared: ARInputs, result: Any
    ) -> dict[str, Any]:
        if not job.params.get("speak"):
            return {}
        voice = str(job.params["voice"])
        if voice not in self.voice_bos:
            raise RequestError(
                "voice", f"the model has no voice {voice!r}; allowed: {', '.join(self.voice_bos)}"
            )
        steps = result.hidden_states  # per forward: (embeddings, layer 1, ..., last layer), each (1, n, H)
        # Per position: last hidden state + input embedding, as the talker reads them. Audio and image
        # positions carry no text: their embeddings are zero for the talker (inputs of those kinds are
        # not taken by this stage yet, so there are none to clear).
        rows = torch.cat([step[-1] + step[0] for step in steps], dim=1)[0]
        embed = self.model.get_input_embeddings()
        bos = self.voice_bos[voice]
        ids = torch.tensor([bos, *self.text_ids], device=self.device)
        limits = self._generation_limits(job, prepared)  # stop_token_ids of the request, if any
        stops = limits.get("eos_token_id", self.model.generation_config.eos_token_id)
        return {
            "latent": rows.detach().cpu(),
            "prompt_token_ids": prepared.model_inputs["input_ids"][0].detach().cpu(),
            "reply_token_ids": generated,
            "speech_bos_id": bos,
            "speech_text_embeds": embed(ids).detach().cpu(),
            "stop_token_ids": [] if stops is None else torch.as_tensor(stops).reshape(-1).tolist(),
        }
