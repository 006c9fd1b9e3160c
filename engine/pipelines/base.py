"""A model family: its built-in topology, how it recognises a checkpoint, its stage runners and request rules."""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from PIL import Image

from engine.config import PipelineConfig, ResolvedStage, StageTemplate
from engine.modality import OutputModality, format_output_modalities
from engine.request import (
    GenerationRequest,
    RequestError,
    ResolvedRequest,
    check_request_types,
    random_seed,
)
from engine.stages.base import StageRunner
from engine.tempo import MAX_SPEED, MIN_SPEED

AR_REQUEST_KEYS = ("temperature", "top_p", "top_k", "max_tokens")
DIFFUSION_REQUEST_KEYS = ("height", "width", "num_inference_steps", "guidance_scale", "negative_prompt")
MAX_IMAGE_SIDE = 4096
MAX_STEPS = 1000


def read_json(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None


class PipelineFamily(ABC):
    """Everything the engine needs to know about one kind of model."""

    name: str = ""
    description: str = ""
    templates: tuple[StageTemplate, ...] = ()
    accepts_source_image: bool = False
    accepts_input_audio: bool = False  # GenerationRequest.input_audio (docs/speech.md)
    accepts_speak_text: bool = False  # GenerationRequest.speak_text (docs/speech.md)
    size_multiple: int = 0  # image sizes must be multiples of this (0: the family makes no images)

    @classmethod
    @abstractmethod
    def detect(cls, path: Path) -> bool:
        """Whether the HF-format folder ``path`` holds a model of this family."""

    @abstractmethod
    def create_runner(self, stage: ResolvedStage, model_path: Path, device: torch.device) -> StageRunner:
        """The runner for ``stage`` (backend chosen per the stage's ``backend`` key)."""

    # -- requests ---------------------------------------------------------------------------------

    def resolve_request(self, request: GenerationRequest, config: PipelineConfig) -> ResolvedRequest:
        """Check ``request`` against this pipeline and decide every parameter, seed included."""
        produced = self.final_modalities(config)
        modalities = request.modalities or produced
        missing = [m for m in modalities if m not in produced]
        if missing:
            raise RequestError(
                "modalities",
                f"{config.model_name} produces {format_output_modalities(produced)}; "
                f"cannot produce {format_output_modalities(tuple(missing))}",
            )
        if request.image is not None and not self.accepts_source_image:
            raise RequestError("image", f"{config.model_name} does not take a source image (text input only)")
        if request.image is not None:
            request = replace(request, image=self.prepare_source_image(request.image))
        check_request_types(request)
        if request.input_audio and not self.accepts_input_audio:
            raise RequestError(
                "input_audio",
                f"{config.model_name} ({self.name}) does not take audio input; drop input_audio",
            )
        if request.speak_text is not None and not self.accepts_speak_text:
            raise RequestError(
                "speak_text",
                f"{config.model_name} ({self.name}) cannot speak given text; choose a model that speaks",
            )
        if request.params.n < 1 or request.params.n > 8:
            raise RequestError("n", f"must be between 1 and 8, got {request.params.n}")
        if request.params.voice is not None and OutputModality.AUDIO not in produced:
            raise RequestError(
                "voice",
                f"{config.model_name} produces {format_output_modalities(produced)}, no audio, so it has no "
                "voices; drop voice or choose a model that speaks",
            )
        speed = request.params.speed
        if speed is not None and OutputModality.AUDIO not in modalities:
            raise RequestError(
                "speed",
                f"speed sets the tempo of speech and this request makes "
                f"{format_output_modalities(tuple(modalities))}, no audio; drop speed or ask for audio",
            )
        if speed is not None and (
            isinstance(speed, bool)
            or not isinstance(speed, int | float)
            or not MIN_SPEED <= speed <= MAX_SPEED  # NaN fails this too
        ):
            raise RequestError(
                "speed",
                f"must be a number from {MIN_SPEED:g} to {MAX_SPEED:g} (1.0: as spoken), got {speed!r}",
            )

        seed = request.params.seed
        if seed is None:
            seed = next(
                (
                    s.default_sampling_params["seed"]
                    for s in config.stages
                    if "seed" in s.default_sampling_params
                ),
                None,
            )
        if seed is None:
            seed = random_seed()
        stage_params: dict[int, dict[str, Any]] = {}
        given = request.params.to_dict()
        self.check_fields_apply(given, config)
        for stage in config.stages:
            keys = AR_REQUEST_KEYS if stage.kind == "ar" else DIFFUSION_REQUEST_KEYS
            params = dict(stage.default_sampling_params)
            params.update({k: given[k] for k in keys if k in given})
            params["seed"] = seed
            params["preview_every"] = request.params.preview_every
            stage_params[stage.stage_id] = params
        self.complete_params(request, config, stage_params)
        parameters = self.flat_parameters(request, seed, stage_params, modalities)
        return ResolvedRequest(request, seed, parameters, stage_params, tuple(modalities))

    def check_fields_apply(self, given: dict[str, Any], config: PipelineConfig) -> None:
        """A parameter no stage of this pipeline reads is an error, never silently dropped."""
        kinds = {stage.kind for stage in config.stages}
        for kind, keys in (("ar", AR_REQUEST_KEYS), ("diffusion", DIFFUSION_REQUEST_KEYS)):
            if kind in kinds:
                continue
            unused = [key for key in keys if key in given]
            if unused:
                takes = [
                    key
                    for k, ks in (("ar", AR_REQUEST_KEYS), ("diffusion", DIFFUSION_REQUEST_KEYS))
                    if k in kinds
                    for key in ks
                ]
                raise RequestError(
                    unused[0],
                    f"{config.model_name} ({self.name}) has no {'AR' if kind == 'ar' else kind} stage, so "
                    f"{', '.join(unused)} {'does' if len(unused) == 1 else 'do'} not apply; it takes "
                    f"{', '.join([*takes, 'seed', 'n'])}",
                )

    def voices(self, model_path: Path | None) -> tuple[str, ...]:
        """The voices the model at ``model_path`` speaks in, the default first (empty: it makes no audio)."""
        return ()

    def check_voice(self, resolved: ResolvedRequest, model_path: Path | None, model_name: str) -> None:
        """Refuse a voice the model in ``model_path`` does not have (see :meth:`voices`)."""
        voice = resolved.request.params.voice
        voices = self.voices(model_path) if voice is not None else ()
        if voice is not None and voices and voice not in voices:
            raise RequestError("voice", f"{model_name} has no voice {voice!r}; allowed: {', '.join(voices)}")

    def prepare_source_image(self, image: Image.Image) -> Image.Image:
        """The source image as every stage will see it."""
        return image.convert("RGB")

    def complete_params(  # noqa: B027  (optional hook: families without extra rules keep the default)
        self, request: GenerationRequest, config: PipelineConfig, stage_params: dict[int, dict[str, Any]]
    ) -> None:
        """Fill family defaults and check family rules (sizes, token budgets); edit ``stage_params``."""

    def flat_parameters(
        self,
        request: GenerationRequest,
        seed: int,
        stage_params: dict[int, dict[str, Any]],
        modalities: tuple[OutputModality, ...],
    ) -> dict[str, Any]:
        flat: dict[str, Any] = {}
        for params in stage_params.values():
            for key, value in params.items():
                if key not in ("preview_every", "prompt") and value is not None:
                    flat.setdefault(key, value)
        flat["seed"] = seed
        flat["n"] = request.params.n
        flat["modalities"] = [m.value for m in modalities]
        flat["source_image"] = request.image is not None
        return flat

    def final_modalities(self, config: PipelineConfig) -> tuple[OutputModality, ...]:
        produced: list[OutputModality] = []
        for stage in config.final_stages:
            for modality in stage.final_modalities:
                if modality not in produced:
                    produced.append(modality)
        return tuple(produced)

    # -- shared checks ----------------------------------------------------------------------------

    def check_size(self, params: dict[str, Any]) -> None:
        for key in ("height", "width"):
            value = params.get(key)
            if value is None:
                raise RequestError(key, "is required (the deploy config sets no default)")
            if not isinstance(value, int) or value < self.size_multiple or value > MAX_IMAGE_SIDE:
                raise RequestError(
                    key, f"must be an integer from {self.size_multiple} to {MAX_IMAGE_SIDE}, got {value!r}"
                )
            if value % self.size_multiple:
                raise RequestError(
                    key, f"must be a multiple of {self.size_multiple} for {self.name} models, got {value}"
                )
        steps = params.get("num_inference_steps")
        if steps is None or not 1 <= int(steps) <= MAX_STEPS:
            raise RequestError("num_inference_steps", f"must be from 1 to {MAX_STEPS}, got {steps!r}")
        guidance = params.get("guidance_scale")
        if guidance is None or not 0 <= float(guidance) <= 100:
            raise RequestError("guidance_scale", f"must be from 0 to 100, got {guidance!r}")


def fit_source_image(image: Image.Image, multiple: int, max_side: int = 2048) -> Image.Image:
    """RGB, at most ``max_side`` per side, each side a multiple of ``multiple`` (cropped from the centre)."""
    image = image.convert("RGB")
    scale = min(1.0, max_side / max(image.size))
    if scale < 1.0:
        image = image.resize(
            (max(1, round(image.width * scale)), max(1, round(image.height * scale))),
            Image.Resampling.BICUBIC,
        )
    width = max(multiple, image.width // multiple * multiple)
    height = max(multiple, image.height // multiple * multiple)
    if (width, height) != image.size:
        if image.width < width or image.height < height:
            image = image.resize(
                (max(width, image.width), max(height, image.height)), Image.Resampling.BICUBIC
            )
        left, top = (image.width - width) // 2, (image.height - height) // 2
        image = image.crop((left, top, left + width, top + height))
    return image
