"""The GLM-Image family: its topology (AR -> ``ar2diffusion`` -> DiT + VAE), checkpoint detection,
runners per backend and request rules (sizes in multiples of 32, the AR token budget)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from PIL import Image

from engine.config import PipelineConfig, ResolvedStage, StageTemplate
from engine.pipelines.base import PipelineFamily, fit_source_image, read_json
from engine.pipelines.glm_image.ar_transformers import GlmImageARStage
from engine.pipelines.glm_image.diffusion import GlmImageDiffusionStage
from engine.processors import AR_GRID_FACTOR, grid_layout
from engine.request import GenerationRequest, RequestError
from engine.stages.backends import select_ar_backend
from engine.stages.base import StageRunner


class GlmImageFamily(PipelineFamily):
    name = "glm-image"
    description = "GLM-Image: AR image tokens -> DiT -> VAE"
    accepts_source_image = True
    size_multiple = AR_GRID_FACTOR
    templates = (
        StageTemplate(
            stage_id=0,
            kind="ar",
            input_sources=(),
            engine_output_type="token_ids",
            final_output=False,
            default_sampling_params={"max_tokens": 16384, "detokenize": False},
        ),
        StageTemplate(
            stage_id=1,
            kind="diffusion",
            input_sources=(0,),
            input_processor="ar2diffusion",
            engine_output_type="image",
            final_output=True,
            final_output_type="image",
            default_sampling_params={
                "height": 1024,
                "width": 1024,
                "num_inference_steps": 50,
                "guidance_scale": 1.5,
            },
        ),
    )

    @classmethod
    def detect(cls, path: Path) -> bool:
        index = read_json(Path(path) / "model_index.json") or {}
        return index.get("_class_name") == "GlmImagePipeline"

    def create_runner(self, stage: ResolvedStage, model_path: Path, device: torch.device) -> StageRunner:
        if stage.kind != "ar":
            return GlmImageDiffusionStage(stage, model_path, device)
        if select_ar_backend(stage, self.name) == "vllm":
            # vLLM costs seconds to import: only a stage that runs on it loads the runner's module.
            from engine.pipelines.glm_image.ar_vllm import VllmGlmImageARStage

            return VllmGlmImageARStage(stage, model_path, device)
        return GlmImageARStage(stage, model_path, device)

    def prepare_source_image(self, image: Image.Image) -> Image.Image:
        return fit_source_image(image, AR_GRID_FACTOR)

    def complete_params(
        self, request: GenerationRequest, config: PipelineConfig, stage_params: dict[int, dict[str, Any]]
    ) -> None:
        ar_id = next(s.stage_id for s in config.stages if s.kind == "ar")
        dit_id = next(s.stage_id for s in config.stages if s.kind == "diffusion")
        dit = stage_params[dit_id]
        given = request.params
        if request.image is not None and given.height is None and given.width is None:
            # I2I defaults to the source image's size (already a multiple of 32).
            dit["width"], dit["height"] = request.image.size
        self.check_size(dit)
        dit["prompt"] = request.prompt
        ar = stage_params[ar_id]
        ar["height"], ar["width"] = dit["height"], dit["width"]
        layout = grid_layout(dit["height"], dit["width"], text_to_image=request.image is None)
        budget = ar.get("max_tokens")
        if budget is not None and layout.max_new_tokens > int(budget):
            raise RequestError(
                "height",
                f"{dit['height']}x{dit['width']} needs {layout.max_new_tokens} AR tokens but stage {ar_id}'s "
                f"max_tokens is {budget}; ask for a smaller image or raise max_tokens",
            )
        ar["max_tokens"] = layout.max_new_tokens
        # The grid needs every one of its tokens: the model's end token is held back until it is full, as
        # vLLM's min_tokens does. A model that would end early (a trained one asked for a size it never
        # saw) then draws something at the size asked for, never an engine error. Stop ids set on
        # purpose (a deploy config's stop_token_ids, ignore_eos) keep their meaning.
        if not ar.get("stop_token_ids") and not ar.get("ignore_eos"):
            ar["min_tokens"] = max(int(ar.get("min_tokens") or 0), layout.max_new_tokens - 1)
