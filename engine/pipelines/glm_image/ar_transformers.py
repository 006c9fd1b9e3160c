"""GLM-Image stage 0 on transformers: text (+ source image) -> image-code ids (and the source's codes)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

import torch
from PIL import Image

from engine.processors import grid_layout
from engine.stages.ar_transformers import ARInputs, TransformersARStage
from engine.stages.base import StageJob

if TYPE_CHECKING:
    from transformers import BatchFeature, GlmImageProcessor

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
            .to(self.device)  # type: ignore[arg-type]  # transformers types the wrapped `to` as unbound
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
        conversation: list[list[dict[str, Any]]] = [[{"role": "user", "content": content}]]
        encoded = self.processor.apply_chat_template(
            conversation,
            tokenize=True,
            target_h=height,
            target_w=width,
            return_dict=True,
            return_tensors="pt",
        )
        inputs = cast("BatchFeature", encoded).to(self.device)  # return_dict=True: a BatchFeature
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
