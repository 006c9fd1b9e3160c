"""How a batched decode step computes its row-wise functions so that no row's bits depend on the batch.

A decode step applies row-wise functions to all its rows at once: the matrix products (q/k/v, output,
MLP, LM head), the norms and the MLP's activation, each ``(rows, width) -> (rows, ...)``. A row must get
exactly the bits it gets alone (docs/batching.md), but CPU kernels pick their code by the row count
(MKL's sgemm: one kernel for 1 row, others for 2-3 rows, and on Intel's AVX-512 path yet others per
row count) and sometimes by where a row falls in the call (MKL's Intel AVX2 path at 8 rows). So
nothing here rests on one CPU's kernels:

- **Fixed tiles.** Every call of a row-wise function runs on exactly ``tile`` rows: a step pads its
  batch to a multiple of the tile (alone too) and a batch larger than one tile runs tile by tile. The
  kernel therefore never sees another row count, whatever the batch; what is left is the row's position
  inside the tile and the contents of the other rows, which :func:`tile_holds` checks on the running
  machine (the row at every position among random rows vs. at position 0). :data:`ROW_TILES` are tried
  in order, and the first tile at which every function holds is used.
- **Guarded fallbacks that still batch.** A function that does not hold at the chosen tile gets, in
  this order: one call on just the live rows, used when :func:`live_rows_hold` finds every row count
  up to the batch's largest giving each row its alone bits at every position (typically norms and the
  activation, whose kernels work row by row inside a call); for a product, one batched call of
  single-row products (``baddbmm`` over (rows, 1, K): each row its own 1-row product), used when
  :func:`single_row_batches_hold` says a row's product does not change with the number of rows in the
  call; else one call per row (``fn(x[i:i+1])``: the same call alone and batched, identical by
  construction). Every other function of the step (attention over slabs, rotary, residual
  adds) still runs once for all rows.

:class:`RowPlan` is the outcome for one decoder, chosen once on the decode thread (its thread count
picks kernels) and described in words for the System tab and ``/metrics``. ``OMNI_STUDIO_REFUSE_ROW_MODES``
(``tiled``, ``live-rows``, ``single-row-batch``, comma-separated) makes the checks refuse those modes: the tests and
``bench/throughput.py`` use it to run the fallbacks on a machine whose kernels pass.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from functools import partial

import torch
import torch.nn.functional as F

ROW_TILES = (8, 16, 4)
REFUSE_ENV = "OMNI_STUDIO_REFUSE_ROW_MODES"

RowFunction = Callable[[torch.Tensor], torch.Tensor]


class RowMode(StrEnum):
    """How one row-wise function runs for a batch."""

    TILED = "tiled"  # one call per tile of rows
    LIVE_ROWS = "live-rows"  # one call on the live rows, whatever their number
    SINGLE_ROW_BATCH = "single-row-batch"  # products only: one batched call of 1-row products
    ROW_BY_ROW = "row-by-row"  # one call per row


def refused_modes() -> frozenset[RowMode]:
    """The modes ``OMNI_STUDIO_REFUSE_ROW_MODES`` makes the checks refuse (tests and benchmarks)."""
    names = {part.strip() for part in os.environ.get(REFUSE_ENV, "").split(",") if part.strip()}
    refusable = [mode.value for mode in RowMode if mode is not RowMode.ROW_BY_ROW]
    unknown = names - set(refusable)
    if unknown:
        raise ValueError(f"{REFUSE_ENV}: unknown mode(s) {sorted(unknown)}; allowed: {', '.join(refusable)}")
    return frozenset(RowMode(name) for name in names)


class RowPadding:
    """Pads a step's rows to the tile with one copy into a kept buffer (no allocation per call). The rows
    past ``x``'s keep what earlier calls left there: harmless, since :func:`tile_holds` checks a row's
    result among random neighbours. A returned buffer is valid until the next call with the same shapes
    (a step consumes each at once)."""

    def __init__(self) -> None:
        self._buffers: dict[tuple[object, ...], tuple[torch.Tensor, torch.Tensor]] = {}

    def __call__(self, x: torch.Tensor, rows: int) -> torch.Tensor:
        if x.shape[0] >= rows:
            return x
        key = (rows, tuple(x.shape), x.dtype, x.device)
        buffers = self._buffers.get(key)
        if buffers is None:
            whole = x.new_zeros(rows, *x.shape[1:])
            buffers = whole, whole[: x.shape[0]]
            self._buffers[key] = buffers
        buffers[1].copy_(x)
        return buffers[0]


def padded_rows(x: torch.Tensor, rows: int) -> torch.Tensor:
    """``x`` ((n, ...)) with zero rows appended up to ``rows``."""
    if x.shape[0] >= rows:
        return x
    return torch.cat([x, x.new_zeros(rows - x.shape[0], *x.shape[1:])])


def padded_length(rows: int, tile: int) -> int:
    """``rows`` rounded up to a whole number of tiles."""
    return -(-rows // tile) * tile


@dataclass(eq=False)
class RowWise:
    """One row-wise function of a step and how this machine runs it (``mode``, set by :class:`RowPlan`).

    ``fn``: (rows, width) -> (rows, ...); ``weight`` / ``bias``: set for a matrix product
    (``fn(x) == F.linear(x, weight, bias)``), which may then run as single-row products."""

    name: str
    fn: RowFunction
    width: int
    dtype: torch.dtype
    weight: torch.Tensor | None = None
    bias: torch.Tensor | None = None
    device: torch.device | None = None  # where its inputs live (a product: its weight's device)
    mode: RowMode = RowMode.TILED
    tile: int = ROW_TILES[0]
    _weight_t: torch.Tensor | None = field(default=None, repr=False)

    @classmethod
    def product(cls, name: str, weight: torch.Tensor, bias: torch.Tensor | None) -> RowWise:
        return cls(
            name,
            partial(F.linear, weight=weight, bias=bias),
            weight.shape[1],
            weight.dtype,
            weight=weight,
            bias=bias,
            device=weight.device,
        )

    def __call__(self, x: torch.Tensor, live: int) -> torch.Tensor:
        """``x``: the step's rows padded to a multiple of the tile, the first ``live`` real. Returns as
        many rows (those past ``live`` are padding, whatever they hold)."""
        if self.mode is RowMode.TILED:
            tile = self.tile
            if x.shape[0] == tile:
                return self.fn(x)
            return torch.cat([self.fn(x[i : i + tile]) for i in range(0, x.shape[0], tile)])
        if self.mode is RowMode.SINGLE_ROW_BATCH:
            out = self.single_rows(x[:live])
        elif self.mode is RowMode.LIVE_ROWS:
            out = self.fn(x[:live])
        else:
            out = torch.cat([self.fn(x[i : i + 1]) for i in range(live)])
        return padded_rows(out, x.shape[0])

    def single_rows(self, x: torch.Tensor) -> torch.Tensor:
        """Each row of ``x`` ((n, K)) times the weight as its own 1-row product, all in one call."""
        weight = self.weight
        assert weight is not None
        if self._weight_t is None:
            self._weight_t = weight.t().unsqueeze(0)  # (1, K, N), a view
        n = x.shape[0]
        weights = self._weight_t.expand(n, -1, -1)
        rows = x.unsqueeze(1)  # (n, 1, K)
        if self.bias is None:
            out = torch.bmm(rows, weights)
        else:
            out = torch.baddbmm(self.bias.view(1, 1, -1).expand(n, 1, -1), rows, weights)
        return out.squeeze(1)


def _random(generator: torch.Generator, rows: int, f: RowWise) -> torch.Tensor:
    device = f.device or torch.device("cpu")
    return torch.randn(rows, f.width, generator=generator).to(dtype=f.dtype, device=device)


def tile_holds(f: RowWise, tile: int, generator: torch.Generator) -> bool:
    """Whether a call on ``tile`` rows gives a row the same bits at every position among random rows as
    at position 0 among other random rows (what it gets alone, beside stale padding)."""
    probes = _random(generator, 2, f)
    for probe in probes:
        filler = _random(generator, tile, f)
        filler[0] = probe
        alone = f.fn(filler)[0]
        for position in range(tile):
            neighbours = _random(generator, tile, f)
            neighbours[position] = probe
            if not torch.equal(f.fn(neighbours)[position], alone):
                return False
    return True


def _rows_as_alone(
    call: RowFunction, f: RowWise, max_rows: int, generator: torch.Generator, draws: int = 2
) -> bool:
    """Whether ``call`` on ``n`` rows gives each row the bits it gets in a call of its own, for every
    ``n`` up to ``max_rows`` (so at every position), among ``draws`` draws of random neighbours."""
    for _ in range(draws):
        x = _random(generator, max_rows, f)
        alone = [call(x[i : i + 1]) for i in range(max_rows)]
        for n in range(2, max_rows + 1):
            together = call(x[:n])
            if not all(torch.equal(together[i : i + 1], alone[i]) for i in range(n)):
                return False
    return True


def single_row_batches_hold(f: RowWise, max_rows: int, generator: torch.Generator) -> bool:
    """Whether a product's single-row batch gives each row its alone bits at every row count."""
    return f.weight is not None and _rows_as_alone(f.single_rows, f, max_rows, generator)


