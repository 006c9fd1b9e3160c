"""Build ``tiny-glm-image``: a GLM-Image pipeline of the real classes at toy size, saved in HF format.

The folder layout is the real checkpoint's (``vision_language_encoder/``, ``processor/``, ``transformer/``,
``vae/``, ``text_encoder/``, ``tokenizer/``, ``scheduler/``), so it loads through the same code as one.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, cast

import torch
from diffusers import (
    AutoencoderKL,
    FlowMatchEulerDiscreteScheduler,
    GlmImagePipeline,
    GlmImageTransformer2DModel,
)
from tokenizers import Tokenizer
from transformers import (
    ByT5Tokenizer,
    GlmImageConfig,
    GlmImageForConditionalGeneration,
    GlmImageProcessor,
    PreTrainedTokenizerFast,
    T5Config,
    T5EncoderModel,
)
from transformers.models.glm_image.image_processing_pil_glm_image import GlmImageImageProcessorPil

from engine.tiny.components import tiny_autoencoder
from engine.tiny.tokenizers import byte_fallback_tokenizer

IMAGE_START, IMAGE_END = "<|begin_of_image|>", "<|end_of_image|>"
IMAGE_TOKEN, GRID_BOS, GRID_EOS, PAD = "<|image|>", "<sop>", "<eop>", "<|endoftext|>"
ROLE_TOKENS = ["<|system|>", "<|user|>", "<|assistant|>"]
BYT5_VOCAB = 384  # ByT5Tokenizer(): 3 specials + 256 bytes + 125 extra ids

# A source image renders as start, placeholder (expanded by the processor to one per source token), end:
# GlmImageModel.get_rope_index finds source images by those two ids.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}<|{{ message.role }}|>"
    "{%- if message.content is string -%}{{ message.content }}{%- else -%}"
    "{%- for item in message.content -%}"
    "{%- if item.type == 'image' -%}"
    + IMAGE_START
    + IMAGE_TOKEN
    + IMAGE_END
    + "{%- elif item.type == 'text' -%}{{ item.text }}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}{%- endfor -%}"
)


def glm_image_processor(tokenizer: PreTrainedTokenizerFast) -> GlmImageProcessor:
    """GLM-Image's processor around ``tokenizer`` (16 px patches, the chat template above)."""
    image_processor = GlmImageImageProcessorPil(
        patch_size=16,
        temporal_patch_size=1,
        merge_size=1,
        size={"shortest_edge": 32 * 32, "longest_edge": 1024 * 1024},
    )
    return GlmImageProcessor(
        image_processor=image_processor, tokenizer=tokenizer, chat_template=CHAT_TEMPLATE
    )


def glm_tokenizer(backend: Tokenizer) -> PreTrainedTokenizerFast:
    """The processor's tokenizer: prompts end with image start (bos), grids end with image end (eos)."""
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=IMAGE_START,  # the processor ends every prompt with bos = image start
        eos_token=IMAGE_END,
        pad_token=PAD,
        extra_special_tokens={
            "image_token": IMAGE_TOKEN,
            "grid_bos_token": GRID_BOS,
            "grid_eos_token": GRID_EOS,
        },
        padding_side="left",
    )


def leading_tokens(codes: int) -> list[str]:
    """The first ids of the vocabulary: ``codes`` image codes, then image start and image end."""
    return [f"<|vq_{i}|>" for i in range(codes)] + [IMAGE_START, IMAGE_END]


def special_tokens() -> list[str]:
    return [IMAGE_TOKEN, GRID_BOS, GRID_EOS, PAD, *ROLE_TOKENS]


def build_processor(codes: int) -> GlmImageProcessor:
    return glm_image_processor(
        glm_tokenizer(byte_fallback_tokenizer(leading_tokens(codes), special_tokens()))
    )


