"""Stage 0, the thinker: chat messages (and audio clips) -> streamed text and, when speaking, its ``latent``.

The thinker is transformers' ``Qwen2_5OmniThinkerForConditionalGeneration`` loaded alone from the
checkpoint. For speech it generates with hidden states on and emits, per position it computed, its last
hidden state plus its input embedding (``latent``), with the ids and the three text embeddings the
talker's prompt needs; ``thinker2talker`` (engine/processors.py) builds the talker's inputs from them.

Audio in: the clips go through the folder's Whisper feature extractor and sit, as audio placeholder ids
(one per audio-encoder frame, as transformers' Qwen2.5-Omni processor lays them out), at the start of
the newest user turn. Speaking given text: the reply is teacher-forced with ``speak_text``'s tokens and
the end-of-reply token instead of sampled (docs/speech.md, "Speaking given text and audio in").
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

import numpy as np
import torch
from transformers import LogitsProcessor, LogitsProcessorList

from engine.events import FinishReason
from engine.pipelines.qwen_omni.ar_stage import OmniARStage
from engine.pipelines.qwen_omni.checkpoint import load_speakers, omni_config
from engine.pipelines.qwen_omni.thinker_decoder import ThinkerDecoder, ThinkerRow
from engine.request import RequestError
from engine.stages.ar_sampling import LEAN_PROCESSORS
from engine.stages.ar_transformers import ARInputs, FastDecoder
from engine.stages.base import StageJob

if TYPE_CHECKING:
    from transformers import BatchEncoding

# The released model speaks only under this system prompt (its model card); a speaking request without
# a system turn gets it.
SPEECH_SYSTEM_PROMPT = (
    "You are Qwen, a virtual human developed by the Qwen Team, Alibaba Group, capable of perceiving "
    "auditory and visual inputs, as well as generating text and speech."
)


# Whisper's features at 16 kHz: one frame per 160 samples; the audio encoder halves the frames twice, so a
# clip needs 3 frames (321 samples, 20 ms) for one placeholder (audio_placeholders below).
AUDIO_SAMPLE_RATE = 16_000
MIN_AUDIO_SAMPLES = 321
END_OF_REPLY = "<|im_end|>"  # the chat template's end of a turn (Qwen's)


def chat_messages(turns: list[Any], speak: bool, audio_clips: int = 0) -> list[dict[str, Any]]:
    """The request's turns as chat-template messages (the speech system prompt first when speaking).

    With ``audio_clips`` the newest (user) turn's content is a list of parts: that many audio parts,
    then its text as a text part unless the text is empty.
    """
    messages: list[dict[str, Any]] = [{"role": turn.role, "content": turn.text} for turn in turns]
    if audio_clips:
        text = messages[-1]["content"]
        parts: list[dict[str, str]] = [{"type": "audio"} for _ in range(audio_clips)]
        messages[-1]["content"] = parts + ([{"type": "text", "text": text}] if text else [])
    if speak and not any(message["role"] == "system" for message in messages):
        messages.insert(0, {"role": "system", "content": SPEECH_SYSTEM_PROMPT})
    return messages


def audio_placeholders(frames: torch.Tensor) -> torch.Tensor:
    """Audio placeholder ids per clip from its feature frames: the audio encoder's stride-2 convolution
    and its pooling by 2 (the count transformers' Qwen2.5-Omni processor writes)."""
    return ((frames - 1) // 2 + 1 - 2) // 2 + 1


class ForcedReply(LogitsProcessor):
    """Teacher forcing through ``generate``: step i may only pick ``ids[i]`` (every other logit -inf).

    The thinker computes exactly what it computes when it samples these ids itself (the same forwards on
    the same cache), and a sampled step still draws from the RNG stream as it would have, so the talker
    and code2wav continue the stream where a reply of these ids would have left it.
    """

    def __init__(self, ids: torch.Tensor, prompt_length: int) -> None:
        self.ids = ids.reshape(-1)
        self.prompt_length = prompt_length

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        step = int(input_ids.shape[-1]) - self.prompt_length
        if step >= self.ids.numel():
            return scores
        forced = torch.full_like(scores, float("-inf"))
        forced[:, int(self.ids[step])] = 0.0
        return cast(torch.FloatTensor, forced)


class ThinkerStage(OmniARStage):
    """Chat messages (+ audio clips) -> text (+ the talker's conditioning when speaking).

    On a CPU in float32 the replies to text prompts decode together in the lean loop
    (:class:`ThinkerDecoder`), each exactly as ``generate`` alone would, up to ``max_num_seqs`` per forward;
    a prompt with audio in keeps ``generate``.
    """

    # speak_text's teacher forcing is a logits processor of generate's; the lean loop applies it too.
    lean_processors = (*LEAN_PROCESSORS, ForcedReply)
    _decoder: ThinkerDecoder | None = None

    def load(self) -> None:
        from transformers import (
            AutoTokenizer,
            GenerationConfig,
            Qwen2_5OmniThinkerForConditionalGeneration,
            WhisperFeatureExtractor,
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
        self.audio_id = int(config.thinker_config.audio_token_index)
        # Audio in needs the folder's Whisper feature extractor (preprocessor_config.json).
        self.features = (
            WhisperFeatureExtractor.from_pretrained(self.model_path)
            if (self.model_path / "preprocessor_config.json").is_file()
            else None
        )
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
            self._decoder = ThinkerDecoder(self.model, self.max_batch_size)
        return self._decoder if self._decoder.usable else None

    def lean_options(self, prepared: ARInputs) -> dict[str, Any] | None:
        """speak_text's forcing processor; audio in (its features, ``use_audio_in_video``) keeps generate."""
        kwargs = prepared.generate_kwargs
        if set(kwargs) - {"use_audio_in_video", "logits_processor", "return_dict_in_generate"}:
            return None
        if kwargs.get("use_audio_in_video"):
            return None
        return {"logits_processor": kwargs["logits_processor"]} if "logits_processor" in kwargs else {}

    def forced_reply(self, prepared: ARInputs) -> torch.Tensor | None:
        """speak_text's ids (its :class:`ForcedReply`): the lean loop makes such a reply in one forward
        (docs/batching.md, "Teacher-forced replies")."""
        for processor in prepared.generate_kwargs.get("logits_processor") or ():
            if isinstance(processor, ForcedReply):
                return processor.ids
        return None

    def decode(self, ids: torch.Tensor) -> str:
        return cast(str, self.tokenizer.decode(ids, skip_special_tokens=True))

    def prepare(self, job: StageJob) -> ARInputs:
        speak = bool(job.params.get("speak"))
        clips = tuple(job.params.get("input_audio") or ())
        messages = chat_messages(list(job.inputs["messages"]), speak, audio_clips=len(clips))
        encoded = self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
        )
        batch = cast("BatchEncoding", encoded)  # return_dict=True: a BatchEncoding
        model_inputs = {k: batch[k].to(self.device) for k in ("input_ids", "attention_mask")}
        generate_kwargs: dict[str, Any] = {"use_audio_in_video": False}
        if clips:
            input_ids, audio = self.audio_inputs(clips, batch["input_ids"])
            model_inputs = {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids)}
            generate_kwargs.update(audio)
        prompt_len = int(model_inputs["input_ids"].shape[-1])
        max_len = (
            self.stage.engine_args.max_model_len or self.model.config.text_config.max_position_embeddings
        )
        speak_text = job.params.get("speak_text")
        if speak_text is not None:
            forced = self.reply_ids(str(speak_text))
            max_new = int(forced.numel())
            generate_kwargs["logits_processor"] = LogitsProcessorList([ForcedReply(forced, prompt_len)])
            if prompt_len + max_new > int(max_len):
                raise RequestError(
                    "speak_text",
                    f"prompt ({prompt_len} tokens) + the text to speak ({max_new} tokens) exceeds the model "
                    f"length {max_len}",
                )
        else:
            max_new = int(job.params["max_tokens"])
            if prompt_len + max_new > int(max_len):
                raise RequestError(
                    "max_tokens",
                    f"prompt ({prompt_len} tokens) + max_tokens ({max_new}) exceeds the model length "
                    f"{max_len}",
                )
        # The budget is also the lean decoder's cache capacity; hidden states are the forward's argument
        # (the lean prefill's too) and generate's.
        model_inputs["max_new_tokens"] = max_new
        if speak:
            model_inputs["output_hidden_states"] = True
            generate_kwargs["return_dict_in_generate"] = True
        return ARInputs(model_inputs=model_inputs, max_new_tokens=max_new, generate_kwargs=generate_kwargs)

    def reply_ids(self, text: str) -> torch.Tensor:
        """``text``'s token ids (special-token names in it are plain text) and the end-of-reply id."""
        ids = self.tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"]
        return torch.tensor([*ids, self.end_of_reply_id], dtype=torch.long)

    @property
    def end_of_reply_id(self) -> int:
        """The id a reply ends with: ``<|im_end|>`` when it is one of the thinker's stop ids, else the first."""
        eos = self.model.generation_config.eos_token_id
        stops = [int(i) for i in ([eos] if isinstance(eos, int) else list(eos or []))]
        end = self.tokenizer.convert_tokens_to_ids(END_OF_REPLY)
        if isinstance(end, int) and end in stops:
            return end
        if not stops:
            raise RuntimeError(f"{self.model_path}: the thinker has no end-of-reply id (eos_token_id)")
        return stops[0]

    def audio_inputs(
        self, clips: tuple[np.ndarray, ...], input_ids: torch.Tensor
    ) -> tuple[torch.Tensor, dict[str, Any]]:
        """The prompt ids with each clip's placeholder repeated once per audio-encoder frame, and the
        thinker's audio inputs (Whisper features and their frame mask), as the library's processor
        makes them (features padded to the extractor's 30 s; a longer clip is cut there)."""
        if self.features is None:
            raise RequestError(
                "input_audio",
                f"the model folder {self.model_path.name} has no preprocessor_config.json (the Whisper "
                "feature extractor), so it cannot take audio",
            )
        extracted = self.features(
            [np.asarray(clip, dtype=np.float32) for clip in clips],
            sampling_rate=self.features.sampling_rate,
            padding="max_length",
            return_attention_mask=True,
            return_tensors="pt",
        )
        frames = extracted["attention_mask"]
        counts = audio_placeholders(frames.sum(-1)).tolist()
        for i, count in enumerate(counts):
            if count < 1:
                raise RequestError(
                    "input_audio",
                    f"clip {i} has {len(clips[i])} samples; the audio encoder needs at least "
                    f"{MIN_AUDIO_SAMPLES} (20 ms at 16 kHz)",
                )
        ids = input_ids[0].tolist()
        at = [i for i, token in enumerate(ids) if token == self.audio_id]
        if len(at) != len(clips):
            raise RequestError(
                "input_audio",
                f"the prompt has {len(at)} audio placeholders for {len(clips)} clips (does the text name "
                "the audio token?)",
            )
        expanded: list[int] = []
        start = 0
        for position, count in zip(at, counts, strict=True):
            expanded += ids[start:position] + [self.audio_id] * int(count)
            start = position + 1
        expanded += ids[start:]
        audio = {
            "input_features": extracted["input_features"].to(self.device, self.torch_dtype),
            "feature_attention_mask": frames.to(self.device),
        }
        return torch.tensor([expanded], dtype=torch.long, device=self.device), audio

    def outputs(
        self, job: StageJob, generated: torch.Tensor, prepared: ARInputs, result: Any
    ) -> dict[str, Any]:
        if job.params.get("speak_text") is not None:
            job.finish_reason = FinishReason.STOP  # the forced reply ends with its end-of-reply id
        if not job.params.get("speak"):
            return {}
        voice = str(job.params["voice"])
        if voice not in self.voice_bos:
            raise RequestError(
                "voice", f"the model has no voice {voice!r}; allowed: {', '.join(self.voice_bos)}"
            )
        # A forced reply stopped early (a stop id inside the text) computed positions past its stop.
        rows = self.latent(prepared, result)[: prepared.prompt_length + max(0, generated.numel() - 1)]
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

    def latent(self, prepared: ARInputs, result: Any) -> torch.Tensor:
        """Per position computed (the prompt, then every reply token but the last): last hidden state +
        input embedding, as the talker reads them, (positions, H). ``result``: generate's output or a
        lean-loop row's :class:`ThinkerRow` (text prompts only)."""
        if isinstance(result, ThinkerRow):
            return result.latent_rows()
        steps = result.hidden_states  # per forward: (embeddings, layer 1, ..., final norm), each (1, n, H)
        # Audio positions carry no text: their embeddings are zero for the talker (as the one-shot model
        # clears them).
        prompt_embeds = steps[0][0]
        if "input_features" in prepared.generate_kwargs:
            audio = prepared.model_inputs["input_ids"][0] == self.audio_id
            prompt_embeds = prompt_embeds.masked_fill(audio[None, :, None], 0.0)
        rows = [steps[0][-1] + prompt_embeds, *(step[-1] + step[0] for step in steps[1:])]
        return torch.cat(rows, dim=1)[0]
