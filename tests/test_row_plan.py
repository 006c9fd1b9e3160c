"""How a batched decode step computes its row-wise functions (engine/stages/row_plan.py, docs/batching.md).

What must hold on every machine is checked here: whatever plan the checks choose on this CPU, a row's
result in a batch equals its result alone. Kernels that behave like the ones that broke batching elsewhere
(another result at one row count, at some positions) are simulated, so the tile choice and the fallbacks
are exercised on any CPU; the real kernels of each x86 path are exercised by running the suite under
them (docs/batching.md, "Which path ran where")."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.stages.row_plan import (
    REFUSE_ENV,
    ROW_TILES,
    RowMode,
    RowPadding,
    RowPlan,
    RowWise,
    padded_length,
    refused_modes,
)

MAX_ROWS = 8


@pytest.fixture(autouse=True)
def one_thread():
    """The lean step runs a small model on one intra-op thread (engine/stages/base.py)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def functions() -> list[RowWise]:
    """A decode step's kinds of row-wise function at the tiny models' shapes."""
    g = torch.Generator().manual_seed(1)
    norm_weight = torch.randn(96, generator=g)

    def activation(x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return up * F.silu(gate)

    return [
        RowWise.product("qkv", torch.randn(288, 96, generator=g), torch.randn(288, generator=g)),
        RowWise.product("down", torch.randn(96, 256, generator=g), None),
        RowWise.product("lm_head", torch.randn(1000, 96, generator=g), None),
        RowWise("norm", lambda x: torch.rms_norm(x, [96], norm_weight, 1e-5), 96, torch.float32),
        RowWise("activation", activation, 512, torch.float32),
    ]


def run_step(f: RowWise, x: torch.Tensor, tile: int) -> torch.Tensor:
    """``f`` as a step calls it: the rows padded to whole tiles (stale rows in the padding), the live rows'
    results back."""
    pad = RowPadding()
    pad(torch.randn(x.shape[0] + tile, x.shape[1]), padded_length(x.shape[0], tile))  # stale contents
    live = x.shape[0]
    return f(pad(x, padded_length(live, tile)), live)[:live]


def assert_rows_as_alone(fs: list[RowWise], plan: RowPlan) -> None:
    g = torch.Generator().manual_seed(5)
    for f in fs:
        x = torch.randn(MAX_ROWS * 2 + 3, f.width, generator=g)
        alone = [run_step(f, x[i : i + 1], plan.tile) for i in range(x.shape[0])]
        for n in (2, 3, MAX_ROWS, MAX_ROWS + 1, 2 * MAX_ROWS + 3):
            for start in (0, x.shape[0] - n):
                together = run_step(f, x[start : start + n], plan.tile)
                for i in range(n):
                    assert torch.equal(together[i : i + 1], alone[start + i]), (f.name, f.mode, n, i)


@pytest.mark.parametrize("refuse", ["", "tiled", "tiled,live-rows", "tiled,live-rows,single-row-batch"])
def test_every_plan_gives_each_row_its_alone_bits(monkeypatch: pytest.MonkeyPatch, refuse: str) -> None:
    """Whatever this CPU's checks pass (and with the fast modes refused, as where they fail), a row gets
    the same bits alone and among up to 19 rows, at any place in the batch."""
    monkeypatch.setenv(REFUSE_ENV, refuse)
    fs = functions()
    plan = RowPlan.choose(fs, MAX_ROWS)
    if refuse:
        assert all(mode is not RowMode.TILED for mode in plan.modes.values())
    if "single-row-batch" in refuse:
        assert set(plan.modes.values()) == {RowMode.ROW_BY_ROW}
        assert "one row per call" in plan.describe()
    assert_rows_as_alone(fs, plan)


def count_dependent(weight: torch.Tensor, rows: int, first_position: int):
    """A product like MKL's Intel AVX2 path at 8 rows: a call on exactly ``rows`` rows computes the rows
    from ``first_position`` on with another kernel (here: a last-bit difference)."""

    def fn(x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, weight)
        if x.shape[0] == rows:
            y[first_position:] = torch.nextafter(
                y[first_position:], torch.full_like(y[first_position:], 1e30)
            )
        return y

    return fn


def test_a_tile_whose_kernel_depends_on_the_position_is_skipped_for_the_next() -> None:
    weight = torch.randn(64, 32)
    f = RowWise("o_proj", count_dependent(weight, 8, 6), 32, torch.float32, weight=weight)
    plan = RowPlan.choose([f], MAX_ROWS)
    assert plan.tile == ROW_TILES[1] and plan.modes == {"o_proj": RowMode.TILED}
    assert plan.describe() == f"batched, tiles of {ROW_TILES[1]} rows"
    assert_rows_as_alone([f], plan)


def test_a_function_that_fails_at_every_tile_falls_back_and_still_matches() -> None:
    """A product whose batched call mixes rows at every tile gets the single-row batch (its own kernel,
    checked); a function that mixes rows and is no product runs one row per call. Both still batch the
    rest of the step and give each row its alone bits."""
    weight = torch.randn(48, 32)

    def mixing_product(x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, weight) + 1e-3 * x.mean(0).sum()

    product = RowWise("gate_up", mixing_product, 32, torch.float32, weight=weight)
    centred = RowWise("centred", lambda x: x - x.mean(0), 32, torch.float32)
    plan = RowPlan.choose([product, centred], MAX_ROWS)
    assert plan.modes["centred"] is RowMode.ROW_BY_ROW
    assert plan.modes["gate_up"] in (RowMode.SINGLE_ROW_BATCH, RowMode.ROW_BY_ROW)
    assert "guarded fallback" in plan.describe() and "centred one row per call" in plan.describe()
    assert_rows_as_alone([centred], plan)
    # The single-row batch is the plain product row by row (the mixing call is never used).
    g = torch.Generator().manual_seed(3)
    x = torch.randn(5, 32, generator=g)
    assert torch.allclose(run_step(product, x, plan.tile), F.linear(x, weight), atol=1e-5)


def test_a_norm_that_fails_at_every_tile_runs_on_the_live_rows() -> None:
    """A function whose rows depend on their position at every tile's row count (but not inside a call of
    any other count) runs once on the live rows, not one call per row, and still matches."""
    weight = torch.ones(32)

    def tile_sensitive_norm(x: torch.Tensor) -> torch.Tensor:
        y = torch.rms_norm(x, [32], weight, 1e-6)
        if x.shape[0] in ROW_TILES:  # another kernel from the second row on, as MKL's at some counts
            y[1:] = torch.nextafter(y[1:], torch.full_like(y[1:], 1e30))
        return y

    norm = RowWise("input_norm", tile_sensitive_norm, 32, torch.float32)
    plan = RowPlan.choose([norm], 3)  # batches of at most 3 rows: below every tile's row count
    assert plan.modes == {"input_norm": RowMode.LIVE_ROWS}
    assert "input_norm in one call on the live rows" in plan.describe()


def test_refusals_name_the_variable_and_the_allowed_values(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(REFUSE_ENV, "tiled, single-row-batch")
    assert refused_modes() == {RowMode.TILED, RowMode.SINGLE_ROW_BATCH}
    monkeypatch.setenv(REFUSE_ENV, "fast")
    with pytest.raises(
        ValueError, match=rf"{REFUSE_ENV}.*'fast'.*allowed: tiled, live-rows, single-row-batch"
    ):
        refused_modes()


def test_row_padding_copies_rows_into_a_kept_buffer() -> None:
    pad = RowPadding()
    first = pad(torch.ones(2, 3), 4)
    assert first.shape == (4, 3) and torch.equal(first[:2], torch.ones(2, 3))
    second = pad(torch.full((2, 3), 7.0), 4)
    assert second.data_ptr() == first.data_ptr() and torch.equal(second[:2], torch.full((2, 3), 7.0))
    wide = torch.zeros(5, 3)
    assert pad(wide, 4) is wide  # enough rows: no copy
