"""GLM-Image stage 0 on transformers: text (+ source image) -> image-code ids (and the source's codes)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.nn.functional as F
from PIL import Image

from engine.processors import grid_layout
from engine.stages.ar_transformers import ARInputs, FastDecoder, TransformersARStage
from engine.stages.base import StageJob
from engine.stages.decode_slabs import KVSlab, SlabRow, bucket_length, slots_independent
from engine.stages.row_plan import RowPadding, RowPlan, RowWise, padded_length

if TYPE_CHECKING:
    from transformers import BatchFeature, GlmImageProcessor

AR_COMPONENT = "vision_language_encoder"
PROCESSOR_COMPONENT = "processor"


def _norm_of(norm: Any) -> Callable[[torch.Tensor], torch.Tensor]:
    """``norm``'s forward as a plain function of float32 rows (``torch.rms_norm``, what ``F.rms_norm``
    calls: the same ops as ``GlmImageRMSNorm``, bit-identical in float32) or, for other dtypes,
    :func:`_rms_norm`."""
    weight = norm.weight
    if weight.dtype == torch.float32:
        shape, eps = list(weight.shape), norm.variance_epsilon
        return lambda x: torch.rms_norm(x, shape, weight, eps)
    return partial(_rms_norm, norm)


def _activation_of(module: Any) -> Callable[[torch.Tensor], torch.Tensor]:
    """The MLP's activation as the kernel it calls (SiLU, whose module calls ``F.silu``: that function's
    own kernel call, without the module's and the function's Python layers), else the module itself."""
    kind = type(module)
    silu = kind is torch.nn.SiLU or (
        kind.__name__ == "SiLUActivation" and kind.__module__ == "transformers.activations"
    )
    return cast("Callable[[torch.Tensor], torch.Tensor]", torch._C._nn.silu if silu else module)


@dataclass(frozen=True)
class _LayerPlan:
    """One text decoder layer's row-wise functions as the step calls them (no module lookups per token;
    engine/stages/row_plan.py runs each on fixed tiles of rows)."""

    input_norm: RowWise
    qkv: RowWise  # q, k and v concatenated: one product
    scaling: float
    o_proj: RowWise
    post_self_attn_norm: RowWise
    post_attention_norm: RowWise
    gate_up: RowWise
    activation: RowWise  # (rows, 2 x intermediate) -> (rows, intermediate): up * act(gate)
    down: RowWise
    post_mlp_norm: RowWise

    @classmethod
    def of(cls, layer: Any) -> _LayerPlan:
        attn, mlp = layer.self_attn, layer.mlp
        projections = [attn.q_proj, attn.k_proj, attn.v_proj]
        biases = [p.bias for p in projections]
        qkv_bias = None if any(b is None for b in biases) else torch.cat(cast("list[torch.Tensor]", biases))
        width = attn.o_proj.weight.shape[0]
        act = _activation_of(mlp.activation_fn)

        def activation(x: torch.Tensor) -> torch.Tensor:
            gate, up = x.chunk(2, dim=-1)
            return up * act(gate)

        def norm(name: str, module: Any) -> RowWise:
            return RowWise(name, _norm_of(module), width, module.weight.dtype, device=module.weight.device)

        gate_up = mlp.gate_up_proj
        return cls(
            input_norm=norm("input_norm", layer.input_layernorm),
            qkv=RowWise.product("qkv", torch.cat([p.weight for p in projections]), qkv_bias),
            scaling=attn.scaling,
            o_proj=RowWise.product("o_proj", attn.o_proj.weight, attn.o_proj.bias),
            post_self_attn_norm=norm("post_self_attn_norm", layer.post_self_attn_layernorm),
            post_attention_norm=norm("post_attention_norm", layer.post_attention_layernorm),
            gate_up=RowWise.product("gate_up", gate_up.weight, gate_up.bias),
            activation=RowWise(
                "activation",
                activation,
                gate_up.weight.shape[0],
                gate_up.weight.dtype,
                device=gate_up.weight.device,
            ),
            down=RowWise.product("down", mlp.down_proj.weight, mlp.down_proj.bias),
            post_mlp_norm=norm("post_mlp_norm", layer.post_mlp_layernorm),
        )

    def functions(self) -> list[RowWise]:
        """The layer's row-wise functions, in field order."""
        return [value for f in fields(self) if isinstance(value := getattr(self, f.name), RowWise)]


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
    still to come, from the ``<sop>h w<eop>`` grids); its cache moves into a :class:`KVSlab` slot and the
    rotary tables of every position to come are computed once. Decoding then runs the text decoder's layers
    with plain functional calls, one call per operation for the whole batch: the row-wise functions on
    fixed tiles of rows (engine/stages/row_plan.py, with guarded fallbacks where the machine's kernels
    fail their check), attention once per slab over the slab's live rows (engine/stages/decode_slabs.py);
    each row still gets exactly its alone bits. This mirrors ``GlmImageTextDecoderLayer.forward``
    op for op; ``tests/test_ar_decode.py`` checks the ids against ``generate`` and
    ``tests/test_batch_invariance.py`` alone against batched.
    """

    def __init__(self, model: Any, max_rows: int = 8) -> None:
        self.model = model
        self.text = model.model.language_model
        self.max_rows = max(1, max_rows)
        config = self.text.config
        self.usable = (
            config._attn_implementation == "sdpa"
            and config.num_attention_heads % config.num_key_value_heads == 0
            and not model.training
        )
        self.slabs: dict[int, KVSlab] = {}
        # How the row-wise functions run on this machine: chosen by checks on the decode thread (its
        # thread count picks kernels) at the first step.
        self.row_plan: RowPlan | None = None
        self._slots_checked: dict[tuple[int, int, int], bool] = {}  # slots_independent per cache shape
        # Per layer: q, k and v in one product, norms and weights without module lookups.
        self.layers = [_LayerPlan.of(layer) for layer in self.text.layers]
        norm = self.text.norm
        self.final_norm = RowWise(
            "final_norm", _norm_of(norm), config.hidden_size, norm.weight.dtype, device=norm.weight.device
        )
        self.lm_head = RowWise.product("lm_head", model.lm_head.weight, model.lm_head.bias)
        self.padding = RowPadding()

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

    def plan_rows(self) -> RowPlan:
        """The row plan, chosen on first use by checks of layer 0's functions (every layer has the same
        shapes), the final norm and the LM head, then given to every layer."""
        if self.row_plan is None:
            first, *rest = self.layers
            plan = RowPlan.choose([*first.functions(), self.final_norm, self.lm_head], self.max_rows)
            for layer in rest:
                plan.apply(layer.functions())
            self.row_plan = plan
        return self.row_plan

    @property
    def decode_path(self) -> str:
        """How a step batches on this machine, in words (the System tab, ``/metrics``)."""
        if self.row_plan is None:
            return "batched (its kernel checks run at the first decode step)"
        text = self.row_plan.describe()
        if any(not ok for ok in self._slots_checked.values()):
            text += "; attention slot by slot"
        return text

    def _slab(self, length: int, rotary: int, like: torch.Tensor) -> KVSlab:
        slab = self.slabs.get(length)
        if slab is None:
            config = self.text.config
            kv_heads, head_dim = like.shape[1], like.shape[-1]
            slab = KVSlab.allocate(
                config.num_hidden_layers, kv_heads, head_dim, length, rotary, like.dtype, like.device
            )
            shape = (length, kv_heads, head_dim)
            if shape not in self._slots_checked:
                self._slots_checked[shape] = slots_independent(
                    slab, config.num_attention_heads, head_dim, self.max_rows
                )
            slab.per_slot = not self._slots_checked[shape]
            self.slabs[length] = slab
        return slab

    def prefill(self, model_inputs: dict[str, Any]) -> tuple[torch.Tensor, SlabRow]:
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
        filled = cache.get_seq_length()
        decode_positions = positions[0].clone()  # (3, decode length)
        cos, sin = self.text.rotary_emb(logits, position_ids=decode_positions[:, None, :])
        half = cos.shape[-1] // 2
        # rotate_half(x) * sin == x[..., perm] * (sign * sin), exactly: the sign flip is exact in floats.
        sign = torch.cat([-torch.ones(half), torch.ones(half)]).to(dtype=sin.dtype, device=sin.device)
        keys = [layer.keys for layer in cache.layers]
        slab = self._slab(bucket_length(filled + decode_positions.shape[-1]), cos.shape[-1], keys[0])
        row = slab.add(keys, [layer.values for layer in cache.layers], cos[0], sin[0] * sign)
        return logits, row

    def release(self, state: Any) -> None:
        row = cast(SlabRow, state)
        slab = row.slab
        if slab is None:
            return
        slab.remove(row)
        if not slab.rows:  # memory goes back when a slab's last row leaves
            self.slabs.pop(slab.length, None)

    def step(self, states: list[Any], tokens: torch.Tensor, steps: list[int]) -> torch.Tensor:
        tile = self.plan_rows().tile
        rows = cast("list[SlabRow]", states)
        for row in rows:
            if row.slab is None or row.length >= row.slab.length:
                raise RuntimeError("GLM-Image decode ran past its cache (or a released row was stepped)")
        # Rows grouped by slab, each group in slot order; ``order`` maps the step's rows to the caller's.
        identity = True
        if len(rows) > 1:
            groups: dict[int, list[int]] = {}
            for i, row in enumerate(rows):
                groups.setdefault(id(row.slab), []).append(i)
            order = [i for members in groups.values() for i in sorted(members, key=lambda i: rows[i].slot)]
            identity = order == list(range(len(rows)))
            if not identity:
                tokens = tokens[torch.tensor(order, device=tokens.device)]
                rows, steps = [rows[i] for i in order], [steps[i] for i in order]
        batch = len(rows)
        device = tokens.device
        spans: list[tuple[KVSlab, int, int, torch.Tensor | int, torch.Tensor | int, bool]] = []
        cos_parts, sin_parts = [], []  # each (rows, 1, 1, rotary)
        start = 0
        while start < batch:
            slab = cast(KVSlab, rows[start].slab)
            end = start
            while end < batch and rows[end].slab is slab:
                end += 1
            members = rows[start:end]
            slots: torch.Tensor | int
            positions: torch.Tensor | int
            if len(members) == 1:  # plain ints: basic indexing, the same values with cheaper calls
                slots, positions, at = members[0].slot, members[0].length, steps[start]
                cos_parts.append(slab.cos[slots : slots + 1, at : at + 1, None])
                sin_parts.append(slab.sin[slots : slots + 1, at : at + 1, None])
            else:
                slots = torch.tensor([r.slot for r in members], device=device)
                positions = torch.tensor([r.length for r in members], device=device)
                index = torch.tensor(steps[start:end], device=device)
                cos_parts.append(slab.cos[slots, index][:, None, None])
                sin_parts.append(slab.sin[slots, index][:, None, None])
            prefix = len(members) == len(slab.rows)  # every live row, in slot order: slots 0..n-1
            slab.open(slots, positions)
            spans.append((slab, start, end, slots, positions, prefix))
            start = end
        cos = cos_parts[0] if len(cos_parts) == 1 else torch.cat(cos_parts)
        sin = sin_parts[0] if len(sin_parts) == 1 else torch.cat(sin_parts)
        rotary = cos.shape[-1]
        perm = self._rotate_half_index(rotary, device)

        def rotate(x: torch.Tensor) -> torch.Tensor:  # apply_rotary_pos_emb for q and k: (B, 2H, 1, D)
            if rotary == x.shape[-1]:
                return x * cos + x[..., perm] * sin
            x_rot = x[..., :rotary]
            return torch.cat([x_rot * cos + x_rot[..., perm] * sin, x[..., rotary:]], dim=-1)

        def attend(
            layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float
        ) -> torch.Tensor:
            if len(spans) == 1:  # the usual step: one slab, no per-span slicing
                slab, _, _, slots, positions, prefix = spans[0]
                return slab.attend(layer, slots, positions, query, key, value, scale, prefix)
            return torch.cat(
                [
                    slab.attend(layer, slots, positions, query[a:b], key[a:b], value[a:b], scale, prefix)
                    for slab, a, b, slots, positions, prefix in spans
                ]
            )

        # Every row-wise function runs on ``width`` rows: the batch padded to whole tiles of the row plan
        # (row_plan.py says why); the per-row work (rotation, attention) on the batch's rows only. Tensors
        # are (rows, heads, 1, head_dim) from the qkv product on: the layout attention takes, without a
        # reshape per call.
        width = padded_length(batch, tile)
        pad = self.padding
        text = self.text
        heads, kv_heads = text.config.num_attention_heads, text.config.num_key_value_heads
        qkv_heads, qk_heads = heads + 2 * kv_heads, heads + kv_heads
        hidden = F.embedding(pad(tokens, width), text.embed_tokens.weight)  # (width, D)
        for layer_index, plan in enumerate(self.layers):
            residual = hidden
            qkv = plan.qkv(plan.input_norm(hidden, batch), batch).view(width, qkv_heads, 1, -1)
            qk, value = (qkv if batch == width else qkv[:batch]).split((qk_heads, kv_heads), dim=1)
            query, key = rotate(qk).split((heads, kv_heads), dim=1)  # q and k heads rotated together
            attended = attend(layer_index, query, key, value, plan.scaling)
            hidden = plan.o_proj(pad(attended.reshape(batch, -1), width), batch)
            hidden = residual + plan.post_self_attn_norm(hidden, batch)
            residual = hidden
            gate_up = plan.gate_up(plan.post_attention_norm(hidden, batch), batch)
            hidden = plan.down(plan.activation(gate_up, batch), batch)
            hidden = residual + plan.post_mlp_norm(hidden, batch)
        for row in rows:
            row.length += 1
        logits = self.lm_head(self.final_norm(hidden, batch), batch)
        logits = logits[:batch] if batch < width else logits
        if logits.dtype != torch.float32:
            logits = logits.float()
        if identity:
            return logits
        restored = torch.empty_like(logits)
        restored[torch.tensor(order, device=device)] = logits
        return restored


def load_processor(path: Path) -> GlmImageProcessor:
    """``GlmImageProcessor.from_pretrained(path)``, without importing mistral_common.

    transformers 5.19's ``ProcessorMixin.__init__`` checks the tokenizer against a pair of classes and
    resolves both, the second being ``MistralCommonBackend``: where mistral_common is installed (vLLM
    depends on it) that imports it, jsonschema and OpenCV, ~0.5 s of every start. A tokenizer that is a
    ``PreTrainedTokenizerBase`` passes that check whatever the second class is, so it is answered without
    resolving it; anything else still goes through transformers' own check.
    """
    from transformers import GlmImageProcessor, PreTrainedTokenizerBase

    class Processor(GlmImageProcessor):
        def check_argument_for_proper_class(self, argument_name: str, argument: Any) -> Any:
            if isinstance(argument, PreTrainedTokenizerBase):
                return type(argument)
            return super().check_argument_for_proper_class(argument_name, argument)

    Processor.__name__ = Processor.__qualname__ = GlmImageProcessor.__name__
    return Processor.from_pretrained(path)


class GlmImageARStage(TransformersARStage):
    """Stage 0: text (+ source image) -> image-code ids on transformers."""

    processor: GlmImageProcessor

    def load(self) -> None:
        from transformers import GlmImageForConditionalGeneration

        self.processor = load_processor(self.model_path / PROCESSOR_COMPONENT)
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
            self._decoder = GlmImageDecoder(self.model, self.max_batch_size)
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
