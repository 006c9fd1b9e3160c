"""GLM-Image's AR model (``GlmImageForConditionalGeneration``'s text decoder) as a vLLM model.

It loads the same HF-format ``vision_language_encoder`` folder as transformers. The decoder has the layer
layout of vLLM's GLM-4 (q/k/v with bias, o without, four RMSNorms per layer, fused gate_up MLP), so it
reuses those layers, with GLM-Image's differences (see ``shared/FACTS.md``):

* RoPE is NeoX style (rotate-half) with contiguous t/h/w M-RoPE sections; ``partial_rotary_factor``
  defaults to 1.0 (GLM-4's default is 0.5).
* The LM head has ``vision_vocab_size`` rows (image codes only). Logits are padded to the full vocabulary
  with -inf, because vLLM's samplers and logits processors index by token id (e.g. ``min_tokens`` by EOS).
* Generated tokens get 2-D grid positions -- the preview grid (T2I), then the target grid, each token at
  ``(p0, p0 + row, p0 + col)`` -- not ``context_len + delta``. vLLM gives decode tokens 1-D positions
  ``delta + context_len``, so :meth:`get_mrope_input_positions` writes the request's decode positions
  into a ring-buffer table and returns a delta that makes decode token ``k`` ask for position
  ``DECODE_POSITION_BASE + offset + k``; :meth:`forward` swaps such positions for the table's entries.
  The table is a fixed-size buffer and the swap a gather + ``where``, so it stays graph-capturable.

The target grids come from the prompt itself (``<sop>h w<eop>`` before the final image-start token), so
vLLM's own ``LLM.generate`` runs this model without our stage runner. Source images (I2I) are encoded by
the caller (the transformers vision tower + VQ codes, substituted for the ``<|image|>`` placeholders);
their grid shapes are not in the prompt, so the caller registers them first through
:class:`GlmImageWorkerExtension` (``collective_rpc("register_glm_image_source_grids", ...)``).
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn
from vllm.compilation.decorators import support_torch_compile
from vllm.config import VllmConfig
from vllm.distributed import get_pp_group
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.layers.rotary_embedding import get_rope
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead
from vllm.model_executor.models.glm4 import Glm4DecoderLayer
from vllm.model_executor.models.interfaces import SupportsMRoPE, SupportsPP
from vllm.model_executor.models.llama import LlamaModel
from vllm.model_executor.models.utils import AutoWeightsLoader, PPMissingLayer, WeightsMapper, maybe_prefix
from vllm.sequence import IntermediateTensors

# Decode positions at or above this value are looked up in the decode-position table. vLLM keeps
# context lengths in int32, so BASE + table size stays below 2**31.
DECODE_POSITION_BASE = 1 << 30
MIN_TABLE_SIZE = 1 << 20
MAX_TABLE_SIZE = 1 << 28
# Extra end-marker entries after each request's grids (transformers pads decode positions the same way).
DECODE_SLACK = 8

GRID_BOS, GRID_EOS = "<sop>", "<eop>"

# Source-image grids registered by the caller, keyed by the prompt's token ids (process-wide: the worker
# extension that fills it and the model that reads it live in the same worker process).
_SOURCE_GRIDS: OrderedDict[bytes, list[tuple[int, int, int]]] = OrderedDict()
_SOURCE_GRIDS_LOCK = threading.Lock()
_SOURCE_GRIDS_LIMIT = 4096


def source_grid_key(prompt_token_ids: Iterable[int]) -> bytes:
    """A digest of the prompt ids (I2I prompts hold thousands of source codes; keep 16 bytes, not them)."""
    ids = torch.tensor([int(t) for t in prompt_token_ids], dtype=torch.int64)
    return hashlib.blake2b(ids.numpy().tobytes(), digest_size=16).digest()


def _grid(values: Sequence[int]) -> tuple[int, int, int]:
    t, h, w = (int(x) for x in values)
    return t, h, w


def register_source_grids(prompt_token_ids: Iterable[int], grids: Iterable[Sequence[int]]) -> None:
    """Remember the (t, h, w) grids of the source images in this prompt (I2I)."""
    with _SOURCE_GRIDS_LOCK:
        key = source_grid_key(prompt_token_ids)
        _SOURCE_GRIDS[key] = [_grid(g) for g in grids]
        _SOURCE_GRIDS.move_to_end(key)
        while len(_SOURCE_GRIDS) > _SOURCE_GRIDS_LIMIT:
            _SOURCE_GRIDS.popitem(last=False)


def lookup_source_grids(prompt_token_ids: Iterable[int]) -> list[tuple[int, int, int]] | None:
    with _SOURCE_GRIDS_LOCK:
        return _SOURCE_GRIDS.get(source_grid_key(prompt_token_ids))


class GlmImageWorkerExtension:
    """Mixed into vLLM's worker (``worker_extension_cls``): lets the caller pass I2I source grids."""

    def register_glm_image_source_grids(self, prompt_token_ids: list[int], grids: list[list[int]]) -> bool:
        register_source_grids(prompt_token_ids, grids)
        return True


