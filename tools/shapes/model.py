"""The components of `tiny-glm-shapes`, built from the real classes at the recipe's sizes.

The processor is GLM-Image's (``GlmImageProcessor``) with a byte-fallback tokenizer whose vocabulary also
holds the world's words as whole tokens (any text still tokenizes, byte by byte). Token ids: the image
codes first (the LM head's rows: 480 target codes, 2 preview codes, then image start and image end, so a
trained model can end the grid itself), then the 256 bytes, then special tokens and words.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import yaml
from diffusers import AutoencoderKL, GlmImageTransformer2DModel
from tokenizers import AddedToken
from transformers import GlmImageForConditionalGeneration, GlmImageProcessor

from engine.tiny import glm_image
from engine.tiny.glm_image import (
    glm_image_processor,
    glm_tokenizer,
    leading_tokens,
    special_tokens,
)
from engine.tiny.tokenizers import byte_fallback_tokenizer
from tools.shapes.world import COLOUR_NAMES, POSITION_NAMES, SHAPES, VISION_CODES

RECIPE_PATH = Path(__file__).with_name("recipe.yaml")
IMAGE_START_ID, IMAGE_END_ID = VISION_CODES, VISION_CODES + 1
LM_HEAD_ROWS = VISION_CODES + 2  # image start/end inside the head: the model itself ends the grid
WORDS = sorted(
    {"a", "on", "background", *COLOUR_NAMES, *SHAPES, *(w for p in POSITION_NAMES for w in p.split())}
)


def load_recipe(path: Path = RECIPE_PATH) -> dict[str, Any]:
    return yaml.safe_load(Path(path).read_text())


def build_processor() -> GlmImageProcessor:
    backend = byte_fallback_tokenizer(leading_tokens(VISION_CODES), special_tokens())
    # Whole words (only where they stand alone): a caption is ~18 tokens instead of ~43 bytes.
    backend.add_tokens([AddedToken(w, single_word=True, normalized=False, special=False) for w in WORDS])
    tokenizer = glm_tokenizer(backend)
    assert tokenizer.convert_tokens_to_ids(glm_image.IMAGE_START) == IMAGE_START_ID
    return glm_image_processor(tokenizer)


def build_ar(recipe: dict[str, Any], processor: GlmImageProcessor) -> GlmImageForConditionalGeneration:
    config = glm_image.ar_config(recipe, processor.tokenizer, codes=VISION_CODES, head_rows=LM_HEAD_ROWS)
    torch.manual_seed(int(recipe["seed"]))
    return GlmImageForConditionalGeneration(config)


def build_transformer(recipe: dict[str, Any]) -> GlmImageTransformer2DModel:
    return glm_image.build_dit(recipe, VISION_CODES)


def build_vae(recipe: dict[str, Any]) -> AutoencoderKL:
    return glm_image.build_vae(recipe, sample_size=128, layers_per_block=recipe["vae"]["layers_per_block"])
