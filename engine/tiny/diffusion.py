"""Build ``tiny-diffusion``: a Stable Diffusion 3 pipeline at toy size (two CLIP encoders, no T5)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from diffusers import (
    AutoencoderKL,
    FlowMatchEulerDiscreteScheduler,
    SD3Transformer2DModel,
    StableDiffusion3Pipeline,
)
from transformers import CLIPTextConfig, CLIPTextModelWithProjection, PreTrainedTokenizerFast

from engine.tiny.tokenizers import word_level_tokenizer

CLIP_SPECIAL = ["<|startoftext|>", "<|endoftext|>", "<unk>"]


def _clip_tokenizer(words: list[str], max_length: int) -> PreTrainedTokenizerFast:
    return PreTrainedTokenizerFast(
        tokenizer_object=word_level_tokenizer(words, CLIP_SPECIAL, unk="<unk>"),
        bos_token="<|startoftext|>",
        eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        unk_token="<unk>",
        model_max_length=max_length,
    )


def build(recipe: dict[str, Any], out_dir: Path) -> None:
    words = str(recipe["words"]).split()
    seed = int(recipe["seed"])
    clip = recipe["clip"]
    tokenizer = _clip_tokenizer(words, int(clip["max_length"]))
    clip_config = CLIPTextConfig(
        vocab_size=len(tokenizer),
        hidden_size=clip["hidden_size"],
        intermediate_size=clip["intermediate_size"],
        num_attention_heads=clip["num_attention_heads"],
        num_hidden_layers=clip["num_hidden_layers"],
        projection_dim=clip["projection_dim"],
        max_position_embeddings=clip["max_length"],
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        hidden_act="gelu",
    )
    torch.manual_seed(seed)
    text_encoder = CLIPTextModelWithProjection(clip_config).eval()
    torch.manual_seed(seed + 1)
    text_encoder_2 = CLIPTextModelWithProjection(clip_config).eval()
    vae_cfg = recipe["vae"]
    tr = recipe["transformer"]
    torch.manual_seed(seed + 2)
    transformer = SD3Transformer2DModel(
        in_channels=vae_cfg["latent_channels"], out_channels=vae_cfg["latent_channels"], **tr
    )
    levels = len(vae_cfg["block_out_channels"])
    torch.manual_seed(seed + 3)
    vae = AutoencoderKL(
        in_channels=3,
        out_channels=3,
        block_out_channels=tuple(vae_cfg["block_out_channels"]),
        down_block_types=["DownEncoderBlock2D"] * levels,
        up_block_types=["UpDecoderBlock2D"] * levels,
        latent_channels=vae_cfg["latent_channels"],
        norm_num_groups=vae_cfg["norm_num_groups"],
        sample_size=64,
        use_quant_conv=False,
        use_post_quant_conv=False,
        shift_factor=vae_cfg["shift_factor"],
        scaling_factor=vae_cfg["scaling_factor"],
    )
    pipe = StableDiffusion3Pipeline(
        transformer=transformer,
        scheduler=FlowMatchEulerDiscreteScheduler(),
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        text_encoder_2=text_encoder_2,
        tokenizer_2=_clip_tokenizer(words, int(clip["max_length"])),
        text_encoder_3=None,
        tokenizer_3=None,
    )
    pipe.save_pretrained(out_dir)
