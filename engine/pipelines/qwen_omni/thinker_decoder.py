"""The thinker's lean decode step: many chat and speech replies' tokens in one forward per token.

``Qwen2_5OmniThinkerForConditionalGeneration`` without audio in is a text model under M-RoPE: ``generate``
gives its first forward the prompt's ids with 4-axis positions (the text positions, then the three M-RoPE
axes from ``get_rope_index``; no attention mask, an all-ones one is dropped), and each later forward the
last token at ``cache length`` (+ ``rope_deltas``, 0 for text) on every axis. :class:`ThinkerDecoder` is
the :class:`~engine.stages.ar_transformers.FastDecoder` of that model (docs/batching.md, "The lean AR
decode loop"):

- prefill is the model's own forward, alone, with what ``generate``'s first forward gets; its cache moves
  into a :class:`KVSlab` slot, and the rotary tables of every token to come are computed once;
- a step embeds each row's last token and runs the decoder layers, the final norm and ``lm_head`` op for
  op (engine/pipelines/qwen_omni/omni_decode.py), the row-wise functions on fixed tiles of rows.

A speaking row also keeps, per position it computed, its last hidden state (the final norm's output,
``hidden_states[-1]``) plus its input embedding: the prompt's from prefill, one per decode step. Like
``generate``, no forward runs for the last sampled token, so the rows cover the prompt and every reply
token but the last (the thinker's ``latent``, engine/pipelines/qwen_omni/thinker.py). A row's ids are
``generate``'s and its latent equals ``generate``'s to float rounding
(``tests/test_qwen_omni_thinker_batch.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.nn.functional as F

from engine.pipelines.qwen_omni.omni_decode import OmniSlabDecoder
from engine.stages.decode_slabs import SlabRow

# Inputs that need the thinker's encoders (audio, pictures, video): such prompts stay on generate.
ENCODER_INPUTS = ("input_features", "pixel_values", "pixel_values_videos", "inputs_embeds")


@dataclass(eq=False)
class ThinkerRow:
    """One reply's decode state: its slab slot and, when speaking, its latent rows so far (each (n, H))."""

    cache: SlabRow | None  # None: a teacher-forced reply, computed in one forward (nothing to decode)
    latent: list[torch.Tensor] | None = None

    def latent_rows(self) -> torch.Tensor:
        """Per position computed: final hidden state + input embedding, (positions, H)."""
        assert self.latent is not None
        return torch.cat(self.latent)


class ThinkerDecoder(OmniSlabDecoder):
    """The lean decode step of ``Qwen2_5OmniThinkerForConditionalGeneration`` (float32 on a CPU, text in)."""

    def __init__(self, model: Any, max_rows: int = 8) -> None:
        super().__init__(model, model.model, model.lm_head, "lm_head", max_rows)

    def supports(self, model_inputs: dict[str, Any]) -> bool:
        mask = model_inputs.get("attention_mask")
        return (
            self.usable
            and model_inputs["input_ids"].shape[0] == 1
            and int(model_inputs.get("max_new_tokens") or 0) > 0
            and not model_inputs.get("use_audio_in_video")
            and not any(model_inputs.get(name) is not None for name in ENCODER_INPUTS)
            and (mask is None or bool(mask.all()))
        )

    def prefill(self, model_inputs: dict[str, Any]) -> tuple[torch.Tensor, ThinkerRow]:
        """``generate``'s first forward (the model's own, alone): the prompt's ids and the 4-axis
        positions ``generate`` makes (which set the model's ``rope_deltas``), no attention mask, hidden
        states when ``model_inputs["output_hidden_states"]``. ``model_inputs["max_new_tokens"]``: the
        row's budget (its cache capacity)."""
        deltas, out = self._forward(model_inputs, model_inputs["input_ids"])
        logits = out.logits[:, -1].to(copy=True, dtype=torch.float32)
        delta = 0 if deltas is None else int(deltas.reshape(-1)[0])
        row = self.add_row(out.past_key_values, int(model_inputs["max_new_tokens"]), logits, delta)
        return logits, self._row(row, model_inputs, out)

    def prefill_forced(
        self, model_inputs: dict[str, Any], forced: torch.Tensor
    ) -> tuple[torch.Tensor, ThinkerRow]:
        """A teacher-forced reply (``forced``: its ids, the last one included) in one forward, alone: the
        prompt's ids then the reply's but the last, as the positions a decode of that reply would compute
        (docs/batching.md, "Teacher-forced replies"). Returns the float32 logits at each reply position
        (``forced.numel()``, V), what each decode step would have chosen from, and the row (its latent
        when speaking; no cache: nothing decodes after it)."""
        prompt = model_inputs["input_ids"]
        reply = forced.reshape(1, -1)[:, :-1].to(prompt.device)
        _, out = self._forward(model_inputs, torch.cat([prompt, reply], dim=1))
        logits = out.logits[0, prompt.shape[1] - 1 :].to(copy=True, dtype=torch.float32)
        return logits, self._row(None, model_inputs, out)

    def _forward(self, model_inputs: dict[str, Any], ids: torch.Tensor) -> tuple[Any, Any]:
        """The model's own forward over ``ids`` from an empty cache, as ``generate``'s first forward: the
        model's ``rope_deltas`` for them and the output."""
        from transformers import DynamicCache

        model = self.model
        positions = model._prepare_position_ids_for_generation(
            ids,
            {"input_ids": ids, "attention_mask": torch.ones_like(ids), "use_audio_in_video": False},
        )
        deltas = model.rope_deltas
        out = model(
            input_ids=ids,
            position_ids=positions,
            past_key_values=DynamicCache(config=model.config),
            use_cache=True,
            use_audio_in_video=False,
            output_hidden_states=bool(model_inputs.get("output_hidden_states")),
            return_dict=True,
        )
        return deltas, out

    @staticmethod
    def _row(cache: SlabRow | None, model_inputs: dict[str, Any], out: Any) -> ThinkerRow:
        state = ThinkerRow(cache)
        if model_inputs.get("output_hidden_states"):
            hidden = out.hidden_states  # (embeddings, ..., final norm's output), each (1, n, H)
            state.latent = [hidden[-1][0] + hidden[0][0]]
        return state

    def release(self, state: Any) -> None:
        cache = cast(ThinkerRow, state).cache
        if cache is not None:
            self.release_row(cache)

    def step(self, states: list[Any], tokens: torch.Tensor, steps: list[int]) -> torch.Tensor:
        rows = cast("list[ThinkerRow]", states)
        embedded = F.embedding(tokens, self.text.embed_tokens.weight)  # (B, H): embed_tokens' values
        keep = any(row.latent is not None for row in rows)
        logits, hidden = self.run_rows(
            [cast(SlabRow, row.cache) for row in rows], embedded, steps, keep_hidden=keep
        )
        if hidden is not None:
            for i, row in enumerate(rows):
                if row.latent is not None:
                    row.latent.append(hidden[i : i + 1] + embedded[i : i + 1])
        return logits
