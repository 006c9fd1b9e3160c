"""BigVGAN for streamed chunks on the CPU (engine/pipelines/qwen_omni/bigvgan_cpu.py, docs/speech.md "BigVGAN
on the CPU"): the library's samples to float rounding from its own weights, for both tiny checkpoints and
any window length; a batch of windows gives each its alone samples where the check says so, and the check
catches a vocoder whose bits move with the batch; other dtypes keep the library's module."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from engine.models import describe_model, materialize
from engine.pipelines.qwen_omni.bigvgan_cpu import CpuBigVGAN, batch_holds, chunk_vocoder
from engine.pipelines.qwen_omni.code2wav_process import load_vocoder


@pytest.fixture(scope="module", params=["tiny-qwen-omni", "tiny-qwen-omni-dtmf"])
def module(request, tmp_path_factory) -> torch.nn.Module:
    source = materialize(describe_model(request.param), tmp_path_factory.mktemp("models"))
    assert source.path is not None
    return load_vocoder(Path(source.path))


@pytest.fixture
def one_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # code2wav's intra-op threads
    try:
        with torch.inference_mode():
            yield
    finally:
        torch.set_num_threads(before)


def _mels(module: torch.nn.Module, frames: int, batch: int = 1, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    mels = int(module.config.mel_dim)  # type: ignore[union-attr]
    return torch.randn((batch, mels, frames), generator=generator) - 5.0  # log-mel scale


@pytest.mark.parametrize("frames", [1, 5, 37, 64, 77, 128])
def test_its_samples_are_the_library_bigvgan_samples_to_float_rounding(module, one_thread, frames):
    vocoder = CpuBigVGAN(module)
    mels = _mels(module, frames, seed=frames)
    expected = module(mels).reshape(-1)
    samples = vocoder(mels)
    assert samples.shape == (1, expected.numel()) and samples.dtype == torch.float32
    scale = float(expected.abs().max())
    assert scale > 1e-3  # a waveform, not silence
    difference = float((samples[0] - expected).abs().max())
    assert difference <= 1e-4 * scale, (difference, scale)


def test_a_batch_gives_each_window_its_alone_samples_where_the_check_holds(module, one_thread):
    vocoder = CpuBigVGAN(module)
    mels = _mels(module, 48, batch=3, seed=7)
    batched = vocoder(mels)
    alone = [vocoder(mels[i : i + 1])[0] for i in range(3)]
    if not batch_holds(vocoder, int(module.config.mel_dim), 48, 3):
        pytest.skip("on this machine a batch changes a window's bits: chunks are vocoded one by one")
    for row in range(3):
        assert torch.equal(batched[row], alone[row]), row


def test_the_check_catches_a_vocoder_whose_bits_move_with_the_batch(module, one_thread):
    vocoder = CpuBigVGAN(module)

    def drifting(mels: torch.Tensor) -> torch.Tensor:
        samples = vocoder(mels)
        return samples + samples * (1e-7 * (len(mels) - 1))  # alone: the vocoder's own bits

    assert not batch_holds(drifting, int(module.config.mel_dim), 24, 3)


def test_other_dtypes_keep_the_library_module(module, one_thread):
    double = chunk_vocoder(module.to(torch.float64))
    try:
        assert not isinstance(double, CpuBigVGAN)
        mels = _mels(module, 20, batch=2).double()
        samples = double(mels)
        assert samples.shape == (2, 20 * int(torch.tensor(module.config.upsample_rates).prod()))
        assert torch.equal(samples[1], module(mels[1:2]).reshape(-1).float())
    finally:
        module.float()
    assert isinstance(chunk_vocoder(module), CpuBigVGAN)
