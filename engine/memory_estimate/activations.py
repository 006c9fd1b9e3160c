"""What a stage holds beyond its checkpoint while it loads and runs (docs/memory.md, "What is counted"):
the copies vLLM's CPU loader keeps, a diffusion stage's working memory at its image size (one DiT forward,
the DiT's cache of an image-to-image source, the VAE decode) and the process the stages live in.

Every term comes from the component's ``config.json`` and the deploy config, never from loading, and each
coefficient here is the count of live tensors measured on the real-width GLM-Image (docs/memory.md,
"Measured"; tools/real_width/measure_memory.py)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from engine.memory_estimate.checkpoints import FLOAT_DTYPES, ComponentWeights

# A DiT block's peak under inference mode: its feed-forward's projection and activation (2 x tokens x FF)
# beside six tokens x width tensors (the block input, its norm, the modulated norm, the attention output,
# the residual, the FF output). Measured: 560 MiB at 4101 tokens x 2560 (FF 10240) float32; this gives 561.
DIT_FF_TENSORS = 2
DIT_WIDTH_TENSORS = 6
# The VAE decode's peak: four feature maps of the decoder's largest (channels x height x width) live at
# once: a resnet's input, its GroupNorm and SiLU outputs and the convolution's output (oneDNN's reordered
# copy of its input at times instead). Measured: 3.9 GiB (3.75 maps of 1 GiB) at 1024x1024, 256 channels.
# oneDNN lays channels out in blocks of 16 (AVX-512): a toy VAE of 8 channels takes maps of 16 (measured:
# 769 MiB decoding 2048x2048 at 8 channels, 6 maps of 8 = 3 of 16; with AVX2 only, blocks of 8: 2.5 maps;
# tests/test_memory_estimate.py). glibc's heap may hold freed smaller maps on top: the margin's part.
VAE_DECODE_MAPS = 4
CHANNEL_BLOCK = 16
# The process the in-process stages share, on the CPU: the interpreter and its libraries (torch,
# transformers, diffusers, vLLM, the studio's server). Measured: 454 MiB after importing a vLLM stage's
# runner, 258 MiB for a diffusers stage alone; the studio's server adds its own.
PROCESS_RUNTIME_CPU = 512 << 20


@dataclass(frozen=True)
class DiffusionWork:
    """A diffusion stage's working memory at ``height`` x ``width`` for ``batch`` images at once."""

    height: int
    width: int
    batch: int
    size_from: str  # "default_sampling_params", or where the size came from
    dit_forward: int  # one DiT forward (CFG runs its two passes one after the other)
    dit_source_cache: int  # image-to-image: the DiT's keys and values of the source, every layer
    vae_decode: int

    @property
    def bytes(self) -> int:
        # The source cache lives through the denoising loop and is cleared before the decode.
        return self.batch * max(self.dit_forward + self.dit_source_cache, self.vae_decode)


def vae_scale(vae: Mapping[str, Any]) -> int:
    """Pixels per latent: 2 per downsampling level (AutoencoderKL: one fewer than its levels)."""
    levels = len(vae.get("block_out_channels") or [1])
    return 2 ** (levels - 1)


