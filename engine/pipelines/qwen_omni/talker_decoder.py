"""The talker's lean decode step: many speech streams' codec ids in one forward per code.

``Qwen2_5OmniTalkerForConditionalGeneration`` decodes one code at a time from a step input of its own:
the codec embedding of the last code plus the next row of the thinker's reply (``thinker_reply_part``,
its last row again once the rows run out), projected by ``thinker_to_talker_proj``, at the position
``cache length`` on all three M-RoPE axes (``generate`` drops an all-ones attention mask, so the model's
own ``rope_deltas`` branch never runs under it: the text model counts positions from 0).
:class:`TalkerDecoder` is the
:class:`~engine.stages.ar_transformers.FastDecoder` of that model, as ``GlmImageDecoder`` is GLM-Image's
(docs/batching.md, "The lean AR decode loop"):

- prefill is the model's own forward, alone, with what ``generate``'s first forward gets; its cache moves
  into a :class:`KVSlab` slot, and the rotary tables of every code to come are computed once;
- a step runs the talker's decoder layers directly (engine/pipelines/qwen_omni/omni_decode.py), op for op ``Qwen2_5OmniDecoderLayer.forward``: the
  row-wise functions (input projection, q/k/v, output and MLP products, norms, activation, codec head) on
  fixed tiles of rows through :class:`RowPlan` with its guarded fallbacks, attention once per slab.

So a row's float math never depends on the rows beside it, and its codes are ``generate``'s (the masked
attention tail differs from ``generate``'s in the last bits, as for GLM-Image; the ids do not:
``tests/test_qwen_omni_talker_batch.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.nn.functional as F

from engine.pipelines.qwen_omni.omni_decode import OmniSlabDecoder
from engine.stages.decode_slabs import SlabRow
from engine.stages.row_plan import RowWise


@dataclass(eq=False)
class TalkerRow:
    """One stream's decode state: its slab slot and the thinker's reply rows it reads, one per code."""

    cache: SlabRow
    reply: torch.Tensor  # (rows, embedding_size)


class TalkerDecoder(OmniSlabDecoder):
    """The lean decode step of ``Qwen2_5OmniTalkerForConditionalGeneration`` (float32 on a CPU)."""

    def __init__(self, model: Any, max_rows: int = 8) -> None:
        super().__init__(model, model.model, model.codec_head, "codec_head", max_rows)
        proj = model.thinker_to_talker_proj
        self.input_proj = RowWise.product("input_proj", proj.weight, proj.bias)

    def extra_functions(self) -> list[RowWise]:
        return [self.input_proj]

    def supports(self, model_inputs: dict[str, Any]) -> bool:
        mask = model_inputs.get("attention_mask")
        reply = model_inputs.get("thinker_reply_part")
        return (
            self.usable
            and model_inputs["input_ids"].shape[0] == 1
            and reply is not None
            and reply.shape[0] == 1
            and reply.shape[1] >= 1
            and model_inputs.get("input_text_ids") is not None
            and int(model_inputs.get("max_new_tokens") or 0) > 0
            and not model_inputs.get("use_audio_in_video")
            and (mask is None or bool(mask.all()))
        )

    def prefill(self, model_inputs: dict[str, Any]) -> tuple[torch.Tensor, TalkerRow]:
        """``generate``'s first forward (the model's own, alone): no attention mask (``generate`` drops an
        all-ones one), no positions. ``model_inputs["max_new_tokens"]``: the row's budget (its cache
        capacity). The codes to come get their rotary tables at ``cache length`` on all three axes, the
        positions the text model gives them when the talker passes none."""
        from transformers import DynamicCache

        model = self.model
        inputs = {k: v for k, v in model_inputs.items() if k not in ("max_new_tokens", "attention_mask")}
        # A copy, as generate's: given a mask, the forward adds into its last two rows in place.
        inputs["inputs_embeds"] = inputs["inputs_embeds"].clone()
        out = model(
            **inputs,
            position_ids=None,
            past_key_values=DynamicCache(config=model.config),
            use_cache=True,
            return_dict=True,
        )
        logits = out.logits[:, -1].to(copy=True, dtype=torch.float32)
        row = self.add_row(out.past_key_values, int(model_inputs["max_new_tokens"]), logits)
        return logits, TalkerRow(row, model_inputs["thinker_reply_part"][0])

    def release(self, state: Any) -> None:
        self.release_row(cast(TalkerRow, state).cache)

    def step(self, states: list[Any], tokens: torch.Tensor, steps: list[int]) -> torch.Tensor:
        talker_rows = cast("list[TalkerRow]", states)
        # Each row's step input: its last code's embedding plus its next reply row (the last one again
        # once they run out), as the model's forward adds them.
        replies = [
            state.reply[min(at, state.reply.shape[0] - 1)]
            for state, at in zip(talker_rows, steps, strict=True)
        ]
        reply = replies[0][None] if len(replies) == 1 else torch.stack(replies)
        embedded = F.embedding(tokens, self.text.embed_tokens.weight) + reply  # (B, embedding_size)
        rows = [state.cache for state in talker_rows]
        return self.run_rows(rows, embedded, steps, self.input_proj)[0]
