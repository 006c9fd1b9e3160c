"""code2wav's DiT over a batch of windows, each row with the bits it gets alone (docs/speech.md, "Many
listeners").

transformers' ``Qwen2_5OmniToken2WavDiTModel.forward`` recomputes, at every one of an ODE's evaluations,
what does not change during it: the speaker encoder (an ECAPA-TDNN over the voice's reference mel), the
codes' embeddings, the rotary tables and the block masks. And some of its products see the batch's row
count where a window alone sees two rows (the time embedding and every layer's modulation, functions of
the ODE's time only), so a window's bits in a batch would not be its bits alone. :class:`BatchedFlow` runs
the same modules op for op, but:

- what depends on the window only (:class:`DiTWindow`: ECAPA, code embeddings, speaker rows) is computed
  once per chunk, alone;
- what depends on the time only (time embedding, the layers' shift/scale/gate) is computed on the two
  rows (one without guidance) a window alone uses, once per ODE time point (the time grid is the same for
  every window, so it is kept: :meth:`BatchedFlow._time_rows`), and broadcast to every window's rows, as
  are the rotary tables (every window's frames count from 0);
- the rest (the input projection, attention, the MLPs: products over ``rows x frames``, norms,
  element-wise) runs once for all windows of one length. Those products see another row count in a batch,
  so :func:`batch_holds` checks on the running machine (its thread, its kernels) that a batch gives every
  window its alone bits before the scheduler batches windows of that length; where it does not, each
  window is integrated alone.

A window may end in padding (a streamed utterance's last chunk, padded to a whole attention block so the
last chunks of several streams share a length): its padded frames are masked out of its real frames'
attention, the only place the DiT mixes frames, so they change nothing but rounding in the real ones
(padded frames attend to their own block neighbourhood and are never read).

Alone (one window without padding), the result is the library's forward bit for bit (tested), so a whole
render through it still equals the one-shot ``generate``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

SWAY_COEFFICIENT = -1.0  # token2wav's time warp toward the start (its default)
ADDITIVE_MASKS_KEPT = 16  # batch shapes whose attention masks are kept made
TIME_ROWS_KEPT = 256  # ODE time points whose modulations are kept made, at most (a 10-step grid has 40)


def time_points(steps: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The ODE's time grid: ``steps`` points from 0 to 1, swayed toward the start as token2wav does."""
    times = torch.linspace(0, 1, steps, device=device, dtype=dtype)
    times += SWAY_COEFFICIENT * (torch.cos(math.pi / 2 * times) - 1 + times)
    return times


class Modulation(NamedTuple):
    """One DiT layer's modulation at a time point (``BatchedFlow._time_rows``): its norms' scales (as
    ``1 + scale``) and shifts, and its gates."""

    scale_msa: torch.Tensor
    shift_msa: torch.Tensor
    gate_msa: torch.Tensor
    scale_mlp: torch.Tensor
    shift_mlp: torch.Tensor
    gate_mlp: torch.Tensor


@dataclass
class DiTWindow:
    """One chunk's window, ready for the flow: its starting noise and what conditions it (constant over the
    ODE). ``cfg``: classifier-free guidance (two rows: conditioned and unconditioned)."""

    start: torch.Tensor  # (1, frames, mels) noise
    condition: torch.Tensor  # (rows, frames, enc + emb + spk) what the input projection reads besides x
    guidance: float
    steps: int
    cfg: bool
    real: int | None = None  # frames before the padding (None: no padding)

    @property
    def frames(self) -> int:
        return int(self.start.shape[1])

    @property
    def real_frames(self) -> int:
        return self.frames if self.real is None else self.real

    @property
    def key(self) -> tuple[int, int, float, bool]:
        """Windows with equal keys can share a batch (same length, time grid and guidance)."""
        return (self.frames, self.steps, self.guidance, self.cfg)