def ar_config(
    recipe: dict[str, Any], tok: PreTrainedTokenizerFast, *, codes: int, head_rows: int
) -> GlmImageConfig:
    """``GlmImageForConditionalGeneration``'s config from the recipe's ``ar``, ``vision`` and ``vq`` sections.

    ``head_rows`` is the LM head's size (``vision_vocab_size``): ``codes`` keeps image start/end out of the
    head, ``codes + 2`` puts them in (ids ``codes`` and ``codes + 1``, see ``leading_tokens``).
    """
    ar, vision, vq = recipe["ar"], recipe["vision"], recipe["vq"]
    return GlmImageConfig(
        text_config={
            "vocab_size": len(tok),
            "hidden_size": ar["hidden_size"],
            "intermediate_size": ar["intermediate_size"],
            "num_hidden_layers": ar["num_hidden_layers"],
            "num_attention_heads": ar["num_attention_heads"],
            "num_key_value_heads": ar["num_key_value_heads"],
            "max_position_embeddings": ar["max_position_embeddings"],
            "vision_vocab_size": head_rows,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": float(ar["rope_theta"]),
                "mrope_section": list(ar["mrope_section"]),
                "partial_rotary_factor": 1.0,
            },
            "pad_token_id": tok.convert_tokens_to_ids(PAD),
            "eos_token_id": tok.convert_tokens_to_ids(IMAGE_END),
        },
        vision_config=dict(vision),
        vq_config={
            "embed_dim": vq["embed_dim"],
            "num_embeddings": codes,
            "latent_channels": vision["hidden_size"],
        },
        image_token_id=_token_id(tok, IMAGE_TOKEN),
        image_start_token_id=_token_id(tok, IMAGE_START),
        image_end_token_id=_token_id(tok, IMAGE_END),
    )


def _token_id(tok: PreTrainedTokenizerFast, token: str) -> int:
    """One token's id (``convert_tokens_to_ids`` of a single string is an int)."""
    return cast(int, tok.convert_tokens_to_ids(token))


def build_glyph_encoder(recipe: dict[str, Any]) -> T5EncoderModel:
    """The T5 glyph encoder (random: it only sees quoted text)."""
    torch.manual_seed(int(recipe["seed"]) + 1)
    return T5EncoderModel(T5Config(vocab_size=BYT5_VOCAB, **recipe["glyph_encoder"])).eval()


def build_dit(recipe: dict[str, Any], codes: int) -> GlmImageTransformer2DModel:
    torch.manual_seed(int(recipe["seed"]) + 2)
    channels = recipe["vae"]["latent_channels"]
    return GlmImageTransformer2DModel(
        in_channels=channels,
        out_channels=channels,
        text_embed_dim=recipe["glyph_encoder"]["d_model"],
        prior_vq_quantizer_codebook_size=codes,
        **recipe["transformer"],
    )


def build_vae(recipe: dict[str, Any], sample_size: int, **extra: Any) -> AutoencoderKL:
    """The VAE with identity latent statistics (a trained model measures and stores its own)."""
    channels = recipe["vae"]["latent_channels"]
    torch.manual_seed(int(recipe["seed"]) + 3)
    return tiny_autoencoder(
        recipe["vae"],
        sample_size=sample_size,
        latents_mean=[0.0] * channels,
        latents_std=[1.0] * channels,
        **extra,
    )


def save_glm_image(
    out_dir: Path,
    *,
    processor: GlmImageProcessor,
    ar: GlmImageForConditionalGeneration,
    glyph_encoder: T5EncoderModel,
    transformer: GlmImageTransformer2DModel,
    vae: AutoencoderKL,
    dtype: torch.dtype = torch.float32,
) -> Path:
    """Save the components as a GLM-Image checkpoint folder (the real layout, ``from_pretrained``-able).

    ``dtype`` other than float32 converts the DiT, the VAE and the glyph encoder (the AR stays float32).
    """
    pipe = GlmImagePipeline(
        tokenizer=ByT5Tokenizer(),
        processor=processor,
        text_encoder=glyph_encoder.eval(),
        vision_language_encoder=ar.eval(),
        vae=vae.eval(),
        transformer=transformer.eval(),
        scheduler=FlowMatchEulerDiscreteScheduler(),
    )
    if dtype != torch.float32:
        for module in (transformer, vae, glyph_encoder):
            module.to(dtype)  # type: ignore[arg-type]  # transformers types the wrapped `to` as unbound
    pipe.save_pretrained(out_dir)
    return Path(out_dir)


def build(recipe: dict[str, Any], out_dir: Path) -> None:
    codes = int(recipe["vision_codes"])
    processor = build_processor(codes)
    # The LM head covers the image codes only: a random model can never emit a start/end id mid-grid, so
    # every request yields exactly the grid the processor asked for.
    config = ar_config(recipe, processor.tokenizer, codes=codes, head_rows=codes)
    torch.manual_seed(int(recipe["seed"]))
    ar_model = GlmImageForConditionalGeneration(config).eval()
    save_glm_image(
        out_dir,
        processor=processor,
        ar=ar_model,
        glyph_encoder=build_glyph_encoder(recipe),
        transformer=build_dit(recipe, codes),
        vae=build_vae(recipe, sample_size=64),
    )