def live_rows_hold(f: RowWise, max_rows: int, generator: torch.Generator) -> bool:
    """Whether one call on just the live rows gives each row its alone bits at every row count."""
    return _rows_as_alone(f.fn, f, max_rows, generator)


@dataclass
class RowPlan:
    """The tile and each function's mode, chosen by checks on the running machine (:meth:`choose`)."""

    tile: int
    modes: dict[str, RowMode]

    @classmethod
    def choose(cls, functions: Sequence[RowWise], max_rows: int) -> RowPlan:
        """Try each of :data:`ROW_TILES`; take the first at which every function holds, else the one at
        which most do, with the fallbacks for the rest. Sets each function's ``tile`` and ``mode``."""
        refused = refused_modes()
        generator = torch.Generator(device="cpu").manual_seed(0)
        best: tuple[int, set[str]] | None = None
        for tile in ROW_TILES:
            holding = (
                set()
                if RowMode.TILED in refused
                else {f.name for f in functions if tile_holds(f, tile, generator)}
            )
            if best is None or len(holding) > len(best[1]):
                best = tile, holding
            if len(holding) == len(functions):
                break
        assert best is not None
        tile, holding = best
        modes: dict[str, RowMode] = {}
        for f in functions:
            if f.name in holding:
                mode = RowMode.TILED
            elif RowMode.LIVE_ROWS not in refused and live_rows_hold(f, max(max_rows, 2), generator):
                mode = RowMode.LIVE_ROWS  # the cheapest fallback: one kernel call, as tiled
            elif RowMode.SINGLE_ROW_BATCH not in refused and single_row_batches_hold(
                f, max(max_rows, 2), generator
            ):
                mode = RowMode.SINGLE_ROW_BATCH
            else:
                mode = RowMode.ROW_BY_ROW
            modes[f.name] = mode
        plan = cls(tile, modes)
        plan.apply(functions)
        return plan

    def apply(self, functions: Sequence[RowWise]) -> None:
        """Set each function's tile and mode (also for functions of the same shapes that the checks
        stood for: every layer past the checked one)."""
        for f in functions:
            f.tile, f.mode = self.tile, self.modes[f.name]

    @property
    def fallbacks(self) -> dict[str, RowMode]:
        return {name: mode for name, mode in self.modes.items() if mode is not RowMode.TILED}

    def describe(self) -> str:
        """In words, e.g. ``batched, tiles of 8 rows`` or ``batched, tiles of 16 rows; lm_head as
        single-row products in one call``."""
        text = f"batched, tiles of {self.tile} rows"
        fallbacks = self.fallbacks
        if not fallbacks:
            return text
        groups: dict[RowMode, list[str]] = {}
        for name, mode in fallbacks.items():
            groups.setdefault(mode, []).append(name)
        words = {
            RowMode.SINGLE_ROW_BATCH: "as single-row products in one call",
            RowMode.LIVE_ROWS: "in one call on the live rows",
            RowMode.ROW_BY_ROW: "one row per call",
        }
        return (
            text + "; guarded fallback: " + "; ".join(f"{', '.join(n)} {words[m]}" for m, n in groups.items())
        )
