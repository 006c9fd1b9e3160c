"""What every lean decoder over KV slabs shares (GLM-Image's, Qwen2.5-Omni's thinker and talker).

A family's decoder (its ``FastDecoder``, engine/stages/ar_transformers.py) mirrors its model's decoder
layers op for op; the part common to all of them lives here: the row plan chosen on first use from the
checks of one layer's row-wise functions plus the decoder's others (engine/stages/row_plan.py), the KV
slabs by length with their slot-independence check (engine/stages/decode_slabs.py), and the words the
System tab and ``/metrics`` show for it (docs/batching.md).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar, cast

import torch

from engine.stages.decode_slabs import KVSlab, SlabRow, slots_independent
from engine.stages.row_plan import RowPlan, RowWise


def activation_kernel(module: Any) -> Callable[[torch.Tensor], torch.Tensor]:
    """An MLP's activation as the kernel it calls (SiLU, whose module calls ``F.silu``: that function's own
    kernel, without the module's and the function's Python layers), else the module itself."""
    kind = type(module)
    silu = kind is torch.nn.SiLU or (
        kind.__name__ == "SiLUActivation" and kind.__module__ == "transformers.activations"
    )
    return cast("Callable[[torch.Tensor], torch.Tensor]", torch._C._nn.silu if silu else module)


def joined_product(name: str, projections: Sequence[Any]) -> RowWise:
    """Linear layers over the same input as one product: their weights (and biases) concatenated, so one
    call gives their outputs side by side (q, k and v; gate and up)."""
    biases = [p.bias for p in projections]
    bias = None if any(b is None for b in biases) else torch.cat(cast("list[torch.Tensor]", biases))
    return RowWise.product(name, torch.cat([p.weight for p in projections]), bias)


class LayerFunctions(Protocol):
    def functions(self) -> list[RowWise]: ...


Layer = TypeVar("Layer", bound=LayerFunctions)


class SlabDecoder(Generic[Layer]):
    """The shared part of a lean decoder: ``text`` is the model holding the decoder layers (its config
    names the attention heads), ``layers`` their row-wise functions, one per layer."""

    layers: Sequence[Layer]

    def __init__(self, text: Any, max_rows: int) -> None:
        self.text = text
        self.max_rows = max(1, max_rows)
        self.slabs: dict[int, KVSlab] = {}
        # How the row-wise functions run on this machine: chosen by checks on the decode thread (its
        # thread count picks kernels) at the first step.
        self.row_plan: RowPlan | None = None
        self._slots_checked: dict[tuple[int, int, int], bool] = {}  # slots_independent per cache shape

    def checked_functions(self) -> list[RowWise]:
        """The row-wise functions besides the layers' (the final norm, the head, ...), checked with them."""
        raise NotImplementedError

    def plan_rows(self) -> RowPlan:
        """The row plan, chosen on first use by checks of layer 0's functions (every layer has the same
        shapes) and :meth:`checked_functions`, then given to every layer."""
        if self.row_plan is None:
            first, *rest = self.layers
            plan = RowPlan.choose([*first.functions(), *self.checked_functions()], self.max_rows)
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
        """The slab of rows with room for ``length`` positions (made on first use, its slots checked)."""
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

    _perm: torch.Tensor | None = None

    def _rotate_half_index(self, rotary: int, device: torch.device) -> torch.Tensor:
        """The gather index of ``rotate_half`` (second half, then first), built once."""
        if self._perm is None or self._perm.numel() != rotary or self._perm.device != device:
            half = rotary // 2
            self._perm = torch.cat([torch.arange(half, rotary), torch.arange(half)]).to(device)
        return self._perm

    def release_row(self, row: SlabRow) -> None:
        """The row is done: its slot goes back (and the slab's memory with its last row)."""
        slab = row.slab
        if slab is None:
            return
        slab.remove(row)
        if not slab.rows:  # memory goes back when a slab's last row leaves
            self.slabs.pop(slab.length, None)

    def open_step(self, rows: list[SlabRow], steps: list[int], device: torch.device) -> OpenStep:
        """Open every row's next position in its slab for one decode step: the rows grouped by slab, each
        group in slot order (``OpenStep.order`` maps them back to the caller's), their rotary rows, and
        the rotation and attention the layers call."""
        for row in rows:
            if row.slab is None or row.length >= row.slab.length:
                raise RuntimeError("decode ran past its cache (or a released row was stepped)")
        order: list[int] | None = None
        if len(rows) > 1:
            groups: dict[int, list[int]] = {}
            for i, row in enumerate(rows):
                groups.setdefault(id(row.slab), []).append(i)
            grouped = [i for members in groups.values() for i in sorted(members, key=lambda i: rows[i].slot)]
            if grouped != list(range(len(rows))):
                order = grouped
                rows, steps = [rows[i] for i in order], [steps[i] for i in order]
        batch = len(rows)
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

        return OpenStep(rows, order, rotate, attend)


@dataclass
class OpenStep:
    """One decode step's rows in slab order (``order``: the caller's index of each, None when unchanged),
    the rotation of q and k, and attention per layer over the rows' slabs."""

    rows: list[SlabRow]
    order: list[int] | None
    rotate: Callable[[torch.Tensor], torch.Tensor]
    attend: Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor]

    def in_slab_order(self, x: torch.Tensor) -> torch.Tensor:
        """The caller's per-row tensor in the step's row order."""
        return x if self.order is None else x[torch.tensor(self.order, device=x.device)]

    def in_caller_order(self, x: torch.Tensor) -> torch.Tensor:
        """The step's per-row result back in the caller's row order."""
        if self.order is None:
            return x
        restored = torch.empty_like(x)
        restored[torch.tensor(self.order, device=x.device)] = x
        return restored
