"""The real-width GLM-Image builder (tools/real_width, docs/real-shapes.md): its configurations carry the
released widths, its cut keeps them, its tokenizer puts the special tokens at the ids the config names,
and its head pin keeps a random model's draws inside the codebook. Config objects and a narrow model
only: the real build (5 GB) is bench/real_shapes.py's."""

from __future__ import annotations

import pytest
import torch

from tools.real_width.builder import (
    CODES,
    check_head,
    cut_configs,
    pin_head,
    released_configs,
)


@pytest.fixture(scope="module")
def released():
    return released_configs()


def test_released_widths(released):
    text, vision, vq = released.ar.text_config, released.ar.vision_config, released.ar.vq_config
    assert (text.hidden_size, text.vocab_size, text.vision_vocab_size) == (4096, 168064, 16512)
    assert (text.num_hidden_layers, text.num_attention_heads, text.num_key_value_heads) == (40, 32, 2)
    assert (vision.hidden_size, vision.depth, vision.patch_size) == (1536, 40, 16)
    assert vq.num_embeddings == CODES == released.dit["prior_vq_quantizer_codebook_size"] == 16384
    dit = released.dit
    assert (dit["num_layers"], dit["num_attention_heads"], dit["attention_head_dim"]) == (30, 64, 40)
    assert dit["text_embed_dim"] == released.glyph.d_model == 1472
    assert dit["in_channels"] == released.vae["latent_channels"] == 16
    ids = released.ar
    assert (ids.image_start_token_id, ids.image_end_token_id, ids.image_token_id) == (16384, 16385, 167855)


def test_cut_keeps_widths_and_leaves_the_released_configs_alone(released):
    cut = cut_configs(released, layers=2)
    assert cut.ar.text_config.num_hidden_layers == cut.ar.vision_config.depth == 2
    assert cut.dit["num_layers"] == cut.glyph.num_layers == cut.vae["layers_per_block"] == 2
    assert cut.ar.text_config.hidden_size == 4096 and cut.ar.text_config.vocab_size == 168064
    assert cut.dit["num_attention_heads"] * cut.dit["attention_head_dim"] == 2560
    assert released.ar.text_config.num_hidden_layers == 40 and released.dit["num_layers"] == 30


def test_rotary_embedding_runs_at_the_released_head_size(released):
    from transformers.models.glm_image.modeling_glm_image import GlmImageTextRotaryEmbedding

    text = released.ar.text_config
    rotary = GlmImageTextRotaryEmbedding(text)
    positions = torch.arange(6)[None, None].expand(3, 1, -1)
    cos, _ = rotary(torch.zeros(1), positions)
    # M-RoPE [8, 12, 12] pairs: 64 of the 128 head dims rotate (partial_rotary_factor 0.5).
    assert cos.shape[-1] == 2 * sum(text.rope_parameters["mrope_section"]) == 64


def test_tokenizer_ids_match_the_config(released):
    from tools.real_width.builder import build_tokenizer_backend

    tokenizer = build_tokenizer_backend()
    config, text = released.ar, released.ar.text_config
    assert tokenizer.token_to_id("<|image|>") == config.image_token_id
    assert tokenizer.token_to_id("<|begin_of_image|>") == config.image_start_token_id
    assert tokenizer.token_to_id("<|end_of_image|>") == config.image_end_token_id == text.eos_token_id
    assert tokenizer.token_to_id("<|endoftext|>") == text.pad_token_id
    assert tokenizer.get_vocab_size() <= text.vocab_size
    encoded = tokenizer.encode("<sop>32 32<eop>").ids  # the processor's grid string: bytes between specials
    assert encoded[0] == tokenizer.token_to_id("<sop>") and encoded[-1] == tokenizer.token_to_id("<eop>")


def test_head_pin_keeps_draws_in_the_codebook(released):
    from transformers import GlmImageForConditionalGeneration

    config = cut_configs(released, layers=1).ar
    text = config.text_config
    # The released vocabularies: the head still has rows above the codebook.
    # Narrow, at the released head size (128: M-RoPE's sections need it).
    text.hidden_size, text.intermediate_size, text.num_attention_heads = 256, 512, 2
    config.vision_config.hidden_size, config.vision_config.intermediate_size = 32, 64
    config.vision_config.num_heads = 2
    config.vq_config.embed_dim, config.vq_config.latent_channels = 8, 32
    torch.manual_seed(0)
    model = GlmImageForConditionalGeneration(config).eval()
    with pytest.raises(RuntimeError, match="pin did not hold"):
        check_head(model, seed=0, min_margin=5.0)
    pin_head(model)
    assert check_head(model, seed=0, min_margin=5.0) >= 5.0
