"""Stage input processors: turn one stage's outputs into the next stage's inputs.

``ar2diffusion`` is GLM-Image's hand-off. The AR stage emits its generated ids as cumulative
``token_ids``: for text-to-image a small preview grid followed by the target grid (then an end token);
for image-to-image only the target grid. Source-image ids (I2I) travel as ``prior_image`` with their
grids. The DiT works at 1/16 of the image size while the AR grid is 1/32, so ids are upsampled 2x
(nearest) on the way.

``thinker2talker`` and ``talker2code2wav`` are Qwen2.5-Omni's (the ``qwen-omni`` family): the thinker's
hidden states become the talker's prompt, the talker's codec ids become code2wav's input.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

AR_GRID_FACTOR = 32  # pixels per AR token along each side
PREVIEW_TOKENS_PER_SIDE = AR_GRID_FACTOR // 2  # the preview grid has ~16x16 tokens for square images


@dataclass(frozen=True)
class GridLayout:
    """Where the target grid sits in the AR stage's generated ids."""

    target_h: int
    target_w: int
    preview_h: int
    preview_w: int
    text_to_image: bool

    @property
    def preview_tokens(self) -> int:
        return self.preview_h * self.preview_w if self.text_to_image else 0

    @property
    def target_tokens(self) -> int:
        return self.target_h * self.target_w

    @property
    def max_new_tokens(self) -> int:
        """Preview (T2I only) + target + the end token."""
        return self.preview_tokens + self.target_tokens + 1


def grid_layout(height: int, width: int, text_to_image: bool) -> GridLayout:
    """The AR grids for an image of ``height`` x ``width`` pixels (GLM-Image's processor layout)."""
    target_h, target_w = height // AR_GRID_FACTOR, width // AR_GRID_FACTOR
    ratio = target_h / target_w
    preview_h = int(math.sqrt(ratio) * PREVIEW_TOKENS_PER_SIDE)
    preview_w = int(math.sqrt(1 / ratio) * PREVIEW_TOKENS_PER_SIDE)
    return GridLayout(target_h, target_w, preview_h, preview_w, text_to_image)


def upsample_grid_ids(ids: torch.Tensor, grid_h: int, grid_w: int) -> torch.Tensor:
    """Nearest 2x upsampling of a row-major ``grid_h`` x ``grid_w`` id grid; returns a flat (4*h*w,) tensor."""
    if ids.numel() != grid_h * grid_w:
        raise ValueError(f"expected {grid_h}x{grid_w}={grid_h * grid_w} ids, got {ids.numel()}")
    grid = ids.reshape(1, 1, grid_h, grid_w).float()
    return F.interpolate(grid, scale_factor=2, mode="nearest").to(torch.long).reshape(-1)


def split_target_grid(token_ids: torch.Tensor, layout: GridLayout) -> torch.Tensor:
    """The target grid's ids out of the cumulative generated ids (preview first for T2I)."""
    token_ids = token_ids.reshape(-1)
    needed = layout.preview_tokens + layout.target_tokens
    if token_ids.numel() < needed:
        raise ValueError(
            f"the AR stage produced {token_ids.numel()} ids but ar2diffusion needs {needed} "
            f"(preview {layout.preview_h}x{layout.preview_w} if text-to-image, then target "
            f"{layout.target_h}x{layout.target_w})"
        )
    return token_ids[layout.preview_tokens : needed]


DIFFUSION_PASS_THROUGH = (
    "prompt",
    "seed",
    "num_inference_steps",
    "guidance_scale",
    "negative_prompt",
    "height",
    "width",
)


def ar2diffusion(ar_outputs: Mapping[str, Any], params: Mapping[str, Any]) -> dict[str, Any]:
    """GLM-Image AR -> DiT hand-off.

    ``ar_outputs``: ``token_ids`` (cumulative generated ids) and, for I2I, ``prior_image`` (source ids at
    1/32) with ``prior_image_grid_thw`` (one ``(t, h, w)`` row per source image).
    ``params``: the diffusion stage's resolved parameters (height, width, seed, steps, guidance, negative
    prompt, prompt), passed on unchanged.
    """
    if "token_ids" not in ar_outputs:
        raise ValueError(f"ar2diffusion needs 'token_ids' from the AR stage; got keys {sorted(ar_outputs)}")
    height, width = int(params["height"]), int(params["width"])
    prior_image = ar_outputs.get("prior_image")
    layout = grid_layout(height, width, text_to_image=prior_image is None)
    target = split_target_grid(torch.as_tensor(ar_outputs["token_ids"]), layout)
    inputs: dict[str, Any] = {k: params[k] for k in DIFFUSION_PASS_THROUGH if k in params}
    inputs["prior_token_ids"] = upsample_grid_ids(target, layout.target_h, layout.target_w).unsqueeze(0)
    inputs["prior_token_image_ids"] = None
    inputs["source_image_grid_thw"] = None
    if prior_image is not None:
        grids = torch.as_tensor(ar_outputs["prior_image_grid_thw"]).reshape(-1, 3)
        sizes = grids.prod(dim=-1).tolist()
        pieces = torch.split(torch.as_tensor(prior_image).reshape(-1), sizes)
        upsampled = [
            upsample_grid_ids(p, int(g[1]), int(g[2])) for p, g in zip(pieces, grids.tolist(), strict=True)
        ]
        upsampled_grids = grids.clone()
        upsampled_grids[:, 1:] *= 2
        inputs["prior_token_image_ids"] = [torch.cat(upsampled)]
        inputs["source_image_grid_thw"] = [upsampled_grids]
    inputs["layout"] = layout
    return inputs


