"""GLM-Image: AR (``vision_language_encoder``) -> ``ar2diffusion`` -> DiT + VAE.

Stage 0 runs the AR model on the processor's prompt (text, optional source image, the target and preview
grid shapes) and emits the generated image-code ids as ``token_ids``; for I2I it also emits the source
image's codes as ``prior_image``. Stage 1 runs ``GlmImagePipeline`` without its AR half, fed
``prior_token_ids`` by ``ar2diffusion``. With the same seed the two stages reproduce the one-shot
``GlmImagePipeline`` call byte for byte: the AR stage reseeds the global RNG exactly as that call does.

I2I goes through this split path only: diffusers 0.42.1's one-shot I2I passes a concatenated tensor
where transformers >= 5.18's ``get_image_tokens`` now expects a list.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from PIL import Image

from engine.config import PipelineConfig, ResolvedStage, StageTemplate
from engine.pipelines.base import PipelineFamily, fit_source_image, read_json
from engine.processors import AR_GRID_FACTOR, grid_layout
from engine.request import GenerationRequest, RequestError
from engine.stages.ar_transformers import ARInputs, TransformersARStage
from engine.stages.base import StageJob, StageRunner
from engine.stages.diffusion import DiffusersStage

if TYPE_CHECKING:
    from diffusers import GlmImagePipeline
    from transformers import GlmImageProcessor

AR_COMPONENT = "vision_language_encoder"
PROCESSOR_COMPONENT = "processor"


class GlmImageARStage(TransformersARStage):
    """Stage 0: text (+ source image) -> image-code ids on transformers."""

    processor: GlmImageProcessor

    def load(self) -> None:
        from transformers import GlmImageForConditionalGeneration, GlmImageProcessor

        self.processor = GlmImageProcessor.from_pretrained(self.model_path / PROCESSOR_COMPONENT)
        self.model = (
            GlmImageForConditionalGeneration.from_pretrained(
                self.model_path / AR_COMPONENT, dtype=self.torch_dtype
            )
            .to(self.device)
            .eval()
        )
        self.loaded = True

    def close(self) -> None:
        self.model = None
        super().close()

    def prepare(self, job: StageJob) -> ARInputs:
        params = job.params
        height, width = int(params["height"]), int(params["width"])
        image: Image.Image | None = job.inputs.get("image")
        content: list[dict[str, Any]] = []
        if image is not None:
            content.append({"type": "image", "image": image})
        content.append({"type": "text", "text": job.inputs["prompt"]})
        inputs = self.processor.apply_chat_template(
            [[{"role": "user", "content": content}]],
            tokenize=True,
            target_h=height,
            target_w=width,
            return_dict=True,
            return_tensors="pt",
        ).to(self.device)
        layout = grid_layout(height, width, text_to_image=image is None)
        extras: dict[str, Any] = {}
        if image is not None:
            extras = self._source_image_codes(inputs)
        return ARInputs(model_inputs=dict(inputs), max_new_tokens=layout.max_new_tokens, extra_outputs=extras)

    @torch.inference_mode()
    def _source_image_codes(self, inputs: Any) -> dict[str, Any]:
        """The source image's VQ codes at 1/32 scale (grid rows before the target grid)."""
        grids = inputs["image_grid_thw"]
        source_grids = grids[:-1]  # I2I: [source..., target]
        features = self.model.get_image_features(inputs["pixel_values"], source_grids).pooler_output
        codes = self.model.get_image_tokens(list(features), source_grids)
        return {"prior_image": codes.reshape(-1).cpu(), "prior_image_grid_thw": source_grids.cpu()}


class GlmImageDiffusionStage(DiffusersStage):
    """Stage 1: prior ids (+ source image) -> image, with ``GlmImagePipeline`` minus its AR half."""

    def load_pipeline(self) -> GlmImagePipeline:
        from diffusers import GlmImagePipeline

        return GlmImagePipeline.from_pretrained(
            self.model_path, vision_language_encoder=None, processor=None, dtype=self.torch_dtype
        )

    def latents_to_images(self, latents: torch.Tensor) -> list[Image.Image]:
        vae = self.pipe.vae
        channels = vae.config.latent_channels
        mean = torch.tensor(vae.config.latents_mean).view(1, channels, 1, 1).to(latents)
        std = torch.tensor(vae.config.latents_std).view(1, channels, 1, 1).to(latents)
        image = vae.decode((latents * std + mean).to(vae.dtype), return_dict=False)[0]
        return self.pipe.image_processor.postprocess(image, output_type="pil")

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
            embeds = self.pipe._get_glyph_embeds(
                [negative] * len(jobs), device=self.device, dtype=self.pipe.dtype
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
        if stage.kind == "ar":
            from engine.stages.backends import ar_runner_class

            return ar_runner_class(stage, transformers_runner=GlmImageARStage, family=self.name)(
                stage, model_path, device
            )
        return GlmImageDiffusionStage(stage, model_path, device)

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