class BatchedFlow:
    """The DiT's flow from noise to mel for several windows at once (module docstring)."""

    def __init__(self, dit: Any) -> None:
        from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import RungeKutta4ODESolver

        self.dit = dit
        self._solver = RungeKutta4ODESolver
        self._rotary: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # by frames
        self._masks: dict[int, list[torch.Tensor]] = {}
        # Additive masks (0 where a frame attends, -inf where not), by (frames, each window's padding,
        # rows per window).
        self._additive: dict[tuple[int, tuple[int | None, ...], int], list[torch.Tensor]] = {}
        # The modulations at an ODE time point, by (the time's value, rows per window).
        self._times: dict[tuple[float, int], tuple[list[Modulation], tuple[torch.Tensor, torch.Tensor]]] = {}

    # -- per window ---------------------------------------------------------------------------------------
    def voice(self, reference: torch.Tensor, cfg: bool) -> torch.Tensor:
        """The speaker encoder's output for a voice's reference mel: (2, enc) with guidance (the
        reference, then silence), else (1, enc); computed as a window alone computes it."""
        rows = torch.cat([reference, torch.zeros_like(reference)], dim=0) if cfg else reference
        return self.dit.input_embed.spk_encoder(rows)

    def window(
        self,
        codes: torch.Tensor,
        speaker: torch.Tensor,
        voice: torch.Tensor,
        start: torch.Tensor,
        guidance: float,
        steps: int,
        real: int | None = None,
    ) -> DiTWindow:
        """A window of ``codes`` (1, n) from noise ``start`` (1, n * repeats, mels) for the speaker
        embedding ``speaker`` (1, E) and its :meth:`voice` output ``voice``; with ``real``, only its first
        ``real`` frames are the utterance's (the rest is padding, masked out of their attention)."""
        dit = self.dit
        cfg = guidance >= 1e-5
        frames = int(start.shape[1])
        speaker_rows = speaker.unsqueeze(1).repeat(1, frames, 1)
        code_rows = dit.text_embed(codes, drop_code=False)
        if cfg:
            speaker_rows = torch.cat([speaker_rows, torch.zeros_like(speaker_rows)], dim=0)
            code_rows = torch.cat([code_rows, dit.text_embed(codes, drop_code=True)], dim=0)
        voice_rows = voice.unsqueeze(1).repeat(1, frames, 1)
        condition = torch.cat((voice_rows, code_rows, speaker_rows), dim=-1)
        padded = real is not None and real < frames
        return DiTWindow(start, condition, float(guidance), int(steps), cfg, real if padded else None)

    # -- per length / per time --------------------------------------------------------------------------
    def _rotary_for(self, frames: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The rotary tables of ``frames`` frames, (1, frames, dim) each: a window's frames count from 0,
        so one row serves (broadcast) every row of a batch."""
        if frames not in self._rotary:
            positions = torch.arange(frames, device=like.device)[None, :]
            self._rotary[frames] = self.dit.rotary_embed(like[:1], positions)
        return self._rotary[frames]

    def _masks_for(self, frames: int, like: torch.Tensor) -> list[torch.Tensor]:
        """Each layer's block mask (1, 1, frames, frames), the same for every head: who attends to whom
        in a window. Layers with the same reach share one tensor."""
        if frames not in self._masks:
            difference = self.dit._create_block_diff(like[:1])[:, :1]  # (1, 1, frames, frames)
            reach: dict[tuple[float, float], torch.Tensor] = {}
            for layer in self.dit.transformer_blocks:
                back, ahead = float(layer.look_backward_block), float(layer.look_ahead_block)
                if (back, ahead) not in reach:
                    reach[(back, ahead)] = (difference >= -back) & (difference <= ahead)
            self._masks[frames] = [
                reach[(float(layer.look_backward_block), float(layer.look_ahead_block))]
                for layer in self.dit.transformer_blocks
            ]
        return self._masks[frames]

    def _window_masks(
        self, frames: int, real: Sequence[int | None], per_window: int, like: torch.Tensor
    ) -> list[torch.Tensor]:
        """Each layer's attention mask for a batch of ``per_window`` rows per window (rows ordered as
        :meth:`forward` orders them): the block mask, and in a padded window its real frames attend to
        real frames only. Additive (0 or -inf: what torch's attention makes of a boolean mask at every
        call), made once per batch shape, broadcast over the heads."""
        key = (frames, tuple(real), per_window)  # the windows' count and padding, the rows' count
        if key not in self._additive:
            heads = int(self.dit.transformer_blocks[0].attn.heads)
            keep = None  # (windows, 1, frames, frames): a padded window's real frames see real frames only
            if any(r is not None for r in real):
                position = torch.arange(frames, device=like.device)
                rows_real = [position < (frames if r is None else r) for r in real]
                # Padded frames keep their block neighbourhood (never NaN, never read).
                keep = torch.stack([r[None, :] | ~r[:, None] for r in rows_real])[:, None]
            made: dict[int, torch.Tensor] = {}  # one additive mask per distinct block mask
            for block in self._masks_for(frames, like):
                if id(block) in made:
                    continue
                mask = block if keep is None else (block & keep).repeat(per_window, 1, 1, 1)
                additive = torch.zeros(mask.shape, dtype=like.dtype, device=like.device)
                made[id(block)] = additive.masked_fill_(~mask, float("-inf"))
            if len(self._additive) >= ADDITIVE_MASKS_KEPT:
                self._additive.pop(next(iter(self._additive)))  # the oldest batch shape
            rows = per_window * len(real)
            self._additive[key] = [
                made[id(block)].expand(rows, heads, -1, -1) for block in self._masks_for(frames, like)
            ]
        return self._additive[key]

    def _time_rows(
        self, time: torch.Tensor, per_window: int
    ) -> tuple[list[Modulation], tuple[torch.Tensor, torch.Tensor]]:
        """The layers' and the final norm's modulations at ``time``, from the time embedding on
        ``per_window`` rows (as a window alone), each (per_window, 1, 1, width) to broadcast over a batch
        grouped as (per_window, windows, frames, width); scales as ``1 + scale``. Made once per time point
        (the same for every window and batch of a time grid) and kept."""
        key = (float(time), per_window)
        kept = self._times.get(key)
        if kept is not None:
            return kept
        dit = self.dit
        embedding = dit.time_embed(time.repeat(per_window))

        def grouped(rows: torch.Tensor) -> torch.Tensor:
            return rows[:, None, None, :]

        layers = []
        for layer in dit.transformer_blocks:
            norm = layer.attn_norm
            chunks = torch.chunk(norm.linear(norm.silu(embedding)), 6, dim=1)
            shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = (grouped(c) for c in chunks)
            layers.append(Modulation(1 + scale_msa, shift_msa, gate_msa, 1 + scale_mlp, shift_mlp, gate_mlp))
        final = dit.norm_out
        scale, shift = torch.chunk(final.linear(final.silu(embedding)), 2, dim=1)
        if len(self._times) >= TIME_ROWS_KEPT:
            self._times.clear()  # one call (a vocoder thread may integrate beside the scheduler's)
        made = layers, (1 + grouped(scale), grouped(shift))
        self._times[key] = made
        return made

    # -- the flow -----------------------------------------------------------------------------------------
    def forward(
        self,
        time: torch.Tensor,
        state: torch.Tensor,
        condition: torch.Tensor,
        cfg: bool,
        real: Sequence[int | None] | None = None,
    ) -> torch.Tensor:
        """The DiT's output for ``state`` (windows, frames, mels) at ``time`` (a 0-d tensor):
        (rows, frames, mels), the conditioned rows of every window, then (with ``cfg``) their
        unconditioned rows, as ``dit(..., apply_cfg=cfg)`` orders them. ``real``: each window's frames
        before its padding (None: none)."""
        dit = self.dit
        windows, frames = int(state.shape[0]), int(state.shape[1])
        per_window = 2 if cfg else 1
        rows = per_window * windows
        # Row r of the batch is row r // windows of a window alone (its conditioned or unconditioned row):
        # grouped as (per_window, windows, frames, width), a window alone's modulation rows broadcast over
        # the windows, element by element the products and sums a window alone computes.
        layers, (scale, shift) = self._time_rows(time, per_window)
        x = torch.cat([state, state], dim=0) if cfg else state
        hidden = dit.input_embed.proj(torch.cat((x, condition), dim=-1))
        grouped = (per_window, windows, frames, int(hidden.shape[-1]))
        position = self._rotary_for(frames, hidden)  # the same for every row (frames count from 0)
        masks = self._window_masks(frames, real or [None] * windows, per_window, hidden)

        def modulated(x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
            return (x.view(grouped) * scale + shift).view(rows, frames, -1)

        def gated(gate: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
            return (gate * x.view(grouped)).view(rows, frames, -1)

        for layer, mod, mask in zip(dit.transformer_blocks, layers, masks, strict=True):
            norm = modulated(layer.attn_norm.norm(hidden), mod.scale_msa, mod.shift_msa)
            attention = layer.attn(
                hidden_states=norm,
                position_embeddings=position,
                attention_mask=mask,
            )
            hidden = hidden + gated(mod.gate_msa, attention)
            norm = modulated(layer.ff_norm(hidden), mod.scale_mlp, mod.shift_mlp)
            hidden = hidden + gated(mod.gate_mlp, layer.ff(norm))
        hidden = modulated(dit.norm_out.norm(hidden), scale, shift)
        return dit.proj_out(hidden)

    def velocity(
        self, windows: Sequence[DiTWindow], check: Callable[[], None] | None = None
    ) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
        """The ODE's right-hand side for ``windows`` (equal :attr:`DiTWindow.key`); ``check`` runs before
        every evaluation (a cancel check)."""
        first = windows[0]
        cfg, guidance = first.cfg, first.guidance
        count = len(windows)
        real = [w.real for w in windows]
        if cfg:
            condition = torch.cat(
                [w.condition[:1] for w in windows] + [w.condition[1:2] for w in windows], dim=0
            )
        else:
            condition = torch.cat([w.condition for w in windows], dim=0)

        def velocity(time: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
            if check is not None:
                check()
            out = self.forward(time, state, condition, cfg, real)
            if not cfg:
                return out
            guided, unguided = out[:count], out[count:]
            return guided + (guided - unguided) * guidance

        return velocity

    def integrate(
        self, windows: Sequence[DiTWindow], check: Callable[[], None] | None = None
    ) -> torch.Tensor:
        """The mels (windows, mels, frames) of ``windows`` (equal :attr:`DiTWindow.key`)."""
        keys = {w.key for w in windows}
        if len(keys) != 1:
            raise ValueError(
                f"windows of one batch must share frames, steps and guidance; got {sorted(keys)}"
            )
        first = windows[0]
        start = torch.cat([w.start for w in windows], dim=0)
        times = time_points(first.steps, start.dtype, start.device)
        solver = self._solver(function=self.velocity(windows, check), initial_value=start)
        return solver.integrate(times)[-1].permute(0, 2, 1)


def random_windows(
    flow: BatchedFlow, frames: int, cfg: bool, count: int, generator: torch.Generator
) -> list[DiTWindow]:
    """``count`` random windows of ``frames`` mel frames (codes, noise, speaker, reference; every other
    one padded from a random frame), two ODE time points each: what the checks render."""
    dit = flow.dit
    config = dit.config
    parameter = next(dit.parameters())
    device, dtype = parameter.device, parameter.dtype
    repeats = int(dit.repeats)
    codes_per_window = max(1, frames // repeats)
    guidance = 0.5 if cfg else 0.0

    def random(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=generator).to(device, dtype)

    windows = []
    for index in range(count):
        codes = torch.randint(0, int(config.num_embeds), (1, codes_per_window), generator=generator).to(
            device
        )
        reference = random(1, 24, int(config.mel_dim))
        speaker = random(1, int(config.enc_emb_dim))
        voice = flow.voice(reference, cfg)
        noise = random(1, codes_per_window * repeats, int(config.mel_dim))
        # Every other window ends in padding (a last chunk's), from a random frame on.
        real = None if index % 2 == 0 else int(torch.randint(1, noise.shape[1] + 1, (), generator=generator))
        windows.append(flow.window(codes, speaker, voice, noise, guidance, 2, real))
    return windows


def batch_holds(flow: BatchedFlow, frames: int, cfg: bool, max_batch: int, seed: int = 0) -> bool:
    """Whether, on the running thread's kernels, a batch of up to ``max_batch`` windows of ``frames`` mel
    frames gives each window the bits of one DiT evaluation alone, at every position, among random others.

    Random windows (:func:`random_windows`); each batch size from 2 up is tried with the windows rotated,
    so every window sits at several positions."""
    generator = torch.Generator().manual_seed(seed)
    windows = random_windows(flow, frames, cfg, max_batch, generator)
    parameter = next(flow.dit.parameters())
    time = torch.rand((), generator=generator).to(parameter.device, parameter.dtype)
    alone = [flow.velocity([w])(time, w.start) for w in windows]
    for size in range(2, max_batch + 1):
        order = [(size + i) % max_batch for i in range(size)]
        batch = [windows[i] for i in order]
        state = torch.cat([w.start for w in batch], dim=0)
        out = flow.velocity(batch)(time, state)
        for row, index in enumerate(order):
            if not torch.equal(out[row : row + 1], alone[index]):
                return False
    return True
