"""GLM-Image stage 0 on transformers: text (+ source image) -> image-code ids (and the source's codes)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.nn.functional as F
from PIL import Image
from transformers.models.glm_image.modeling_glm_image import apply_rotary_pos_emb

from engine.processors import grid_layout
from engine.stages.ar_transformers import ARInputs, FastDecoder, TransformersARStage
from engine.stages.base import StageJob

if TYPE_CHECKING:
    from transformers import BatchFeature, GlmImageProcessor

AR_COMPONENT = "vision_language_encoder"
PROCESSOR_COMPONENT = "processor"


@dataclass
class _GlmRow:
    """One request's decode state: its own KV cache and the grid positions of the tokens it generates."""

    cache: Any
    positions: torch.Tensor  # (3, decode length): (t, h, w) of generated token k at [:, k]


def _linear(module: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """``module(x)`` for x of shape (B, 1, K), each row bit-identical to ``module(x[i : i + 1])``.

    One (B, K) matrix product takes a different CPU kernel than B products of one row (the last bits
    differ, docs/batching.md); a batched product of B single-row products (``bmm``) takes the same one.
    """
    if x.shape[0] == 1:
        return module(x)
    out = torch.bmm(x, module.weight.t().expand(x.shape[0], -1, -1))
    return out if module.bias is None else out + module.bias


class GlmImageDecoder:
    """The lean decode step for ``GlmImageForConditionalGeneration`` (text-to-image prompts).

    Prefill is the model's own forward (it computes the M-RoPE positions of the prompt and of every token
    still to come, from the ``<sop>h w<eop>`` grids); decoding then runs the text decoder's layers with
    those positions. Everything row-wise (embedding, norms, projections, rotary, MLP, LM head) runs for the
    whole batch at once (matrix products as ``bmm`` of single rows, see :func:`_linear`); attention runs per
    row on the row's own cache, with the same shapes as alone, so no row's logits depend on its neighbours
    (no padding, no masks). This mirrors
    ``GlmImageTextDecoderLayer.forward`` op for op; ``tests/test_ar_decode.py`` checks the ids against
    ``generate`` and ``tests/test_batch_invariance.py`` alone against batched.
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
        return logits, _GlmRow(cache=out.past_key_values, positions=positions[0].clone())

    def step(self, states: list[Any], tokens: torch.Tensor, steps: list[int]) -> torch.Tensor:
        rows = cast("list[_GlmRow]", states)
        batch = len(rows)
        text = self.text
        hidden = text.embed_tokens(tokens[:, None])  # (B, 1, D)
        position_ids = torch.stack(
            [row.positions[:, step] for row, step in zip(rows, steps, strict=True)], dim=1
        )
        cos, sin = text.rotary_emb(hidden, position_ids=position_ids[..., None])  # positions (3, B, 1)
        for layer in text.layers:
            attn = layer.self_attn
            residual = hidden
            hidden = layer.input_layernorm(hidden)
            shape = (batch, 1, -1, attn.head_dim)
            query = _linear(attn.q_proj, hidden).view(shape).transpose(1, 2)
            key = _linear(attn.k_proj, hidden).view(shape).transpose(1, 2)
            value = _linear(attn.v_proj, hidden).view(shape).transpose(1, 2)
            query, key = apply_rotary_pos_emb(query, key, cos, sin)
            outputs = []
            for i, row in enumerate(rows):
                keys, values = row.cache.update(key[i : i + 1], value[i : i + 1], attn.layer_idx)
                outputs.append(
                    F.scaled_dot_product_attention(
                        query[i : i + 1],
                        keys,
                        values,
                        attn_mask=None,
                        dropout_p=0.0,
                        scale=attn.scaling,
                        is_causal=False,
                    )
                )
            attended = (outputs[0] if batch == 1 else torch.cat(outputs)).transpose(1, 2).contiguous()
            hidden = _linear(attn.o_proj, attended.reshape(batch, 1, -1).contiguous())
            hidden = residual + layer.post_self_attn_layernorm(hidden)
            residual = hidden
            mlp = layer.mlp
            gate, up = _linear(mlp.gate_up_proj, layer.post_attention_layernorm(hidden)).chunk(2, dim=-1)
            hidden = _linear(mlp.down_proj, up * mlp.activation_fn(gate))
            hidden = residual + layer.post_mlp_layernorm(hidden)
        hidden = text.norm(hidden)
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
