"""The qwen-omni family: Qwen2.5-Omni's thinker -> talker -> code2wav, its detection and request rules."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from engine.config import PipelineConfig, ResolvedStage, StageTemplate
from engine.modality import OutputModality
from engine.pipelines.base import AR_REQUEST_KEYS, PipelineFamily
from engine.pipelines.qwen_omni.checkpoint import default_voice, is_omni_folder, voices_of
from engine.pipelines.qwen_omni.code2wav import Code2WavStage
from engine.pipelines.qwen_omni.talker import TalkerStage
from engine.pipelines.qwen_omni.thinker import MIN_AUDIO_SAMPLES, ThinkerStage
from engine.request import GenerationRequest, RequestError
from engine.stages.backends import BackendUnavailable, select_ar_backend
from engine.stages.base import StageRunner

THINKER, TALKER, CODE2WAV = 0, 1, 2
DEFAULT_MAX_TOKENS = 256
NOT_FOR_SPEECH = ("height", "width", "negative_prompt")  # diffusion fields that mean nothing to code2wav


class QwenOmniFamily(PipelineFamily):
    name = "qwen-omni"
    description = "Qwen2.5-Omni: thinker (text) -> talker (codec ids) -> code2wav (24 kHz speech)"
    accepts_input_audio = True  # clips in the newest user turn, heard by the thinker's audio encoder
    accepts_speak_text = True  # the thinker's reply teacher-forced (docs/speech.md)
    templates = (
        StageTemplate(
            stage_id=THINKER,
            kind="ar",
            input_sources=(),
            engine_output_type="text+latent",
            final_output=True,
            final_output_type="text",
            default_sampling_params={"max_tokens": DEFAULT_MAX_TOKENS},
        ),
        StageTemplate(
            stage_id=TALKER,
            kind="ar",
            input_sources=(THINKER,),
            input_processor="thinker2talker",
            engine_output_type="token_ids",
            final_output=False,
            # transformers' generate defaults for the talker (the released model's).
            default_sampling_params={
                "temperature": 0.9,
                "top_k": 40,
                "top_p": 0.8,
                "repetition_penalty": 1.05,
                "max_tokens": 4096,
            },
        ),
        StageTemplate(
            stage_id=CODE2WAV,
            kind="diffusion",
            input_sources=(TALKER,),
            input_processor="talker2code2wav",
            engine_output_type="audio",
            final_output=True,
            final_output_type="audio",
            default_sampling_params={"num_inference_steps": 10, "guidance_scale": 0.5},
        ),
    )

    @classmethod
    def detect(cls, path: Path) -> bool:
        return is_omni_folder(path)

    def create_runner(self, stage: ResolvedStage, model_path: Path, device: torch.device) -> StageRunner:
        if stage.stage_id == CODE2WAV:
            return Code2WavStage(stage, model_path, device)
        if stage.stage_id == THINKER and stage.backend == "vllm":
            # Text-only requests; speech needs hidden states vLLM does not return (docs/speech.md).
            select_ar_backend(stage, self.name)  # raises when vLLM is missing or broken here
            from engine.pipelines.qwen_omni.thinker_vllm import VllmThinkerStage

            return VllmThinkerStage(stage, model_path, device)
        if stage.stage_id == TALKER and stage.backend == "vllm":
            raise BackendUnavailable(
                "stage 1 (talker): backend 'vllm' requested but vLLM has no Qwen2.5-Omni talker (an LM over "
                "codec ids fed the thinker's hidden states); use backend: transformers or auto"
            )
        # auto and transformers run here (auto stays on transformers: speech, the default, needs the
        # thinker's hidden states; docs/speech.md, "vLLM for the thinker").
        select_ar_backend(stage, self.name, has_vllm_runner=False)
        return (
            ThinkerStage(stage, model_path, device)
            if stage.stage_id == THINKER
            else TalkerStage(stage, model_path, device)
        )

    def voices(self, model_path: Path | None) -> tuple[str, ...]:
        return voices_of(model_path)

    def complete_params(
        self, request: GenerationRequest, config: PipelineConfig, stage_params: dict[int, dict[str, Any]]
    ) -> None:
        given = request.params.to_dict()
        for key in NOT_FOR_SPEECH:
            if key in given:
                raise RequestError(
                    key,
                    f"{config.model_name} ({self.name}) makes speech, not images: {key} does not apply; it "
                    "takes max_tokens, temperature, top_p, top_k (the thinker's), num_inference_steps, "
                    "guidance_scale (code2wav's), voice, speed, seed, n",
                )
        wanted = request.modalities or self.final_modalities(config)
        voice = request.params.voice or default_voice(())
        for params in stage_params.values():
            params["voice"] = voice
        thinker = stage_params[THINKER]
        thinker.setdefault("max_tokens", DEFAULT_MAX_TOKENS)
        if not 1 <= int(thinker["max_tokens"]) <= 32768:
            raise RequestError("max_tokens", f"must be from 1 to 32768, got {thinker['max_tokens']}")
        thinker["speak"] = OutputModality.AUDIO in wanted
        if request.speak_text is not None:
            thinker["speak_text"] = request.speak_text
        for i, clip in enumerate(request.input_audio):
            if clip.size < MIN_AUDIO_SAMPLES:
                raise RequestError(
                    "input_audio",
                    f"clip {i} has {clip.size} samples; the audio encoder needs at least {MIN_AUDIO_SAMPLES} "
                    "(20 ms at 16 kHz)",
                )
        if request.input_audio:
            thinker["input_audio"] = request.input_audio
        # A request's sampling fields are the thinker's (its text); the talker keeps its deploy config's.
        if TALKER in stage_params:
            talker = stage_params[TALKER]
            defaults = config.stage(TALKER).default_sampling_params
            for key in AR_REQUEST_KEYS:
                talker.pop(key, None)
                if key in defaults:
                    talker[key] = defaults[key]
        if CODE2WAV in stage_params:
            if request.params.speed is not None:  # checked in resolve_request; applied by code2wav
                stage_params[CODE2WAV]["speed"] = float(request.params.speed)
            steps = int(stage_params[CODE2WAV].get("num_inference_steps") or 0)
            if not 2 <= steps <= 1000:
                raise RequestError(
                    "num_inference_steps", f"must be from 2 to 1000 (ODE time points), got {steps}"
                )

    def flat_parameters(
        self,
        request: GenerationRequest,
        seed: int,
        stage_params: dict[int, dict[str, Any]],
        modalities: tuple[OutputModality, ...],
    ) -> dict[str, Any]:
        """The recorded parameters: the thinker's and code2wav's (the talker's are the deploy config's);
        ``speak_text`` when given, and of ``input_audio`` only how many clips (``input_audio_clips``)."""
        shown = {sid: params for sid, params in stage_params.items() if sid != TALKER}
        flat = super().flat_parameters(request, seed, shown, modalities)
        flat.pop("speak", None)
        if flat.pop("input_audio", None) is not None:
            flat["input_audio_clips"] = len(request.input_audio)
        return flat
