"""Shared pieces of the tiny built-in models."""

from __future__ import annotations

from typing import Any

from diffusers import AutoencoderKL


def tiny_autoencoder(vae: dict[str, Any], **extra: Any) -> AutoencoderKL:
    """An RGB ``AutoencoderKL`` with one down/up block per entry of ``vae['block_out_channels']``.

    ``extra`` carries the family's own settings (latent statistics, scaling and shift factors).
    Seed torch before calling: the weights are random and the build must be deterministic.
    """
    levels = len(vae["block_out_channels"])
    return AutoencoderKL(
        in_channels=3,
        out_channels=3,
        block_out_channels=tuple(vae["block_out_channels"]),
        down_block_types=["DownEncoderBlock2D"] * levels,
        up_block_types=["UpDecoderBlock2D"] * levels,
        latent_channels=vae["latent_channels"],
        norm_num_groups=vae["norm_num_groups"],
        **extra,
    )