class GlmImageDecoderLayer(Glm4DecoderLayer):
    """GLM-4's decoder layer with GLM-Image's RoPE: NeoX style, full rotary dimension by default."""

    def __init__(self, vllm_config: VllmConfig, prefix: str = "", config: Any = None) -> None:
        config = config or vllm_config.model_config.hf_config
        super().__init__(vllm_config=vllm_config, prefix=prefix, config=config)
        attn = self.self_attn
        self.self_attn.rotary_emb = get_rope(
            attn.head_dim,
            max_position=config.max_position_embeddings,
            rope_parameters=config.rope_parameters,
            is_neox_style=True,
        )


@support_torch_compile(
    dynamic_arg_dims={"input_ids": 0, "positions": -1, "intermediate_tensors": 0, "inputs_embeds": 0}
)
class GlmImageTextModel(LlamaModel):
    """GLM-4's decoder stack (as vLLM's ``Glm4Model``) built from :class:`GlmImageDecoderLayer`."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__(vllm_config=vllm_config, prefix=prefix, layer_type=GlmImageDecoderLayer)


def _text_config(hf_config: Any) -> Any:
    """GLM-Image's text config with the defaults vLLM's GLM-4 code would otherwise get wrong."""
    text = hf_config.text_config if hasattr(hf_config, "text_config") else hf_config
    rope = dict(getattr(text, "rope_parameters", None) or {})
    rope.setdefault("rope_type", "default")
    rope.setdefault("partial_rotary_factor", 1.0)
    if "rope_theta" not in rope and getattr(text, "rope_theta", None) is not None:
        rope["rope_theta"] = text.rope_theta
    text.rope_parameters = rope
    if getattr(text, "tie_word_embeddings", None) is None:
        text.tie_word_embeddings = False
    text.attention_bias = getattr(text, "attention_bias", True)
    if getattr(text, "architectures", None) is None:
        text.architectures = ["GlmImageForConditionalGeneration"]
    return text


def _load_tokenizer(vllm_config: VllmConfig) -> Any:
    """The tokenizer (for the grid markers): the configured one, else the checkpoint's ``processor/``."""
    from transformers import AutoTokenizer

    model_config = vllm_config.model_config
    candidates = [model_config.tokenizer, model_config.model]
    candidates.append(str(Path(model_config.model).parent / "processor"))
    errors = []
    for path in dict.fromkeys(c for c in candidates if c):
        try:
            tokenizer = AutoTokenizer.from_pretrained(path)
        except Exception as exc:  # try the next place
            errors.append(f"{path}: {exc}")
            continue
        vocab = tokenizer.get_vocab()
        if GRID_BOS in vocab and GRID_EOS in vocab:
            return tokenizer
        errors.append(f"{path}: no {GRID_BOS}/{GRID_EOS} tokens")
    raise RuntimeError(
        "GLM-Image on vLLM needs the processor's tokenizer to read the target grids from prompts; "
        "pass tokenizer=<checkpoint>/processor. Tried: " + "; ".join(errors)
    )


