"""GLM-Image stage 1: ``GlmImagePipeline`` without its AR half, fed ``prior_token_ids`` by ``ar2diffusion``."""

from __future__ import annotations

from collections.abc import Hashable
from typing import TYPE_CHECKING, Any, cast

import torch
from PIL import Image

from engine.stages.base import StageJob
from engine.stages.diffusion import DiffusersStage

if TYPE_CHECKING:
    from diffusers import DiffusionPipeline, GlmImagePipeline, GlmImageTransformer2DModel


class GlmImageDiffusionStage(DiffusersStage):
    """Stage 1: prior ids (+ source image) -> image, with ``GlmImagePipeline`` minus its AR half.

    Batch-invariant (docs/batching.md): with per-sample linears the DiT gives each sample the bits it
    gets alone; glyph prompts are encoded one prompt at a time and padded to the longest, so only jobs with
    the same quoted texts batch together.
    """

    batch_invariant = True

    def per_sample_modules(self, pipe: DiffusionPipeline) -> list[torch.nn.Module]:
        transformer = cast("GlmImageTransformer2DModel", pipe.transformer)
        linears = [m for m in transformer.modules() if isinstance(m, torch.nn.Linear)]
        # The timestep / size conditioning: sin, cos and SiLU on (batch, few) tensors.
        return [*linears, transformer.time_condition_embed]

    def batch_group(self, job: StageJob) -> Hashable:
        from diffusers import GlmImagePipeline

        # The pipeline's own parsing, which reads nothing but the prompt: batch keys are also computed where
        # no pipeline is loaded (the driver side of a stage on Ray).
        return tuple(
            GlmImagePipeline.get_glyph_texts(cast("GlmImagePipeline", None), job.inputs["prompt"])[0]
        )

    def load_pipeline(self) -> GlmImagePipeline:
        from diffusers import GlmImagePipeline

        return GlmImagePipeline.from_pretrained(
            self.model_path, vision_language_encoder=None, processor=None, dtype=self.torch_dtype
        )

    def latents_to_images(self, latents: torch.Tensor) -> list[Image.Image]:
        vae = self.pipeline.vae
        channels = vae.config.latent_channels
        mean = torch.tensor(vae.config.latents_mean).view(1, channels, 1, 1).to(latents)
        std = torch.tensor(vae.config.latents_std).view(1, channels, 1, 1).to(latents)
        image = vae.decode((latents * std + mean).to(vae.dtype), return_dict=False)[0]
        return self.pipeline.image_processor.postprocess(image, output_type="pil")

    def call_kwargs(self, jobs: list[StageJob]) -> dict[str, Any]:
        first = jobs[0]
        kwargs: dict[str, Any] = {
            "prompt": [job.inputs["prompt"] for job in jobs] if len(jobs) > 1 else first.inputs["prompt"],
            "height": int(first.params["height"]),
            "width": int(first.params["width"]),
            "guidance_scale": float(first.params["guidance_scale"]),
            "prior_token_ids": torch.cat([job.inputs["prior_token_ids"] for job in jobs]).to(self.device),
        }
        negative = first.params.get("negative_prompt")
        if negative and kwargs["guidance_scale"] > 1:
            # GLM-Image's glyph encoder sees quoted text only; the default negative is "".
            embeds = self.pipeline._get_glyph_embeds(
                [negative] * len(jobs), device=self.device, dtype=self.pipeline.dtype
            )
            kwargs["negative_prompt_embeds"] = embeds
        if first.inputs.get("prior_token_image_ids") is not None:  # I2I (never batched)
            kwargs["image"] = [first.inputs["image"]]
            kwargs["prior_token_image_ids"] = [
                t.to(self.device) for t in first.inputs["prior_token_image_ids"]
            ]
            kwargs["source_image_grid_thw"] = [
                t.to(self.device) for t in first.inputs["source_image_grid_thw"]
            ]
        return kwargs
