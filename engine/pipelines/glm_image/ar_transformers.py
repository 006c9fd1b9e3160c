"""GLM-Image stage 0 on transformers: text (+ source image) -> image-code ids (and the source's codes)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.nn.functional as F
from PIL import Image

from engine.processors import grid_layout
from engine.stages.ar_transformers import ARInputs, FastDecoder, TransformersARStage
from engine.stages.base import StageJob

if TYPE_CHECKING:
    from transformers import BatchFeature, GlmImageProcessor

AR_COMPONENT = "vision_language_encoder"
PROCESSOR_COMPONENT = "processor"


@dataclass
class _GlmRow:
    """One request's decode state: a preallocated KV cache and the rotary tables of its decode positions.

    ``keys[l]`` / ``values[l]`` hold layer ``l``'s cache, shape (1, heads, capacity, head_dim); the first
    ``length`` positions are filled. ``cos`` / ``sin`` (decode length, rotary dim) are the rotary tables
    of the tokens still to come, computed once at prefill (rotary is element-wise per position, so this
    is exactly what computing them token by token gives); ``sin`` carries ``rotate_half``'s sign.
    """

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    length: int
    cos: torch.Tensor
    sin: torch.Tensor


def _linear(module: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """``module(x)`` for x of shape (B, 1, K), each row bit-identical to ``module(x[i : i + 1])``.

    One (B, K) matrix product takes a different CPU kernel than B products of one row (the last bits
    differ, docs/batching.md); a batched product of B single-row products (``bmm``) takes the same one.
    """
    if x.shape[0] == 1:
        return F.linear(x, module.weight, module.bias)
    out = torch.bmm(x, module.weight.t().expand(x.shape[0], -1, -1))
    return out if module.bias is None else out + module.bias


def _rms_norm(norm: Any, x: torch.Tensor) -> torch.Tensor:
    """``GlmImageRMSNorm.forward`` op for op, without the module call (a third of a decode step's calls);
    the casts to and from float32 are skipped when they would be no-ops."""
    dtype = x.dtype
    hidden = x if dtype == torch.float32 else x.to(torch.float32)
    variance = hidden.pow(2).mean(-1, keepdim=True)
    hidden = hidden * torch.rsqrt(variance + norm.variance_epsilon)
    return norm.weight * (hidden if dtype == torch.float32 else hidden.to(dtype))


class GlmImageDecoder:
    """The lean decode step for ``GlmImageForConditionalGeneration`` (text-to-image prompts).

    Prefill is the model's own forward (it computes the M-RoPE positions of the prompt and of every token
    still to come, from the ``<sop>h w<eop>`` grids); its cache is copied into a preallocated one and the
    rotary tables of every position to come are computed once. Decoding then runs the text decoder's layers
    with plain functional calls: no cache concatenation, no per-token rotary or module-call overhead.
    Everything row-wise (embedding, norms, projections, rotary, MLP, LM head) runs for the whole batch at
    once (matrix products as ``bmm`` of single rows, see :func:`_linear`); attention runs per row on the
    row's own cache, with the same shapes as alone, so no row's logits depend on its neighbours (no
    padding, no masks). This mirrors ``GlmImageTextDecoderLayer.forward`` op for op (the same float math);
    ``tests/test_ar_decode.py`` checks the ids against ``generate`` and ``tests/test_batch_invariance.py``
    alone against batched.
    """

    def __init__(self, model: Any) -> None:
        self.model = model
        self.text = model.model.language_model
        config = self.text.config
        self.usable = (
            config._attn_implementation == "sdpa"
            and config.num_attention_heads == config.num_key_value_heads
            and not model.training
        )

    _perm: torch.Tensor | None = None

    def _rotate_half_index(self, rotary: int, device: torch.device) -> torch.Tensor:
        """The gather index of ``rotate_half`` (second half, then first), built once."""
        if self._perm is None or self._perm.numel() != rotary or self._perm.device != device:
            half = rotary // 2
            self._perm = torch.cat([torch.arange(half, rotary), torch.arange(half)]).to(device)
        return self._perm

    def supports(self, model_inputs: dict[str, Any]) -> bool:
        mask = model_inputs.get("attention_mask")
        return (
            self.usable
            and model_inputs.get("pixel_values") is None  # image-to-image: generate encodes the source
            and model_inputs["input_ids"].shape[0] == 1
            and (mask is None or bool(mask.all()))
        )

    def prefill(self, model_inputs: dict[str, Any]) -> tuple[torch.Tensor, _GlmRow]:
        # What generate's first forward gets: no attention mask (all ones), positions computed inside.
        inputs = {k: v for k, v in model_inputs.items() if k != "attention_mask"}
        out = self.model(
            **inputs,
            position_ids=None,
            mm_encoder_outputs={},
            logits_to_keep=1,
            use_cache=True,
            return_dict=True,
        )
        positions = self.model.model._cached_decode_position_ids
        if positions is None:
            raise RuntimeError("GLM-Image prefill left no decode positions (no target grid in the prompt?)")
        logits = out.logits[:, -1].to(copy=True, dtype=torch.float32)
        cache = out.past_key_values
        length = cache.get_seq_length()
        capacity = length + positions.shape[-1]
        keys, values = [], []
        for layer in cache.layers:
            key = layer.keys.new_empty(*layer.keys.shape[:2], capacity, layer.keys.shape[-1])
            value = layer.values.new_empty(*layer.values.shape[:2], capacity, layer.values.shape[-1])
            key[:, :, :length] = layer.keys
            value[:, :, :length] = layer.values
            keys.append(key)
            values.append(value)
        decode_positions = positions[0].clone()  # (3, decode length)
        cos, sin = self.text.rotary_emb(logits, position_ids=decode_positions[:, None, :])
        half = cos.shape[-1] // 2
        # rotate_half(x) * sin == x[..., perm] * (sign * sin), exactly: the sign flip is exact in floats.
        sign = torch.cat([-torch.ones(half), torch.ones(half)]).to(dtype=sin.dtype, device=sin.device)
        return logits, _GlmRow(keys=keys, values=values, length=length, cos=cos[0], sin=sin[0] * sign)

    def step(self, states: list[Any], tokens: torch.Tensor, steps: list[int]) -> torch.Tensor:
        rows = cast("list[_GlmRow]", states)
        batch = len(rows)
        text = self.text
        for row in rows:
            if row.length >= row.keys[0].shape[2]:
                raise RuntimeError(f"GLM-Image decode ran past its {row.keys[0].shape[2]} cache positions")
        hidden = F.embedding(tokens[:, None], text.embed_tokens.weight)  # (B, 1, D)
        if batch == 1:
            cos, sin = rows[0].cos[steps[0]][None, None, None], rows[0].sin[steps[0]][None, None, None]
        else:
            cos = torch.stack([row.cos[step] for row, step in zip(rows, steps, strict=True)])[:, None, None]
            sin = torch.stack([row.sin[step] for row, step in zip(rows, steps, strict=True)])[:, None, None]
        rotary = cos.shape[-1]
        perm = self._rotate_half_index(rotary, tokens.device)

        def rotate(x: torch.Tensor) -> torch.Tensor:  # apply_rotary_pos_emb for one of q / k
            x_rot = x[..., :rotary]
            return torch.cat([x_rot * cos + x_rot[..., perm] * sin, x[..., rotary:]], dim=-1)

        for layer_index, layer in enumerate(text.layers):
            attn = layer.self_attn
            residual = hidden
            hidden = _rms_norm(layer.input_layernorm, hidden)
            shape = (batch, 1, -1, attn.head_dim)
            query = rotate(_linear(attn.q_proj, hidden).view(shape).transpose(1, 2))
            key = rotate(_linear(attn.k_proj, hidden).view(shape).transpose(1, 2))
            value = _linear(attn.v_proj, hidden).view(shape).transpose(1, 2)
            outputs = []
            for i, row in enumerate(rows):
                keys, values, end = row.keys[layer_index], row.values[layer_index], row.length
                keys[:, :, end] = key[i, :, 0]
                values[:, :, end] = value[i, :, 0]
                outputs.append(
                    F.scaled_dot_product_attention(
                        query[i : i + 1],
                        keys[:, :, : end + 1],
                        values[:, :, : end + 1],
                        attn_mask=None,
                        dropout_p=0.0,
                        scale=attn.scaling,
                        is_causal=False,
                    )
                )
            attended = (outputs[0] if batch == 1 else torch.cat(outputs)).transpose(1, 2).contiguous()
            hidden = _linear(attn.o_proj, attended.reshape(batch, 1, -1).contiguous())
            hidden = residual + _rms_norm(layer.post_self_attn_layernorm, hidden)
            residual = hidden
            mlp = layer.mlp
            gate, up = _linear(mlp.gate_up_proj, _rms_norm(layer.post_attention_layernorm, hidden)).chunk(
                2, dim=-1
            )
            hidden = _linear(mlp.down_proj, up * mlp.activation_fn(gate))
            hidden = residual + _rms_norm(layer.post_mlp_layernorm, hidden)
        for row in rows:
            row.length += 1
        hidden = _rms_norm(text.norm, hidden)
        return _linear(self.model.lm_head, hidden)[:, -1].to(copy=True, dtype=torch.float32)


class GlmImageARStage(TransformersARStage):
    """Stage 0: text (+ source image) -> image-code ids on transformers."""

    processor: GlmImageProcessor

    def load(self) -> None:
        from transformers import GlmImageForConditionalGeneration, GlmImageProcessor

        self.processor = GlmImageProcessor.from_pretrained(self.model_path / PROCESSOR_COMPONENT)
        self.model = (
            GlmImageForConditionalGeneration.from_pretrained(
                self.model_path / AR_COMPONENT, dtype=self.torch_dtype
            )
            .to(self.device)  # type: ignore[arg-type]  # transformers types the wrapped `to` as unbound
            .eval()
        )
        self.loaded = True

    def close(self) -> None:
        self.model = None
        self._decoder = None
        super().close()

    _decoder: GlmImageDecoder | None = None

    def fast_decoder(self) -> FastDecoder | None:
        if self.model is None:
            return None
        if self._decoder is None or self._decoder.model is not self.model:
            self._decoder = GlmImageDecoder(self.model)
        return self._decoder

    def prepare(self, job: StageJob) -> ARInputs:
        params = job.params
        height, width = int(params["height"]), int(params["width"])
        image: Image.Image | None = job.inputs.get("image")
        content: list[dict[str, Any]] = []
        if image is not None:
            content.append({"type": "image", "image": image})
        content.append({"type": "text", "text": job.inputs["prompt"]})
        conversation: list[list[dict[str, Any]]] = [[{"role": "user", "content": content}]]
        encoded = self.processor.apply_chat_template(
            conversation,
            tokenize=True,
            target_h=height,
            target_w=width,
            return_dict=True,
            return_tensors="pt",
        )
        inputs = cast("BatchFeature", encoded).to(self.device)  # return_dict=True: a BatchFeature
        layout = grid_layout(height, width, text_to_image=image is None)
        extras: dict[str, Any] = {}
        if image is not None:
            extras = self._source_image_codes(inputs)
        return ARInputs(model_inputs=dict(inputs), max_new_tokens=layout.max_new_tokens, extra_outputs=extras)

    @torch.inference_mode()
    def _source_image_codes(self, inputs: Any) -> dict[str, Any]:
        """The source image's VQ codes at 1/32 scale (grid rows before the target grid)."""
        grids = inputs["image_grid_thw"]
        source_grids = grids[:-1]  # I2I: [source..., target]
        features = self.model.get_image_features(inputs["pixel_values"], source_grids).pooler_output
        codes = self.model.get_image_tokens(list(features), source_grids)
        return {"prior_image": codes.reshape(-1).cpu(), "prior_image_grid_thw": source_grids.cpu()}