# -- Qwen2.5-Omni: thinker -> talker -> code2wav (docs/speech.md, "Stages and hand-offs") ---------------


def thinker2talker(thinker_outputs: Mapping[str, Any], params: Mapping[str, Any]) -> dict[str, Any]:
    """The thinker's ``latent`` output -> the talker's prompt and the reply it reads one row per code.

    ``latent`` holds one row per position the thinker computed: its last hidden state plus its input
    embedding (zero at audio and image positions), the prompt's ``P`` rows first, then one per reply
    token it fed back (all but the last). ``speech_text_embeds`` are the thinker's embeddings of the
    voice's text-start id, the text-end id and the text-pad id; ``speech_bos_id`` is that start id.

    The talker's prompt is the prompt's rows, the voice's start row and the first reply row (``P + 2``
    rows, with ``input_text_ids`` for its positions); the rest of the reply, then text-end and text-pad,
    is what it adds to each code it reads back. The end row sits right after the thinker's last real
    token and pads follow (a reply cut by a stop id within it), as transformers' one-shot ``generate``
    does. A reply of a single token has nothing to speak: ``silent`` (no codes, no samples).
    """
    for key in ("latent", "prompt_token_ids", "reply_token_ids", "speech_text_embeds", "speech_bos_id"):
        if key not in thinker_outputs:
            raise ValueError(
                f"thinker2talker needs {key!r} from the thinker; got keys {sorted(thinker_outputs)}"
            )
    rows = torch.as_tensor(thinker_outputs["latent"])
    prompt_ids = torch.as_tensor(thinker_outputs["prompt_token_ids"]).reshape(-1)
    reply_ids = torch.as_tensor(thinker_outputs["reply_token_ids"]).reshape(-1)
    bos_embed, eos_embed, pad_embed = torch.as_tensor(thinker_outputs["speech_text_embeds"]).unbind(0)
    prompt_len, replied = int(prompt_ids.numel()), int(reply_ids.numel())
    if replied < 2:  # a reply of one token (its stop id, or a budget of 1) leaves nothing to speak
        return {"silent": True}
    if rows.shape[0] != prompt_len + replied - 1:
        raise ValueError(
            f"thinker latent has {rows.shape[0]} rows; expected {prompt_len} prompt + {replied - 1} reply rows"
        )
    reply = rows[prompt_len:]
    prompt_embeds = torch.cat([rows[:prompt_len], bos_embed[None], reply[:1]])
    reply = torch.cat([reply[1:], eos_embed[None], pad_embed[None]])
    # Where the thinker stopped: its first stop id (kept within 1..replied-1, as the library does); the
    # end row goes just before that position and pads from it on.
    stops = torch.as_tensor(list(thinker_outputs.get("stop_token_ids") or []), dtype=torch.long)
    is_stop = (
        (reply_ids[:, None] == stops[None, :]).any(dim=-1)
        if stops.numel()
        else torch.zeros(replied, dtype=torch.bool)
    )
    first = int(torch.nonzero(is_stop)[0, 0]) if bool(is_stop.any()) else replied
    first = min(max(first, 1), replied - 1)
    positions = torch.arange(reply.shape[0])[:, None]
    reply = torch.where(positions >= first, pad_embed, reply)
    reply = torch.where(positions == first - 1, eos_embed, reply)
    text_ids = torch.cat([prompt_ids, torch.tensor([int(thinker_outputs["speech_bos_id"])]), reply_ids[:1]])
    inputs: dict[str, Any] = {
        "prompt_embeds": prompt_embeds.unsqueeze(0),
        "input_text_ids": text_ids.unsqueeze(0),
        "thinker_reply_part": reply.unsqueeze(0),
    }
    if "rng_state" in thinker_outputs:  # the seeded stream goes on where the thinker left it
        inputs["rng_state"] = thinker_outputs["rng_state"]
    return inputs


def talker2code2wav(talker_outputs: Mapping[str, Any], params: Mapping[str, Any]) -> dict[str, Any]:
    """The talker's codec ids, cut at its first stop id (end or pad), for code2wav."""
    if "token_ids" not in talker_outputs:
        raise ValueError(
            f"talker2code2wav needs 'token_ids' from the talker; got keys {sorted(talker_outputs)}"
        )
    codes = torch.as_tensor(talker_outputs["token_ids"]).reshape(-1).to(torch.long)
    stops = set(int(i) for i in talker_outputs.get("stop_token_ids") or ())
    length = next((i for i, code in enumerate(codes.tolist()) if code in stops), codes.numel())
    inputs: dict[str, Any] = {"codes": codes[:length].unsqueeze(0)}
    if "rng_state" in talker_outputs:
        inputs["rng_state"] = talker_outputs["rng_state"]
    return inputs


INPUT_PROCESSORS: dict[str, Callable[[Mapping[str, Any], Mapping[str, Any]], dict[str, Any]]] = {
    "ar2diffusion": ar2diffusion,
    "thinker2talker": thinker2talker,
    "talker2code2wav": talker2code2wav,
}
