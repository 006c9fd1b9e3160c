"""The lean decode step shared by Qwen2.5-Omni's thinker and talker: their decoder layers op for op.

Both text models stack ``Qwen2_5OmniDecoderLayer`` (M-RoPE attention on an all-ones mask, an RMSNorm,
SiLU MLP) under a final norm and a head. :class:`OmniSlabDecoder` runs them for many rows at once as
``GlmImageDecoder`` does for GLM-Image (docs/batching.md, "The lean AR decode loop"): the row-wise
functions (q/k/v, output and MLP products, norms, activation, head) on fixed tiles of rows through
:class:`RowPlan` with its guarded fallbacks, attention once per :class:`KVSlab`. So a row's float math
never depends on the rows beside it. The talker (talker_decoder.py) and the thinker (thinker_decoder.py)
add what feeds the layers (their step input, their prefill).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any

import torch

from engine.stages.decode_slabs import SlabRow, bucket_length
from engine.stages.row_plan import RowPadding, RowWise, padded_length, padded_rows
from engine.stages.slab_decoder import SlabDecoder, activation_kernel, joined_product


def _norm_of(norm: Any) -> Callable[[torch.Tensor], torch.Tensor]:
    """``Qwen2_5OmniRMSNorm.forward`` on float32 rows as ``torch.rms_norm`` (the same ops, bit-identical
    in float32; the decoder runs float32 models only)."""
    shape, weight, eps = list(norm.weight.shape), norm.weight, norm.variance_epsilon
    return lambda x: torch.rms_norm(x, shape, weight, eps)


@dataclass(frozen=True)
class _LayerPlan:
    """One Qwen2.5-Omni decoder layer's row-wise functions (engine/stages/row_plan.py runs each on tiles)."""

    input_norm: RowWise
    qkv: RowWise  # q, k and v concatenated: one product
    scaling: float
    o_proj: RowWise
    post_attention_norm: RowWise
    gate_up: RowWise  # gate and up concatenated: one product
    activation: RowWise  # (rows, 2 x intermediate) -> (rows, intermediate): act(gate) * up
    down: RowWise

    @classmethod
    def of(cls, layer: Any) -> _LayerPlan:
        attn, mlp = layer.self_attn, layer.mlp
        width = attn.o_proj.weight.shape[0]
        act = activation_kernel(mlp.act_fn)

        def activation(x: torch.Tensor) -> torch.Tensor:
            gate, up = x.chunk(2, dim=-1)
            return act(gate) * up

        def norm(name: str, module: Any) -> RowWise:
            return RowWise(name, _norm_of(module), width, module.weight.dtype, device=module.weight.device)

        return cls(
            input_norm=norm("input_norm", layer.input_layernorm),
            qkv=joined_product("qkv", [attn.q_proj, attn.k_proj, attn.v_proj]),
            scaling=attn.scaling,
            o_proj=RowWise.product("o_proj", attn.o_proj.weight, attn.o_proj.bias),
            post_attention_norm=norm("post_attention_norm", layer.post_attention_layernorm),
            gate_up=joined_product("gate_up", [mlp.gate_proj, mlp.up_proj]),
            activation=RowWise(
                "activation",
                activation,
                2 * mlp.gate_proj.weight.shape[0],
                mlp.gate_proj.weight.dtype,
                device=mlp.gate_proj.weight.device,
            ),
            down=RowWise.product("down", mlp.down_proj.weight, mlp.down_proj.bias),
        )

    def functions(self) -> list[RowWise]:
        return [value for f in fields(self) if isinstance(value := getattr(self, f.name), RowWise)]


