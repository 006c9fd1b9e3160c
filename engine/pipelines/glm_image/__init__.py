"""GLM-Image: AR (``vision_language_encoder``) -> ``ar2diffusion`` -> DiT + VAE.

Stage 0 runs the AR model on the processor's prompt (text, optional source image, the target and preview
grid shapes) and emits the generated image-code ids as ``token_ids``; for I2I it also emits the source
image's codes as ``prior_image``. Stage 1 runs ``GlmImagePipeline`` without its AR half, fed
``prior_token_ids`` by ``ar2diffusion``. With the same seed the two stages reproduce the one-shot
``GlmImagePipeline`` call byte for byte: the AR stage reseeds the global RNG exactly as that call does.

I2I goes through this split path only: diffusers 0.42.1's one-shot I2I passes a concatenated tensor
where transformers >= 5.18's ``get_image_tokens`` now expects a list.
"""

from engine.pipelines.glm_image.ar_transformers import (
    AR_COMPONENT,
    PROCESSOR_COMPONENT,
    GlmImageARStage,
)
from engine.pipelines.glm_image.diffusion import GlmImageDiffusionStage
from engine.pipelines.glm_image.family import GlmImageFamily

__all__ = [
    "AR_COMPONENT",
    "PROCESSOR_COMPONENT",
    "GlmImageARStage",
    "GlmImageDiffusionStage",
    "GlmImageFamily",
]
