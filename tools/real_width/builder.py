"""Build a GLM-Image at the released model's widths, with each stack cut to a layer or two.

Every width comes from the libraries' default configurations (transformers' ``GlmImageConfig`` and its
text / vision / VQ sub-configs, diffusers' ``GlmImageTransformer2DModel`` defaults); only the number of
layers per stack is cut. Weights are random (seeded). The folder is the real checkpoint's layout (the
component folders ``engine/tiny/glm_image.py`` writes, saved by the same ``save_glm_image``), so
``omni-studio serve --model <folder>`` loads it through the same code as the tiny model and as a
downloaded checkpoint. docs/real-shapes.md says what it proves and what it does not.

What is not a library default, and why (docs/real-shapes.md, "Choices"):

* ``rope_parameters``: the text config's default ``mrope_section`` [8, 12, 12] sums to 32 rotary pairs,
  which needs ``partial_rotary_factor`` 0.5 at head size 128; without it the default config cannot run a
  forward (``split_with_sizes`` fails). 0.5 is the only value the defaults fit.
* The glyph encoder (``text_encoder/``): T5 at ByT5-small's widths (d_model 1472, the DiT's default
  ``text_embed_dim``); ``T5Config``'s own defaults are t5-small's 512.
* The VAE: ``AutoencoderKL``'s defaults are one 64-channel level (no downscaling); the DiT's defaults need 16
  latent channels and, with patch 2, an 8x VAE: the usual 4-level 128/256/512/512 layout.
* The tokenizer: byte fallback (no merges) with the released ids where the config names them: image codes
  0..16383, image start 16384, image end 16385 (the default ``eos_token_id``), pad 167841, ``<|image|>``
  167855; reserved fillers in between.
* The LM head: ``vision_vocab_size`` 16512 rows, but the DiT's prior embedding has 16384 (the codebook).
  A trained model only draws codes; a random one would draw ids 16384..16511 about once in 130 tokens,
  and the DiT's embedding would fail on them. So one residual channel carries a constant (the embedding's
  column ``PIN_CHANNEL``; no layer writes to it) and the head's rows above the codebook read it with a
  large negative weight: their logits sit ~40 below the codes', and the head keeps its released shape.
"""

from __future__ import annotations

import hashlib
import inspect
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

COMPLETE_MARKER = ".real-width-complete"
DEFAULT_SEED = 0
DEFAULT_LAYERS = 1

CODES = 16384  # the VQ codebook: GlmImageVQVAEConfig().num_embeddings
IMAGE_START_ID, IMAGE_END_ID = 16384, 16385
PAD_ID, IMAGE_TOKEN_ID = 167841, 167855
PIN_CHANNEL = -1  # the residual channel that carries the constant (see the module docstring)
PIN_VALUE = 100.0
PIN_HEAD_WEIGHT = -1.0

# ByT5-small's widths (the DiT's default text_embed_dim is its d_model); 12 layers released.
GLYPH_WIDTHS: dict[str, Any] = {
    "d_model": 1472,
    "d_kv": 64,
    "d_ff": 3584,
    "num_heads": 6,
    "num_layers": 12,
    "feed_forward_proj": "gated-gelu",
    "is_gated_act": True,
    "dense_act_fn": "gelu_new",
}
VAE_WIDTHS: dict[str, Any] = {
    "block_out_channels": [128, 256, 512, 512],
    "latent_channels": 16,
    "norm_num_groups": 32,
    "layers_per_block": 2,
}


@dataclass(frozen=True)
class RealWidthConfigs:
    """The configurations of every component (config objects and keyword dicts, no weights)."""

    ar: Any  # transformers.GlmImageConfig
    dit: dict[str, Any]  # GlmImageTransformer2DModel keyword arguments
    glyph: Any  # transformers.T5Config
    vae: dict[str, Any]  # AutoencoderKL keyword arguments (besides the fixed ones in build_vae)


def dit_defaults() -> dict[str, Any]:
    """diffusers' ``GlmImageTransformer2DModel.__init__`` defaults (the released DiT's widths)."""
    from diffusers import GlmImageTransformer2DModel

    params = inspect.signature(GlmImageTransformer2DModel.__init__).parameters
    return {
        name: p.default
        for name, p in params.items()
        if name != "self" and p.default is not inspect.Parameter.empty
    }


