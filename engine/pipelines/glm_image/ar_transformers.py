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
from engine.stages.decode_slabs import SlabRow, bucket_length
from engine.stages.row_plan import RowPadding, RowWise, padded_length
from engine.stages.slab_decoder import SlabDecoder, activation_kernel, joined_product

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
        width = attn.o_proj.weight.shape[0]
        act = activation_kernel(mlp.activation_fn)

        def activation(x: torch.Tensor) -> torch.Tensor:
            gate, up = x.chunk(2, dim=-1)
            return up * act(gate)

        def norm(name: str, module: Any) -> RowWise:
            return RowWise(name, _norm_of(module), width, module.weight.dtype, device=module.weight.device)

        gate_up = mlp.gate_up_proj
        return cls(
            input_norm=norm("input_norm", layer.input_layernorm),
            qkv=joined_product("qkv", [attn.q_proj, attn.k_proj, attn.v_proj]),
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


class GlmImageDecoder(SlabDecoder[_LayerPlan]):
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
        super().__init__(model.model.language_model, max_rows)
        self.model = model
        config = self.text.config
        self.usable = (
            config._attn_implementation == "sdpa"
            and config.num_attention_heads % config.num_key_value_heads == 0
            and not model.training
        )
        # Per layer: q, k and v in one product, norms and weights without module lookups.
        self.layers = [_LayerPlan.of(layer) for layer in self.text.layers]
        norm = self.text.norm
        self.final_norm = RowWise(
            "final_norm", _norm_of(norm), config.hidden_size, norm.weight.dtype, device=norm.weight.device
        )
        self.lm_head = RowWise.product("lm_head", model.lm_head.weight, model.lm_head.bias)
        self.padding = RowPadding()

    def supports(self, model_inputs: dict[str, Any]) -> bool:
        mask = model_inputs.get("attention_mask")
        return (
            self.usable
            and model_inputs.get("pixel_values") is None  # image-to-image: generate encodes the source
            and model_inputs["input_ids"].shape[0] == 1
            and (mask is None or bool(mask.all()))
        )

    def checked_functions(self) -> list[RowWise]:
        return [self.final_norm, self.lm_head]

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
        self.release_row(cast(SlabRow, state))

    def step(self, states: list[Any], tokens: torch.Tensor, steps: list[int]) -> torch.Tensor:
        tile = self.plan_rows().tile
        step = self.open_step(cast("list[SlabRow]", states), steps, tokens.device)
        rows, rotate, attend = step.rows, step.rotate, step.attend
        tokens = step.in_slab_order(tokens)
        batch = len(rows)
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
        return step.in_caller_order(logits)


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
