"""Build ``tiny-glm-image``: a GLM-Image pipeline of the real classes at toy size, saved in HF format.

The folder layout is the real checkpoint's (``vision_language_encoder/``, ``processor/``, ``transformer/``,
``vae/``, ``text_encoder/``, ``tokenizer/``, ``scheduler/``), so it loads through the same code as one.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from diffusers import (
    FlowMatchEulerDiscreteScheduler,
    GlmImagePipeline,
    GlmImageTransformer2DModel,
)
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
    "{%- if item.type == 'image' -%}" + IMAGE_START + IMAGE_TOKEN + IMAGE_END +
    "{%- elif item.type == 'text' -%}{{ item.text }}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}{%- endfor -%}"
)


def build_processor(codes: int) -> GlmImageProcessor:
    leading = [f"<|vq_{i}|>" for i in range(codes)] + [IMAGE_START, IMAGE_END]
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=byte_fallback_tokenizer(leading, [IMAGE_TOKEN, GRID_BOS, GRID_EOS, PAD, *ROLE_TOKENS]),
        bos_token=IMAGE_START,  # the processor ends every prompt with bos = image start
        eos_token=IMAGE_END,
        pad_token=PAD,
        extra_special_tokens={"image_token": IMAGE_TOKEN, "grid_bos_token": GRID_BOS, "grid_eos_token": GRID_EOS},
        padding_side="left",
    )
    image_processor = GlmImageImageProcessorPil(
        patch_size=16, temporal_patch_size=1, merge_size=1, size={"shortest_edge": 32 * 32, "longest_edge": 1024 * 1024}
    )
    return GlmImageProcessor(image_processor=image_processor, tokenizer=tokenizer, chat_template=CHAT_TEMPLATE)


def build(recipe: dict[str, Any], out_dir: Path) -> None:
    seed = int(recipe["seed"])
    codes = int(recipe["vision_codes"])
    processor = build_processor(codes)
    tok = processor.tokenizer
    ar, vision, vq = recipe["ar"], recipe["vision"], recipe["vq"]
    config = GlmImageConfig(
        text_config={
            "vocab_size": len(tok),
            "hidden_size": ar["hidden_size"],
            "intermediate_size": ar["intermediate_size"],
            "num_hidden_layers": ar["num_hidden_layers"],
            "num_attention_heads": ar["num_attention_heads"],
            "num_key_value_heads": ar["num_key_value_heads"],
            "max_position_embeddings": ar["max_position_embeddings"],
            # The LM head covers the image codes only: a random model can never emit a start/end id
            # mid-grid, so every request yields exactly the grid the processor asked for.
            "vision_vocab_size": codes,
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
        vq_config={"embed_dim": vq["embed_dim"], "num_embeddings": codes, "latent_channels": vision["hidden_size"]},
        image_token_id=tok.convert_tokens_to_ids(IMAGE_TOKEN),
        image_start_token_id=tok.convert_tokens_to_ids(IMAGE_START),
        image_end_token_id=tok.convert_tokens_to_ids(IMAGE_END),
    )
    torch.manual_seed(seed)
    ar_model = GlmImageForConditionalGeneration(config).eval()

    glyph = recipe["glyph_encoder"]
    torch.manual_seed(seed + 1)
    text_encoder = T5EncoderModel(T5Config(vocab_size=BYT5_VOCAB, **glyph)).eval()

    dit = recipe["transformer"]
    torch.manual_seed(seed + 2)
    transformer = GlmImageTransformer2DModel(
        in_channels=recipe["vae"]["latent_channels"],
        out_channels=recipe["vae"]["latent_channels"],
        text_embed_dim=glyph["d_model"],
        prior_vq_quantizer_codebook_size=codes,
        **dit,
    )

    vae_cfg = recipe["vae"]
    torch.manual_seed(seed + 3)
    vae = tiny_autoencoder(
        vae_cfg,
        sample_size=64,
        latents_mean=[0.0] * vae_cfg["latent_channels"],
        latents_std=[1.0] * vae_cfg["latent_channels"],
    )
    pipe = GlmImagePipeline(
        tokenizer=ByT5Tokenizer(),
        processor=processor,
        text_encoder=text_encoder,
        vision_language_encoder=ar_model,
        vae=vae,
        transformer=transformer,
        scheduler=FlowMatchEulerDiscreteScheduler(),
    )
    pipe.save_pretrained(out_dir)
