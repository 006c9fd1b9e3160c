"""Diffusion-only text-to-image: any diffusers text-to-image pipeline (``tiny-diffusion`` is SD3)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from engine.config import PipelineConfig, ResolvedStage, StageTemplate
from engine.pipelines.base import PipelineFamily, read_json
from engine.request import GenerationRequest
from engine.stages.base import StageJob, StageRunner
from engine.stages.diffusion import DiffusersStage

if TYPE_CHECKING:
    from diffusers import DiffusionPipeline


class TextToImageStage(DiffusersStage):
    """Prompt (+ negative prompt) -> image with a standard diffusers text-to-image pipeline."""

    def load_pipeline(self) -> DiffusionPipeline:
        from diffusers import DiffusionPipeline

        index = read_json(self.model_path / "model_index.json") or {}
        # Components saved as [null, null] (e.g. SD3 without its T5) must be passed as None explicitly.
        absent = {
            name: None for name, spec in index.items() if isinstance(spec, list) and spec == [None, None]
        }
        return DiffusionPipeline.from_pretrained(self.model_path, dtype=self.torch_dtype, **absent)

    def call_kwargs(self, jobs: list[StageJob]) -> dict[str, Any]:
        first = jobs[0]
        prompts = [job.inputs["prompt"] for job in jobs]
        kwargs: dict[str, Any] = {
            "prompt": prompts if len(jobs) > 1 else prompts[0],
            "height": int(first.params["height"]),
            "width": int(first.params["width"]),
            "guidance_scale": float(first.params["guidance_scale"]),
        }
        negative = first.params.get("negative_prompt")
        if negative:
            kwargs["negative_prompt"] = [negative] * len(jobs) if len(jobs) > 1 else negative
        return kwargs


class DiffusionFamily(PipelineFamily):
    name = "diffusion"
    description = "diffusion-only text-to-image pipeline"
    size_multiple = 16
    templates = (
        StageTemplate(
            stage_id=0,
            kind="diffusion",
            input_sources=(),
            engine_output_type="image",
            final_output=True,
            final_output_type="image",
            default_sampling_params={
                "height": 1024,
                "width": 1024,
                "num_inference_steps": 28,
                "guidance_scale": 7.0,
            },
        ),
    )

    @classmethod
    def detect(cls, path: Path) -> bool:
        index = read_json(Path(path) / "model_index.json") or {}
        name = str(index.get("_class_name", ""))
        return name.endswith("Pipeline") and name != "GlmImagePipeline"

    def create_runner(self, stage: ResolvedStage, model_path: Path, device: torch.device) -> StageRunner:
        return TextToImageStage(stage, model_path, device)

    def complete_params(
        self, request: GenerationRequest, config: PipelineConfig, stage_params: dict[int, dict[str, Any]]
    ) -> None:
        for params in stage_params.values():
            self.check_size(params)
            params["prompt"] = request.prompt
