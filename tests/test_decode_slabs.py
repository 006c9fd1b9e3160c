"""The lean decode step's batch-invariance machinery (engine/stages/decode_slabs.py, docs/batching.md):
slabs keep their live rows a prefix, and a row's attention gets its alone bits on whatever path the
run-time check picks (batched where the kernel keeps slots apart, slot by slot where it does not)."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from engine.stages import decode_slabs
from engine.stages.decode_slabs import ATTENTION_BUCKET, KVSlab, bucket_length, slots_independent

LAYERS, HEADS, HEAD_DIM, ROTARY = 2, 3, 8, 8


@pytest.fixture(autouse=True)
def one_thread():
    """The lean step runs a small model on one intra-op thread (engine/stages/base.py): the slabs here run
    as the engine's decode thread runs them."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def slab(length: int = 64) -> KVSlab:
    return KVSlab.allocate(LAYERS, HEADS, HEAD_DIM, length, ROTARY, torch.float32, torch.device("cpu"))


def prefill(filled: int, mark: float) -> tuple[list[torch.Tensor], list[torch.Tensor], torch.Tensor]:
    keys = [torch.full((1, HEADS, filled, HEAD_DIM), mark + layer) for layer in range(LAYERS)]
    values = [torch.full((1, HEADS, filled, HEAD_DIM), -mark - layer) for layer in range(LAYERS)]
    return keys, values, torch.full((10, ROTARY), mark)


def test_bucket_length_rounds_up_to_the_bucket() -> None:
    assert bucket_length(1) == ATTENTION_BUCKET
    assert bucket_length(ATTENTION_BUCKET) == ATTENTION_BUCKET
    assert bucket_length(ATTENTION_BUCKET + 1) == 2 * ATTENTION_BUCKET


def test_rows_hold_a_prefix_and_a_leaving_row_hands_its_slot_to_the_last() -> None:
    s = slab()
    rows = []
    for i in range(6):  # past the initial slots: the slab grows and keeps what it held
        keys, values, table = prefill(3 + i, float(i + 1))
        rows.append(s.add(keys, values, table, -table))
    assert [r.slot for r in rows] == list(range(6)) and s.slots >= 6
    assert torch.equal(s.keys[1][2, :, : 3 + 2], torch.full((HEADS, 5, HEAD_DIM), 3.0 + 1))
    assert bool((s.mask[2, 0, 0, :5] == 0).all()) and bool((s.mask[2, 0, 0, 5:] == -math.inf).all())

    s.remove(rows[1])  # the last row (slot 5) moves into slot 1 with its cache, mask and tables
    assert rows[1].slab is None
    assert [r.slot for r in s.rows] == list(range(5)) and rows[5].slot == 1
    assert torch.equal(s.keys[0][1, :, :8], torch.full((HEADS, 8, HEAD_DIM), 6.0))
    assert bool((s.mask[1, 0, 0, :8] == 0).all()) and bool((s.mask[1, 0, 0, 8:] == -math.inf).all())
    assert torch.equal(s.cos[1, :10], torch.full((10, ROTARY), 6.0))

    s.remove(rows[5])  # a row in the last slot just leaves
    assert [r.slot for r in s.rows] == list(range(4))


def slot_mixing_attention(query, key, value, attn_mask=None, scale=None, enable_gqa=False):
    """Attention as a kernel that let slots leak into each other would compute it: a slot's output moves
    with the other slots' keys."""
    out = F.scaled_dot_product_attention(
        query, key, value, attn_mask=attn_mask, scale=scale, enable_gqa=enable_gqa
    )
    return out + 1e-3 * key.mean(dim=(0, 1, 2), keepdim=True)[..., :1].expand_as(out)