def released_configs() -> RealWidthConfigs:
    """Every component at the released widths and depths (nothing cut)."""
    from transformers import GlmImageConfig, T5Config

    ar = GlmImageConfig()  # the defaults: text, vision and VQ sub-configs at the released sizes
    text: Any = ar.text_config
    rope = dict(text.rope_parameters or {})
    rope.setdefault("mrope_section", [8, 12, 12])  # the modeling code's own default
    head_dim = text.hidden_size // text.num_attention_heads
    rope.setdefault("partial_rotary_factor", 2 * sum(rope["mrope_section"]) / head_dim)
    text.rope_parameters = rope
    glyph = T5Config(vocab_size=384, **GLYPH_WIDTHS)  # ByT5Tokenizer(): 384 ids
    return RealWidthConfigs(ar=ar, dit=dit_defaults(), glyph=glyph, vae=dict(VAE_WIDTHS))


def cut_configs(configs: RealWidthConfigs, layers: int = DEFAULT_LAYERS) -> RealWidthConfigs:
    """``configs`` with every stack cut to ``layers`` layers (widths untouched)."""
    import copy

    ar = copy.deepcopy(configs.ar)
    ar.text_config.num_hidden_layers = layers
    ar.vision_config.depth = layers
    glyph = copy.deepcopy(configs.glyph)
    glyph.num_layers = layers
    glyph.num_decoder_layers = layers
    dit = {**configs.dit, "num_layers": layers}
    vae = {**configs.vae, "layers_per_block": layers}
    return RealWidthConfigs(ar=ar, dit=dit, glyph=glyph, vae=vae)


def build_tokenizer_backend() -> Any:
    """A ``tokenizers.Tokenizer`` with the released special ids (module docstring)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models

    from engine.tiny.glm_image import (
        GRID_BOS,
        GRID_EOS,
        IMAGE_END,
        IMAGE_START,
        IMAGE_TOKEN,
        PAD,
        ROLE_TOKENS,
    )

    vocab: dict[str, int] = {f"<|vq_{i}|>": i for i in range(CODES)}
    vocab[IMAGE_START], vocab[IMAGE_END] = IMAGE_START_ID, IMAGE_END_ID
    for byte in range(256):
        vocab[f"<0x{byte:02X}>"] = len(vocab)
    specials = {PAD: PAD_ID, IMAGE_TOKEN: IMAGE_TOKEN_ID}
    for offset, token in enumerate([*ROLE_TOKENS, GRID_BOS, GRID_EOS], start=1):
        specials[token] = PAD_ID + offset
    taken = set(specials.values())
    next_id = len(vocab)
    while next_id <= IMAGE_TOKEN_ID:
        if next_id not in taken:
            vocab[f"<|reserved_{next_id}|>"] = next_id
        next_id += 1
    vocab.update(specials)
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[], byte_fallback=True))
    tokenizer.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Fuse()])
    added = [IMAGE_START, IMAGE_END, *specials]
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in added])
    return tokenizer


def build_processor() -> Any:
    """GLM-Image's processor (the tiny model's image settings) around :func:`build_tokenizer_backend`."""
    from engine.tiny.glm_image import glm_image_processor, glm_tokenizer

    return glm_image_processor(glm_tokenizer(build_tokenizer_backend()))


def pin_head(model: Any) -> None:
    """Keep a random model's draws inside the codebook without changing any shape (module docstring)."""
    import torch

    text = model.model.language_model
    with torch.no_grad():
        text.embed_tokens.weight[:, PIN_CHANNEL] = PIN_VALUE
        for layer in text.layers:  # no layer writes to the pinned channel: it stays PIN_VALUE
            for linear in (layer.self_attn.o_proj, layer.mlp.down_proj):
                linear.weight[PIN_CHANNEL, :] = 0.0
                if linear.bias is not None:
                    linear.bias[PIN_CHANNEL] = 0.0
        head = model.lm_head.weight
        head[:CODES, PIN_CHANNEL] = 0.0
        head[CODES:, PIN_CHANNEL] = PIN_HEAD_WEIGHT