class GlmImageForConditionalGeneration(nn.Module, SupportsMRoPE, SupportsPP):
    """GLM-Image's AR text decoder (the vision tower and VQ stay outside: I2I codes come in the prompt)."""

    decode_positions: torch.Tensor  # a registered buffer (nn.Module's __getattr__ is typed Tensor | Module)

    packed_modules_mapping = {
        "qkv_proj": ["q_proj", "k_proj", "v_proj"],
        "gate_up_proj": ["gate_proj", "up_proj"],
    }
    hf_to_vllm_mapper = WeightsMapper(
        orig_to_new_prefix={
            "model.language_model.": "model.",
            "model.visual.": None,
            "model.vqmodel.": None,
        }
    )

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__()
        hf_config = vllm_config.model_config.hf_config
        text_config = _text_config(hf_config)
        self.config = text_config
        self.image_start_token_id = int(hf_config.image_start_token_id)
        self.image_end_token_id = int(hf_config.image_end_token_id)
        self.vocab_size = int(text_config.vocab_size)
        self.vision_vocab_size = int(getattr(text_config, "vision_vocab_size", None) or self.vocab_size)

        text_vllm_config = vllm_config.with_hf_config(text_config, architectures=["Glm4ForCausalLM"])
        self.model = GlmImageTextModel(vllm_config=text_vllm_config, prefix=maybe_prefix(prefix, "model"))
        if get_pp_group().is_last_rank:
            self.lm_head: ParallelLMHead | PPMissingLayer = ParallelLMHead(
                self.vision_vocab_size,
                text_config.hidden_size,
                quant_config=vllm_config.quant_config,
                prefix=maybe_prefix(prefix, "lm_head"),
            )
        else:
            self.lm_head = PPMissingLayer()
        self.logits_processor = LogitsProcessor(self.vision_vocab_size)
        self.make_empty_intermediate_tensors = self.model.make_empty_intermediate_tensors

        scheduler = vllm_config.scheduler_config
        wanted = 4 * int(scheduler.max_num_seqs) * int(vllm_config.model_config.max_model_len)
        self.table_size = max(MIN_TABLE_SIZE, min(MAX_TABLE_SIZE, wanted))
        self.register_buffer(
            "decode_positions", torch.zeros(3, self.table_size, dtype=torch.long), persistent=False
        )
        self._table_next = 0
        self._table_lock = threading.Lock()
        self._tokenizer_config = vllm_config
        self._grid_bos_id: int | None = None
        self._grid_eos_id: int | None = None
        self._tokenizer: Any = None

    # -- positions ---------------------------------------------------------------------------------

    def _grid_markers(self) -> tuple[int, int]:
        if self._tokenizer is None:
            self._tokenizer = _load_tokenizer(self._tokenizer_config)
            self._grid_bos_id = self._tokenizer.convert_tokens_to_ids(GRID_BOS)
            self._grid_eos_id = self._tokenizer.convert_tokens_to_ids(GRID_EOS)
        return int(self._grid_bos_id), int(self._grid_eos_id)  # type: ignore[arg-type]

    def _target_grids(self, tokens: list[int]) -> list[tuple[int, int]]:
        """The ``<sop>h w<eop>`` grids right before the final image-start token, in prompt order."""
        bos, eos = self._grid_markers()
        grids: list[tuple[int, int]] = []
        end = len(tokens) - 1  # the image-start token
        while end > 0 and tokens[end - 1] == eos:
            try:
                start = max(i for i in range(end - 1) if tokens[i] == bos)
            except ValueError:
                break
            text = self._tokenizer.decode(tokens[start + 1 : end - 1])
            parts = text.split()
            if len(parts) != 2 or not all(p.isdigit() for p in parts):
                raise ValueError(
                    f"GLM-Image prompt has a malformed grid {text!r} between {GRID_BOS} and {GRID_EOS}"
                )
            grids.insert(0, (int(parts[0]), int(parts[1])))
            end = start
        return grids

    def get_mrope_input_positions(
        self, input_tokens: list[int], mm_features: list[Any]
    ) -> tuple[torch.Tensor, int]:
        """Prompt positions as transformers' ``GlmImageModel.get_rope_index``, plus the decode table."""
        tokens = list(input_tokens)
        length = len(tokens)
        if not tokens or tokens[-1] != self.image_start_token_id:
            # Not an image-generation prompt: plain 1-D positions for prompt and decode.
            return torch.arange(length, dtype=torch.long).expand(3, -1).clone(), 0
        targets = self._target_grids(tokens)
        if not targets:
            return torch.arange(length, dtype=torch.long).expand(3, -1).clone(), 0

        starts = [i + 1 for i, t in enumerate(tokens[:-1]) if t == self.image_start_token_id]
        ends = [i for i, t in enumerate(tokens) if t == self.image_end_token_id]
        complete = list(zip(starts, ends, strict=False))
        sources: list[tuple[int, int, int]] = []
        if complete:
            sources = lookup_source_grids(tokens) or []
            if len(sources) < len(complete):
                raise ValueError(
                    f"GLM-Image prompt holds {len(complete)} source image(s) but no grid shapes were registered "
                    "for it; call collective_rpc('register_glm_image_source_grids', args=(prompt_ids, grids)) "
                    "with worker_extension_cls="
                    + GlmImageWorkerExtension.__module__
                    + ".GlmImageWorkerExtension"
                )

        pieces: list[torch.Tensor] = []
        current = 0
        previous_end = 0
        for (start, end), (t, h, w) in zip(complete, sources, strict=False):
            if end - start != t * h * w:
                raise ValueError(
                    f"source image grid {t}x{h}x{w} does not match its {end - start} prompt tokens"
                )
            text_len = start - previous_end
            pieces.append(torch.arange(current, current + text_len, dtype=torch.long).expand(3, -1))
            current += text_len
            tt, hh, ww = torch.meshgrid(
                torch.arange(t), torch.arange(h) + current, torch.arange(w) + current, indexing="ij"
            )
            vision = torch.stack([tt + current, hh, ww]).reshape(3, -1)
            pieces.append(vision)
            current += max(h, w)
            previous_end = end
        text_len = length - previous_end
        pieces.append(torch.arange(current, current + text_len, dtype=torch.long).expand(3, -1))
        current += text_len
        prompt_positions = torch.cat(pieces, dim=1)

        decode = self._decode_positions(current, targets)
        offset = self._write_table(decode)
        return prompt_positions, DECODE_POSITION_BASE + offset - length

    @staticmethod
    def _decode_positions(start: int, targets: list[tuple[int, int]]) -> torch.Tensor:
        """Grid positions of the generated tokens: the grids in reverse prompt order, then the end marker."""
        columns = []
        position = start
        for h, w in reversed(targets):
            rows = torch.arange(h).unsqueeze(1).expand(h, w).reshape(-1)
            cols = torch.arange(w).unsqueeze(0).expand(h, w).reshape(-1)
            columns.append(torch.stack([torch.full((h * w,), position), position + rows, position + cols]))
            position += max(h, w)
        columns.append(torch.full((3, 1 + DECODE_SLACK), position))
        return torch.cat(columns, dim=1).to(torch.long)

    def _write_table(self, decode: torch.Tensor) -> int:
        n = decode.shape[1]
        if n > self.table_size:
            raise ValueError(
                f"GLM-Image request needs {n} decode positions; the table holds {self.table_size}"
            )
        with self._table_lock:
            offset = self._table_next
            if offset + n > self.table_size:
                offset = 0
            self._table_next = offset + n
            self.decode_positions[:, offset : offset + n].copy_(decode, non_blocking=False)
        return offset

    def _remap_positions(self, positions: torch.Tensor) -> torch.Tensor:
        if positions.ndim != 2:
            return positions
        relative = positions[0] - DECODE_POSITION_BASE
        looked_up = self.decode_positions[:, relative.clamp(0, self.table_size - 1)]
        return torch.where((relative >= 0).unsqueeze(0), looked_up, positions)

    # -- model -------------------------------------------------------------------------------------

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_input_ids(input_ids)

    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        intermediate_tensors: IntermediateTensors | None = None,
        inputs_embeds: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> torch.Tensor | IntermediateTensors:
        return self.model(input_ids, self._remap_positions(positions), intermediate_tensors, inputs_embeds)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        logits = self.logits_processor(self.lm_head, hidden_states)
        if logits is not None and logits.shape[-1] < self.vocab_size:
            logits = nn.functional.pad(logits, (0, self.vocab_size - logits.shape[-1]), value=float("-inf"))
        return logits

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        loader = AutoWeightsLoader(self)
        return loader.load_weights(weights, mapper=self.hf_to_vllm_mapper)