def attend_five_slots(
    s: KVSlab,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Five rows of different lengths attend as one step (the live prefix), as a gathered batch in reverse
    order, and one of them alone; returns (together, gathered, alone, positions, q, k)."""
    generator = torch.Generator().manual_seed(1)
    for i in range(5):
        keys = [torch.randn(1, HEADS, 5 + 7 * i, HEAD_DIM, generator=generator) for _ in range(LAYERS)]
        values = [torch.randn(1, HEADS, 5 + 7 * i, HEAD_DIM, generator=generator) for _ in range(LAYERS)]
        s.add(keys, values, torch.zeros(1, ROTARY), torch.zeros(1, ROTARY))
    slots = torch.arange(5)
    positions = torch.tensor([r.length for r in s.rows])
    s.open(slots, positions)
    q, k, v = (torch.randn(5, HEADS, 1, HEAD_DIM, generator=generator) for _ in range(3))
    together = s.attend(0, slots, positions, q, k, v, 0.3, prefix=True)
    gathered = s.attend(
        0, slots.flip(0), positions.flip(0), q.flip(0), k.flip(0), v.flip(0), 0.3, prefix=False
    )
    one = int(slots[2])  # a single row passes plain ints
    alone = s.attend(0, one, int(positions[2]), q[2:3], k[2:3], v[2:3], 0.3, prefix=False)
    return together, gathered, alone, positions, q, k


@pytest.mark.parametrize("forced_per_slot", [False, True], ids=["checked", "slot-by-slot"])
def test_attention_over_the_slab_gives_each_row_its_alone_bits(forced_per_slot: bool) -> None:
    """Whichever path the run-time check picks on this machine (as the decoder does per slab shape,
    engine/pipelines/glm_image/ar_transformers.py), a row attends to the same bits alone, in the live
    prefix and gathered; the slot-by-slot fallback is also run here on any machine."""
    s = slab()
    s.per_slot = forced_per_slot or not slots_independent(s, HEADS, HEAD_DIM, 8)
    together, gathered, alone, positions, q, k = attend_five_slots(s)
    assert torch.equal(alone[0], together[2])
    for i in range(5):
        length = int(positions[i]) + 1
        assert torch.equal(s.keys[0][i, :, length - 1], k[i, :, 0])  # the new key landed at its position
        exact = F.scaled_dot_product_attention(
            q[i : i + 1], s.keys[0][i : i + 1, :, :length], s.values[0][i : i + 1, :, :length], scale=0.3
        )[0]
        assert torch.allclose(together[i], exact, atol=1e-6)  # the masked tail adds nothing but rounding
        assert torch.equal(gathered[4 - i], together[i])


def test_the_check_refuses_attention_that_mixes_slots_and_the_fallback_keeps_alone_bits(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(
        decode_slabs, "F", SimpleNamespace(scaled_dot_product_attention=slot_mixing_attention)
    )
    s = slab()
    assert not slots_independent(s, HEADS, HEAD_DIM, 8)
    s.per_slot = True  # what the decoder sets when the check fails
    together, gathered, alone, *_ = attend_five_slots(s)
    assert torch.equal(alone[0], together[2])
    assert all(torch.equal(gathered[4 - i], together[i]) for i in range(5))


def test_the_check_accepts_attention_computed_slot_by_slot(monkeypatch: pytest.MonkeyPatch) -> None:
    """A kernel that keeps slots apart by construction passes (so the check is not refusing everything)."""

    def slot_by_slot(query, key, value, attn_mask=None, scale=None, enable_gqa=False):
        return torch.cat(
            [
                F.scaled_dot_product_attention(
                    query[i : i + 1],
                    key[i : i + 1],
                    value[i : i + 1],
                    attn_mask=None if attn_mask is None else attn_mask[i : i + 1],
                    scale=scale,
                    enable_gqa=enable_gqa,
                )
                for i in range(query.shape[0])
            ]
        )

    monkeypatch.setattr(decode_slabs, "F", SimpleNamespace(scaled_dot_product_attention=slot_by_slot))
    assert slots_independent(slab(), HEADS, HEAD_DIM, 8)


def test_prefix_views_follow_the_slab_when_it_grows() -> None:
    s = slab()
    generator = torch.Generator().manual_seed(2)

    def add_row() -> None:
        keys = [torch.randn(1, HEADS, 6, HEAD_DIM, generator=generator) for _ in range(LAYERS)]
        values = [torch.randn(1, HEADS, 6, HEAD_DIM, generator=generator) for _ in range(LAYERS)]
        s.add(keys, values, torch.zeros(1, ROTARY), torch.zeros(1, ROTARY))

    def attend_first_two() -> torch.Tensor:
        q = torch.ones(2, HEADS, 1, HEAD_DIM)
        k, v = torch.zeros(2, HEADS, 1, HEAD_DIM), torch.full((2, HEADS, 1, HEAD_DIM), 5.0)
        positions = torch.tensor([r.length for r in s.rows[:2]])
        return s.attend(1, torch.arange(2), positions, q, k, v, 0.3, prefix=True)

    add_row()
    add_row()
    before = attend_first_two()
    for _ in range(4):  # past the initial slots: new tensors, the old views would read stale copies
        add_row()
    assert s.slots > 4
    s.values[1][0, :, :6] = 100.0  # slot 0's cache changes in the grown slab
    after = attend_first_two()
    assert torch.equal(after[1], before[1]) and not torch.equal(after[0], before[0])