def check_head(model: Any, seed: int, min_margin: float = 20.0) -> float:
    """The smallest margin, over a short random prompt (a forward of the built text decoder), by which
    the best code's logit beats every non-code logit; raises below ``min_margin`` (a non-code id could
    then be drawn)."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, CODES, (1, 16), generator=generator)
    text = model.model.language_model
    with torch.inference_mode():
        hidden = text.embed_tokens(ids)
        positions = torch.arange(ids.shape[1])[None, None].expand(3, 1, -1)
        out = text(inputs_embeds=hidden, position_ids=positions, use_cache=False).last_hidden_state
        logits = model.lm_head(out)[0]
    best_code = logits[:, :CODES].max(dim=-1).values
    worst_gap = float((best_code - logits[:, CODES:].max(dim=-1).values).min())
    if worst_gap < min_margin:
        raise RuntimeError(f"non-code ids are only {worst_gap:.1f} below the best code: the pin did not hold")
    return worst_gap


def build(out_dir: Path, *, seed: int = DEFAULT_SEED, layers: int = DEFAULT_LAYERS) -> dict[str, Any]:
    """Build the real-width GLM-Image into ``out_dir`` (which must not exist); returns a summary."""
    import torch
    from diffusers import AutoencoderKL, GlmImageTransformer2DModel
    from transformers import GlmImageForConditionalGeneration, T5EncoderModel

    from engine.tiny.glm_image import save_glm_image

    configs = cut_configs(released_configs(), layers)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True)
    processor = build_processor()
    torch.manual_seed(seed)
    ar = GlmImageForConditionalGeneration(configs.ar).eval()
    pin_head(ar)
    margin = check_head(ar, seed)
    torch.manual_seed(seed + 1)
    glyph = T5EncoderModel(configs.glyph).eval()
    torch.manual_seed(seed + 2)
    dit = GlmImageTransformer2DModel(**configs.dit).eval()
    vae_cfg = configs.vae
    levels = len(vae_cfg["block_out_channels"])
    channels = vae_cfg["latent_channels"]
    torch.manual_seed(seed + 3)
    vae = AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=["DownEncoderBlock2D"] * levels,
        up_block_types=["UpDecoderBlock2D"] * levels,
        sample_size=1024,
        latents_mean=[0.0] * channels,
        latents_std=[1.0] * channels,
        **vae_cfg,
    ).eval()
    parts = {"vision_language_encoder": ar, "text_encoder": glyph, "transformer": dit, "vae": vae}
    params = {name: sum(p.numel() for p in module.parameters()) for name, module in parts.items()}
    save_glm_image(out_dir, processor=processor, ar=ar, glyph_encoder=glyph, transformer=dit, vae=vae)
    size = sum(f.stat().st_size for f in out_dir.rglob("*") if f.is_file())
    return {"params": params, "bytes": size, "head_margin": margin, "layers": layers, "seed": seed}


def fingerprint(seed: int = DEFAULT_SEED, layers: int = DEFAULT_LAYERS) -> str:
    """This builder's source, its settings and the library versions: what decides the built bytes."""
    import diffusers
    import torch
    import transformers

    digest = hashlib.sha256(Path(__file__).read_bytes())
    digest.update(
        f"{seed}|{layers}|{torch.__version__}|{transformers.__version__}|{diffusers.__version__}".encode()
    )
    return digest.hexdigest()[:12]


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "omni-studio" / "real-width"


def ensure_built(
    cache_dir: Path | None = None, *, seed: int = DEFAULT_SEED, layers: int = DEFAULT_LAYERS
) -> Path:
    """The cached build for these settings, building it first if needed (into a staging folder, then
    renamed: a half-written build is never used)."""
    cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    target = cache_dir / f"glm-image-real-width-L{layers}-s{seed}-{fingerprint(seed, layers)}"
    if (target / COMPLETE_MARKER).exists():
        return target
    cache_dir.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".real-width-", dir=cache_dir))
    try:
        build(staging / "model", seed=seed, layers=layers)
        (staging / "model" / COMPLETE_MARKER).write_text(target.name + "\n")
        shutil.rmtree(target, ignore_errors=True)
        os.replace(staging / "model", target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target