class OmniSlabDecoder(SlabDecoder[_LayerPlan]):
    """The decoder layers, final norm and head of a Qwen2.5-Omni text model (float32 on a CPU), many rows
    per call. ``text``: the model holding ``layers``, ``norm``, ``rotary_emb``; ``head``: the linear head."""

    def __init__(self, model: Any, text: Any, head: Any, head_name: str, max_rows: int = 8) -> None:
        super().__init__(text, max_rows)
        self.model = model
        config = text.config
        weight = head.weight
        self.usable = (
            config._attn_implementation == "sdpa"
            and config.num_attention_heads % config.num_key_value_heads == 0
            and not getattr(config, "use_sliding_window", False)
            and all(kind == "full_attention" for kind in config.layer_types)
            and weight.device.type == "cpu"
            and weight.dtype == torch.float32
            and not model.training
        )
        # Per layer: q, k and v in one product, gate and up in another (copies of those weights: made only
        # where the decoder runs).
        self.layers = [_LayerPlan.of(layer) for layer in text.layers] if self.usable else []
        norm = text.norm
        self.final_norm = RowWise(
            "final_norm", _norm_of(norm), config.hidden_size, norm.weight.dtype, device=norm.weight.device
        )
        self.head = RowWise.product(head_name, weight, head.bias)
        self.padding = RowPadding()

    def extra_functions(self) -> list[RowWise]:
        """Row-wise functions besides the layers', the final norm and the head (checked with them)."""
        return []

    def checked_functions(self) -> list[RowWise]:
        return [self.final_norm, self.head, *self.extra_functions()]

    def add_row(self, cache: Any, steps: int, like: torch.Tensor, delta: int = 0) -> SlabRow:
        """A prefilled row's cache (a ``DynamicCache``) moved into a slab slot with room for ``steps``
        tokens, and the rotary tables of those tokens computed once: position ``cache length + delta`` on
        all three M-RoPE axes (``delta``: the prompt's ``rope_deltas``)."""
        filled = cache.get_seq_length()
        start = filled + delta
        positions = (torch.arange(steps, device=like.device) + start).view(1, 1, -1).expand(3, 1, -1)
        cos, sin = self.text.rotary_emb(like, position_ids=positions)  # (1, steps, rotary) on each axis
        half = cos.shape[-1] // 2
        # rotate_half(x) * sin == x[..., perm] * (sign * sin), exactly: the sign flip is exact in floats.
        sign = torch.cat([-torch.ones(half), torch.ones(half)]).to(dtype=sin.dtype, device=sin.device)
        keys = [layer.keys for layer in cache.layers]
        slab = self._slab(bucket_length(filled + steps), cos.shape[-1], keys[0])
        return slab.add(keys, [layer.values for layer in cache.layers], cos[0], sin[0] * sign)

    def run_rows(
        self,
        rows: list[SlabRow],
        embedded: torch.Tensor,
        steps: list[int],
        project: RowWise | None = None,
        keep_hidden: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One token for each row: ``embedded`` (B, E), its step input, through ``project`` (if any), the
        layers, the final norm and the head. Returns float32 logits (B, V) and, with ``keep_hidden``, the
        final norm's output (B, H) (what ``hidden_states[-1]`` holds), both in the caller's row order."""
        tile = self.plan_rows().tile
        step = self.open_step(rows, steps, embedded.device)
        rows, rotate, attend = step.rows, step.rotate, step.attend
        embedded = step.in_slab_order(embedded)
        batch = len(rows)
        # Row-wise functions on ``width`` rows (the batch padded to whole tiles); rotation and attention
        # on the batch's rows only; (rows, heads, 1, head_dim) from the qkv product on.
        width = padded_length(batch, tile)
        pad = self.padding
        config = self.text.config
        heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
        qkv_heads, qk_heads = heads + 2 * kv_heads, heads + kv_heads
        # Without a projection the step input is the residual stream itself: a fresh copy, not ``pad``'s
        # kept buffer (the attention output reuses that buffer below).
        hidden = padded_rows(embedded, width) if project is None else project(pad(embedded, width), batch)
        for layer_index, plan in enumerate(self.layers):
            residual = hidden
            qkv = plan.qkv(plan.input_norm(hidden, batch), batch).view(width, qkv_heads, 1, -1)
            qk, value = (qkv if batch == width else qkv[:batch]).split((qk_heads, kv_heads), dim=1)
            query, key = rotate(qk).split((heads, kv_heads), dim=1)
            attended = attend(layer_index, query, key, value, plan.scaling)
            hidden = residual + plan.o_proj(pad(attended.reshape(batch, -1), width), batch)
            residual = hidden
            hidden = plan.down(
                plan.activation(plan.gate_up(plan.post_attention_norm(hidden, batch), batch), batch), batch
            )
            hidden = residual + hidden
        for row in rows:
            row.length += 1
        normed = self.final_norm(hidden, batch)
        logits = self.head(normed, batch)
        logits = logits[:batch] if batch < width else logits
        if logits.dtype != torch.float32:
            logits = logits.float()
        kept = (normed[:batch] if batch < width else normed) if keep_hidden else None
        return step.in_caller_order(logits), None if kept is None else step.in_caller_order(kept)
