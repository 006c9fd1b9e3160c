"""Shared KV slabs: the attention of a batched decode step, one call per slab, each row its alone bits.

A decode step that batches rows must give each row the float math it gets alone (docs/batching.md), and
on the small models this runner serves, each torch call costs more than its arithmetic, so a step should
make one call per operation for the whole batch, not one per row. The row-wise functions (products,
norms, activations) do so on fixed tiles of rows (engine/stages/row_plan.py); attention does so here:

- ``scaled_dot_product_attention`` over a (slots, heads, length, head_dim) cache computes each
  (slot, head) on its own. A row's attention length is its cache capacity rounded up to
  :data:`ATTENTION_BUCKET`, masked past the positions it has filled: a function of the row alone, so
  the rows with one bucket live in one :class:`KVSlab` and share one attention call per layer.
  :func:`slots_independent` checks this per slab shape on the running machine; where it fails,
  attention runs slot by slot.

The masked tail makes a row's logits differ from ``generate``'s in the last bits (the softmax sums over
the bucket, not the exact length); token ids stay ``generate``'s (``tests/test_ar_decode.py``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import cast

import torch
import torch.nn.functional as F

ATTENTION_BUCKET = 64
_INITIAL_SLOTS = 4


def bucket_length(capacity: int) -> int:
    """The attention length of a row that will fill ``capacity`` cache positions."""
    return max(ATTENTION_BUCKET, math.ceil(capacity / ATTENTION_BUCKET) * ATTENTION_BUCKET)


@dataclass(eq=False)
class SlabRow:
    """One request's place in a slab: its slot and how many cache positions it has filled."""

    slab: KVSlab | None
    slot: int
    length: int