def vae_largest_map(vae: Mapping[str, Any], height: int, width: int) -> int:
    """Elements of the decoder's largest feature map at ``height`` x ``width`` (AutoencoderKL's decoder:
    the channels reversed, each level after the first entered by an upsampler carrying the previous
    level's channels at twice the size; channels in blocks of :data:`CHANNEL_BLOCK`). 0 when the config
    has no ``block_out_channels``."""
    channels = [
        -(-int(c) // CHANNEL_BLOCK) * CHANNEL_BLOCK for c in reversed(vae.get("block_out_channels") or [])
    ]
    if not channels:
        return 0
    scale = vae_scale(vae)
    h, w = height // scale, width // scale
    largest = 0
    for level, out in enumerate(channels):
        widest = max(out, channels[level - 1]) if level else out
        largest = max(largest, widest * (h << level) * (w << level))
    return largest


def dit_tokens(transformer: Mapping[str, Any], vae: Mapping[str, Any], height: int, width: int) -> int:
    """Image tokens of a DiT at ``height`` x ``width``: latents (the VAE's scale) in patches."""
    per_token = vae_scale(vae) * int(transformer.get("patch_size") or 1)
    return (height // per_token) * (width // per_token)


def dit_width(transformer: Mapping[str, Any]) -> int:
    """A DiT's hidden width: heads x head size (0 when the config does not say: not a DiT)."""
    heads = transformer.get("num_attention_heads")
    head_dim = transformer.get("attention_head_dim")
    if not isinstance(heads, int) or not isinstance(head_dim, int):
        return 0
    return heads * head_dim


def diffusion_work(
    transformer: Mapping[str, Any],
    vae: Mapping[str, Any],
    params: Mapping[str, Any],
    batch: int,
    element_size: int,
    image_to_image: bool,
) -> DiffusionWork:
    """The working memory of a diffusion stage from its DiT's and VAE's ``config.json`` and its default
    size (``height``/``width`` of ``params``, else the VAE's ``sample_size``, else 1024)."""
    height, width = params.get("height"), params.get("width")
    source = "default_sampling_params"
    if not isinstance(height, int) or not isinstance(width, int):
        size = vae.get("sample_size")
        height = width = size if isinstance(size, int) else 1024
        source = "the VAE's sample_size" if isinstance(size, int) else "1024 (nothing says)"
    width_d = dit_width(transformer)
    tokens = dit_tokens(transformer, vae, height, width)
    forward = tokens * element_size * (DIT_FF_TENSORS * 4 * width_d + DIT_WIDTH_TENSORS * width_d)
    layers = int(transformer.get("num_layers") or 0)
    # The source image at the target's size: its tokens' keys and values in every layer.
    cache = 2 * layers * tokens * width_d * element_size if image_to_image else 0
    decode = VAE_DECODE_MAPS * vae_largest_map(vae, height, width) * element_size
    return DiffusionWork(height, width, max(1, batch), source, forward, cache, decode)


# -- vLLM ------------------------------------------------------------------------------------------

# vLLM's batched-token budget when the deploy config leaves max_num_batched_tokens unset (its default
# depends on the platform and entry point; this is the API server's on a GPU).
VLLM_DEFAULT_BATCHED_TOKENS = 8192


def vllm_token_buffers(text: Any, max_num_batched_tokens: int | None, element_size: int) -> int:
    """vLLM's model runner keeps an input-embeddings buffer of ``max_num_batched_tokens`` x hidden size in
    the model's dtype from the start. Measured on a CPU: 16.1 KiB more per batched token at hidden 4096
    float32 (8387 MiB after loading at 32768 tokens, 8000 MiB at 8192)."""
    tokens = max_num_batched_tokens or VLLM_DEFAULT_BATCHED_TOKENS
    return int(tokens) * int(getattr(text, "hidden_size", 0) or 0) * element_size


EMBEDDING_SUFFIX = "embed_tokens.weight"
LM_HEAD_NAME = "lm_head.weight"


def vllm_cpu_copies(component: ComponentWeights, tied: bool, element_size: int) -> int:
    """Bytes vLLM's CPU loader adds to ``component``: its input embedding and LM head (vLLM's vocabulary
    layers) keep their weight *and* a packed copy for the CPU GEMM (oneDNN's or the AMX kernel's), where
    every other linear layer's packed copy replaces its weight. A tied head is a second layer on the same
    weight: two copies of the embedding."""
    embedding = [t for t in component.tensors if t.name.endswith(EMBEDDING_SUFFIX) and "visual" not in t.name]
    head = [t for t in component.tensors if t.name == LM_HEAD_NAME or t.name.endswith("." + LM_HEAD_NAME)]
    tied = tied and not head

    def size(tensors: list) -> int:
        return sum(t.numel * element_size if t.dtype in FLOAT_DTYPES else t.nbytes for t in tensors)

    return size(embedding) * (2 if tied else 1) + size(head)
