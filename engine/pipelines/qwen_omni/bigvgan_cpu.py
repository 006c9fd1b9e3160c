"""BigVGAN for streamed chunks on a CPU: the checkpoint's weights, kernels that do not waste the core, and
a batch of chunks whose bits are each chunk's alone (docs/speech.md, "BigVGAN on the CPU").

transformers' ``Qwen2_5OmniToken2WavBigVGANModel`` spends most of a chunk in its anti-aliased activations
(every AMP block's six, and one before the last convolution): each upsamples by two with a 12-tap
transposed convolution grouped by channel, applies SnakeBeta, and downsamples with a 12-tap strided
convolution grouped by channel. PyTorch runs those grouped filters on its slow paths (about one multiply-add
a nanosecond on a core that does dozens), and pads by replication in a slow kernel. :class:`CpuBigVGAN`
computes the same functions from the same weights:

- each filter as a product with a small banded matrix over blocks of :data:`BLOCK` samples (a block of the
  upsampled signal reads its block of the input and three samples either side; a block of the downsampled
  one twice its length and its filter's reach): one matrix product per filter for every channel and chunk;
- the upsampling filter's two phases at once (the transposed convolution's zero-stuffing never computed),
  its gain folded into the matrix, and SnakeBeta's ``exp(alpha)`` and ``1 / (exp(beta) + eps)`` computed once;
- the dense convolutions (the blocks' dilated ones, the first and last) and the upsampling layers (as one
  convolution over their stride's phases, then interleaved) through oneDNN, alone and in a batch alike.

A chunk's samples are the library's to float rounding (at most ~1e-6 of a waveform whose RMS is ~0.03 in
the tiny model; tested), about three times faster alone. Windows of one length run as one batch; each
window's signal is padded to whole blocks, so every element-wise call sees whole vectors of every window
and the rows of a product are the only place the batch could change a window's bits: :func:`batch_holds`
checks on the running thread's kernels that it does not, and where it does, windows render one by one.

Only for float32 on the CPU: anything else keeps the library's module (:func:`chunk_vocoder`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812  # the usual name

BLOCK = 16  # samples of a filter's output per block (the fastest of 16 / 32 / 64 measured, docs/speech.md)
_convolution = torch.ops.aten.mkldnn_convolution  # oneDNN's, whatever the batch (F.conv1d picks by batch)

Vocoder = Callable[
    [torch.Tensor], torch.Tensor
]  # mels (batch, mels, frames) -> samples (batch, n) float32, CPU


def _replicate(x: torch.Tensor, left: int, right: int) -> torch.Tensor:
    """``x`` (..., T) with its first sample repeated ``left`` times before it and its last ``right``
    times after it (what ``F.pad(mode="replicate")`` gives, in one copy)."""
    shape = x.shape[:-1]
    return torch.cat([x[..., :1].expand(*shape, left), x, x[..., -1:].expand(*shape, right)], dim=-1)


def _blocks(length: int) -> int:
    return -(-length // BLOCK)


class _Convolution:
    """A ``Conv1d`` (stride 1) through oneDNN."""

    def __init__(self, module: torch.nn.Conv1d) -> None:
        self.weight = module.weight.detach().contiguous()
        self.bias = None if module.bias is None else module.bias.detach().contiguous()
        self.padding = [int(module.padding[0])]
        self.dilation = [int(module.dilation[0])]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return _convolution(x.contiguous(), self.weight, self.bias, self.padding, [1], self.dilation, 1)


class _Upsampling:
    """A ``ConvTranspose1d`` (no output padding) as one convolution over its stride's phases: output
    channel ``c * stride + r`` holds the samples at ``r`` modulo the stride; interleaved, then cut."""

    def __init__(self, module: torch.nn.ConvTranspose1d) -> None:
        weight = module.weight.detach()  # (in, out, kernel)
        inputs, outputs, kernel = weight.shape
        stride, padding = int(module.stride[0]), int(module.padding[0])
        taps = -(-kernel // stride)
        phases = torch.zeros(outputs, stride, inputs, taps, dtype=weight.dtype)
        for phase in range(stride):
            for tap in range(taps):
                index = phase + stride * (taps - 1 - tap)
                if index < kernel:
                    phases[:, phase, :, tap] = weight[:, :, index].t()
        self.weight = phases.reshape(outputs * stride, inputs, taps).contiguous()
        bias = module.bias
        self.bias = None if bias is None else bias.detach().repeat_interleave(stride).contiguous()
        self.outputs, self.stride, self.padding, self.kernel, self.taps = (
            outputs,
            stride,
            padding,
            kernel,
            taps,
        )

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        frames = x.shape[-1]
        length = (frames - 1) * self.stride - 2 * self.padding + self.kernel
        first = self.padding // self.stride  # the first phase column the output reads
        columns = (self.padding + length - 1) // self.stride + 1 - first
        # Column m of the full correlation reads inputs m - (taps - 1) .. m, zero outside the signal.
        low, high = first - (self.taps - 1), first + columns
        part = x[..., max(low, 0) : min(high, frames)]
        if low < 0 or high > frames:
            part = F.pad(part, (max(0, -low), max(0, high - frames)))
        out = _convolution(part.contiguous(), self.weight, self.bias, [0], [1], [1], 1)
        batch = x.shape[0]
        out = out.view(batch, self.outputs, self.stride, columns).transpose(2, 3)
        out = out.reshape(batch, self.outputs, columns * self.stride)
        start = self.padding - first * self.stride
        return out[..., start : start + length]


class _AntiAliasedSnake:
    """``Qwen2_5OmniAntiAliasedActivation1d`` over SnakeBeta: upsample by two, SnakeBeta, downsample by
    two, each filter a product over blocks (the module's docstring)."""

    def __init__(self, module: Any) -> None:
        up, down, snake = module.upsample, module.downsample, module.act
        if (up.ratio, up.kernel_size, down.stride, down.kernel_size) != (2, 12, 2, 12):
            raise ValueError("only the 2x, 12-tap anti-aliasing filters of Qwen2.5-Omni's BigVGAN")
        up_taps = up.filter.detach().reshape(-1) * up.ratio  # the library scales the upsampled signal
        down_taps = down.filter.detach().reshape(-1)
        # Upsampled sample m reads input n where m + 5 - 2n is a tap (the library's replicate padding of
        # 5 and its cut of 15): a block of 2 * BLOCK outputs from its BLOCK inputs and 3 either side.
        self.up = torch.zeros(BLOCK + 6, 2 * BLOCK)
        for m in range(2 * BLOCK):
            for n in range(-3, BLOCK + 3):
                tap = m + 5 - 2 * n
                if 0 <= tap < 12:
                    self.up[n + 3, m] = up_taps[tap]
        # Downsampled sample j reads upsampled 2j - 5 + tap (replicate padding of 5 and 6).
        self.down = torch.zeros(2 * BLOCK + 11, BLOCK)
        for j in range(BLOCK):
            for tap in range(12):
                self.down[2 * j + tap, j] = down_taps[tap]
        channels = snake.alpha.shape[0]
        self.alpha = torch.exp(snake.alpha.detach()).reshape(channels, 1)
        self.inverse_beta = (1.0 / (torch.exp(snake.beta.detach()) + snake.no_div_by_zero)).reshape(
            channels, 1
        )

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        batch, channels, frames = x.shape
        blocks = _blocks(frames)
        padded = blocks * BLOCK
        # The input past its end repeats its last sample, as the library's padding does: the outputs up
        # to its end read the same values.
        rows = _replicate(x, 3, padded - frames + 3).unfold(-1, BLOCK + 6, BLOCK).reshape(-1, BLOCK + 6)
        up = torch.mm(rows, self.up).view(
            batch, channels, 2 * padded
        )  # whole blocks: no element-wise call has a tail
        wave = torch.sin(up * self.alpha)
        up = up + self.inverse_beta * (wave * wave)
        # Past 2 * frames the downsampling filter reads the last real sample (replicate padding).
        signal = _replicate(up[..., : 2 * frames], 5, 2 * (padded - frames) + 6)
        rows = signal.unfold(-1, 2 * BLOCK + 11, 2 * BLOCK).reshape(-1, 2 * BLOCK + 11)
        return torch.mm(rows, self.down).view(batch, channels, padded)[..., :frames]


class CpuBigVGAN:
    """The model's BigVGAN (``Qwen2_5OmniToken2WavBigVGANModel``) over a batch of mels (batch, mels,
    frames) -> samples (batch, frames * hop), float32 on the CPU."""

    def __init__(self, module: Any) -> None:
        self.module = module  # for its mel normalisation and config
        self.config = module.config
        self.pre = _Convolution(module.conv_pre)
        self.ups = [_Upsampling(layer[0]) for layer in module.ups]
        self.residuals = int(module.num_residual_blocks)
        self.blocks = []
        for block in module.resblocks:
            activations = [_AntiAliasedSnake(a) for a in block.activations]
            convolutions = zip(block.convs1, block.convs2, activations[::2], activations[1::2], strict=True)
            self.blocks.append(
                [(_Convolution(c1), _Convolution(c2), a1, a2) for c1, c2, a1, a2 in convolutions]
            )
        self.post_activation = _AntiAliasedSnake(module.activation_post)
        self.post = _Convolution(module.conv_post)

    def __call__(self, mels: torch.Tensor) -> torch.Tensor:
        x = self.pre(self.module.process_mel_spectrogram(mels))
        for layer, up in enumerate(self.ups):
            x = up(x)
            total: torch.Tensor | None = None
            for block in self.blocks[layer * self.residuals : (layer + 1) * self.residuals]:
                h = x
                for convolution1, convolution2, activation1, activation2 in block:
                    h = h + convolution2(activation2(convolution1(activation1(h))))
                total = h if total is None else total + h
            assert total is not None
            x = total / self.residuals
        x = self.post(self.post_activation(x))
        return torch.clamp(x, min=-1.0, max=1.0).reshape(x.shape[0], -1)


def chunk_vocoder(module: Any) -> Vocoder:
    """What renders streamed chunks' mels (batch, mels, frames) to samples (batch, n): :class:`CpuBigVGAN`
    for a float32 model on the CPU, else the library's module (one window at a time)."""
    parameter = next(module.parameters())
    if parameter.device.type == "cpu" and parameter.dtype == torch.float32:
        try:
            return CpuBigVGAN(module)
        except ValueError:  # other anti-aliasing filters than Qwen2.5-Omni's
            pass

    def library(mels: torch.Tensor) -> torch.Tensor:
        return torch.stack([module(mel[None]).reshape(-1).float().cpu() for mel in mels])

    return library


def batch_holds(vocoder: Vocoder, mels: int, frames: int, max_batch: int, seed: int = 0) -> bool:
    """Whether, on the running thread's kernels, a batch of up to ``max_batch`` windows of ``frames`` mel
    frames gives each window its samples alone, bit for bit, at every position among random others."""
    generator = torch.Generator().manual_seed(seed)
    windows = torch.randn((max_batch, mels, frames), generator=generator) - 5.0  # log-mel scale
    alone = [vocoder(windows[i : i + 1])[0] for i in range(max_batch)]
    for size in range(2, max_batch + 1):
        order = [(size + i) % max_batch for i in range(size)]
        out = vocoder(windows[order])
        if not all(torch.equal(out[row], alone[index]) for row, index in enumerate(order)):
            return False
    return True