@dataclass(eq=False)
class KVSlab:
    """The decode caches of the rows that share one attention length.

    ``keys[l]`` / ``values[l]``: layer ``l``'s cache, (slots, heads, length, head_dim); ``mask``: additive,
    (slots, 1, 1, length), 0 where a row has filled its cache and -inf past it; ``cos`` / ``sin``:
    (slots, length, rotary), the rotary tables of each row's decode steps. Rows hold slots 0..n-1 in
    order of arrival; a row that leaves hands its slot to the last row, so the live rows are always a
    prefix of the slab and a step reads them as views.
    """

    length: int
    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    mask: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    rows: list[SlabRow] = field(default_factory=list)
    per_slot: bool = False  # attention slot by slot (slots_independent failed for this shape)
    # Views of slots 0..n-1 (every layer's keys and values, the mask) per n: a step reads the live rows
    # through them without a slicing call per layer. Rebuilt when the slab grows (new tensors).
    _prefix_views: dict[int, tuple[list[torch.Tensor], list[torch.Tensor], torch.Tensor]] = field(
        default_factory=dict, repr=False
    )

    @classmethod
    def allocate(
        cls,
        layers: int,
        heads: int,
        head_dim: int,
        length: int,
        rotary: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> KVSlab:
        # Zeros, not empty: a masked position still multiplies its value by 0, and garbage could be NaN.
        def cache() -> torch.Tensor:
            return torch.zeros(_INITIAL_SLOTS, heads, length, head_dim, dtype=dtype, device=device)

        return cls(
            length=length,
            keys=[cache() for _ in range(layers)],
            values=[cache() for _ in range(layers)],
            mask=torch.full((_INITIAL_SLOTS, 1, 1, length), -math.inf, dtype=dtype, device=device),
            cos=torch.zeros(_INITIAL_SLOTS, length, rotary, dtype=dtype, device=device),
            sin=torch.zeros(_INITIAL_SLOTS, length, rotary, dtype=dtype, device=device),
        )

    @property
    def slots(self) -> int:
        return self.mask.shape[0]

    def _grow(self) -> None:
        def doubled(t: torch.Tensor, fill: float = 0.0) -> torch.Tensor:
            more = torch.full_like(t, fill)
            return torch.cat([t, more])

        self.keys = [doubled(t) for t in self.keys]
        self.values = [doubled(t) for t in self.values]
        self.mask = doubled(self.mask, -math.inf)
        self.cos, self.sin = doubled(self.cos), doubled(self.sin)
        self._prefix_views.clear()

    def prefix(self, n: int) -> tuple[list[torch.Tensor], list[torch.Tensor], torch.Tensor]:
        """Slots 0..n-1 of every layer's keys and values and of the mask, as views (built once per n)."""
        views = self._prefix_views.get(n)
        if views is None:
            views = [t[:n] for t in self.keys], [t[:n] for t in self.values], self.mask[:n]
            self._prefix_views[n] = views
        return views

    def add(
        self, keys: list[torch.Tensor], values: list[torch.Tensor], cos: torch.Tensor, sin: torch.Tensor
    ) -> SlabRow:
        """A new row from its prefill cache (per layer (1, heads, filled, head_dim)) and its decode
        steps' rotary tables ((steps, rotary))."""
        if len(self.rows) == self.slots:
            self._grow()
        slot, filled = len(self.rows), keys[0].shape[2]
        for layer, (key, value) in enumerate(zip(keys, values, strict=True)):
            self.keys[layer][slot, :, :filled] = key[0]
            self.values[layer][slot, :, :filled] = value[0]
        self.mask[slot] = -math.inf
        self.mask[slot, ..., :filled] = 0
        self.cos[slot, : cos.shape[0]] = cos
        self.sin[slot, : sin.shape[0]] = sin
        row = SlabRow(slab=self, slot=slot, length=filled)
        self.rows.append(row)
        return row

    def remove(self, row: SlabRow) -> None:
        """Free the row's slot: the last row moves into it (the live rows stay a prefix)."""
        last = self.rows.pop()
        if last is not row:
            slot = row.slot
            for tensors in (self.keys, self.values, [self.mask, self.cos, self.sin]):
                for t in tensors:
                    t[slot] = t[last.slot]
            last.slot = slot
            self.rows[slot] = last
        row.slab = None

    def open(self, slots: torch.Tensor | int, positions: torch.Tensor | int) -> None:
        """Unmask the positions the rows' new tokens take (once per step, for every layer). One row
        passes plain ints (basic indexing: cheaper calls, the same values)."""
        self.mask[slots, 0, 0, positions] = 0

    def attend(
        self,
        layer: int,
        slots: torch.Tensor | int,
        positions: torch.Tensor | int,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        scale: float,
        prefix: bool,
    ) -> torch.Tensor:
        """Write the rows' new keys and values ((n, kv_heads, 1, head_dim)) at their positions and attend
        with their queries ((n, heads, 1, head_dim)); returns (n, heads, 1, head_dim). ``prefix``: the rows
        are slots 0..n-1 in order (the slab's live rows), read as views; else they are gathered. One row
        passes plain ints (slices: cheaper calls, the same values)."""
        keys, values = self.keys[layer], self.values[layer]
        if isinstance(slots, int):
            at = cast(int, positions)
            keys[slots : slots + 1, :, at : at + 1] = key
            values[slots : slots + 1, :, at : at + 1] = value
        else:
            keys[slots, :, positions] = key[:, :, 0]
            values[slots, :, positions] = value[:, :, 0]
        gqa = query.shape[1] != keys.shape[1]  # grouped-query attention: fewer key/value heads
        if self.per_slot:
            picked = [slots] if isinstance(slots, int) else slots.tolist()
            outs = [
                F.scaled_dot_product_attention(
                    query[i : i + 1],
                    keys[s : s + 1],
                    values[s : s + 1],
                    attn_mask=self.mask[s : s + 1],
                    scale=scale,
                    enable_gqa=gqa,
                )
                for i, s in enumerate(picked)
            ]
            return torch.cat(outs)
        if prefix:
            prefix_keys, prefix_values, mask = self.prefix(query.shape[0])
            return F.scaled_dot_product_attention(
                query, prefix_keys[layer], prefix_values[layer], attn_mask=mask, scale=scale, enable_gqa=gqa
            )
        index = slice(slots, slots + 1) if isinstance(slots, int) else slots
        return F.scaled_dot_product_attention(
            query, keys[index], values[index], attn_mask=self.mask[index], scale=scale, enable_gqa=gqa
        )


def slots_independent(slab: KVSlab, heads: int, head_dim: int, max_rows: int) -> bool:
    """Whether attention over the first n slots of a cache shaped like ``slab``'s (queries with ``heads``
    heads), and over gathered slots, gives each slot the bits it gets alone, for n up to ``max_rows``."""
    generator = torch.Generator(device="cpu").manual_seed(0)
    n = max(max_rows, 2)
    dtype, length, kv_heads = slab.mask.dtype, slab.length, slab.keys[0].shape[1]

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator).to(dtype=dtype, device=slab.mask.device)

    q, k, v = (
        randn(n, heads, 1, head_dim),
        randn(n, kv_heads, length, head_dim),
        randn(n, kv_heads, length, head_dim),
    )
    mask = torch.full((n, 1, 1, length), -math.inf, dtype=dtype, device=slab.mask.device)
    for i in range(n):
        mask[i, ..., : 1 + (i * 37) % length] = 0
    scale = head_dim**-0.5

    def attend(index: slice | torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(
            q[index], k[index], v[index], attn_mask=mask[index], scale=scale, enable_gqa=heads != kv_heads
        )

    alone = torch.cat([attend(slice(i, i + 1)) for i in range(n)])
    if not all(torch.equal(attend(slice(0, rows)), alone[:rows]) for rows in range(2, n + 1)):
        return False
    picked = torch.arange(n - 1, -1, -2)
    return torch.equal(attend(picked), alone[picked])
