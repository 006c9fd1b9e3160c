"""code2wav's second process (engine/pipelines/qwen_omni/code2wav_process.py, docs/speech.md "The second
process"): a child process with the model's token2wav gives this process's samples and DiT mels bit for
bit, alone and in batches, its start-up check refuses a child whose samples or mels differ, and a failed
child raises for the caller to render in process. The scheduler's use of it: tests/test_dit_batch.py."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from engine.models import describe_model, materialize
from engine.pipelines.qwen_omni.bigvgan_cpu import Vocoder, batch_holds, chunk_vocoder
from engine.pipelines.qwen_omni.code2wav_process import Code2WavProcess, load_token2wav
from engine.pipelines.qwen_omni.dit_batch import BatchedFlow, random_windows

MELS = 80  # the tiny model's mel bins


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> Path:
    source = materialize(describe_model("tiny-qwen-omni"), tmp_path_factory.mktemp("models"))
    assert source.path is not None
    return source.path


@pytest.fixture(scope="module")
def token2wav(model_path) -> torch.nn.Module:
    return load_token2wav(model_path)


@pytest.fixture
def one_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # code2wav's intra-op threads: the kernels the child runs too
    try:
        with torch.inference_mode():
            yield
    finally:
        torch.set_num_threads(before)


def _mel(frames: int, seed: int, batch: int = 1) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn((batch, MELS, frames), generator=generator) - 5.0


def test_the_code2wav_process_gives_this_process_samples_and_mels_alone_and_in_batches(
    model_path, token2wav, one_thread
):
    local: Vocoder = chunk_vocoder(token2wav.code2wav_bigvgan_model)
    flow = BatchedFlow(token2wav.code2wav_dit_model)
    process = Code2WavProcess.start(model_path, 1, local, flow, (64, 77), 3, 3)
    assert process is not None
    try:
        for frames, seed in ((40, 1), (64, 2), (77, 3), (1, 4)):
            mel = _mel(frames, seed)
            samples = process.render(mel)
            assert samples.dtype == torch.float32 and samples.shape == (1, frames * 240)
            assert torch.equal(samples, local(mel))
        # The lengths it batches are those whose check holds on this machine (it runs the same check).
        assert process.batch_frames == {f for f in (64, 77) if batch_holds(local, MELS, f, 3)}
        for frames in process.batch_frames:
            mels = _mel(frames, 5, batch=3)
            samples = process.render(mels)
            assert samples.shape == (3, frames * 240)
            for row in range(3):
                assert torch.equal(samples[row : row + 1], local(mels[row : row + 1])), (frames, row)
        # DiT windows sent together: each window's mel alone here, whether the child batched them or not.
        for cfg in (True, False):
            windows = random_windows(flow, 48, cfg, 3, torch.Generator().manual_seed(6))
            mels = process.integrate(windows)
            assert mels.shape == (3, MELS, 48)
            for row, window in enumerate(windows):
                assert torch.equal(mels[row : row + 1], flow.integrate([window])), (cfg, row)
        # Chunks rendered there end to end: each window's mel, then its frames' samples, as here alone.
        windows = random_windows(flow, 64, True, 3, torch.Generator().manual_seed(8))
        for spans in ([(0, 64), (0, 64), (0, 64)], [(0, 40), (8, 64), (16, 33)]):
            waves = process.render_chunks(windows, spans)
            for window, (low, high), wave in zip(windows, spans, waves, strict=True):
                mel = flow.integrate([window])[:, :, low:high].contiguous()
                assert torch.equal(wave, local(mel)[0]), (low, high)
    finally:
        process.close()


def test_a_process_whose_samples_or_mels_differ_is_not_used_and_a_dead_one_raises(
    model_path, token2wav, one_thread
):
    module = token2wav.code2wav_bigvgan_model
    local = chunk_vocoder(module)
    flow = BatchedFlow(token2wav.code2wav_dit_model)
    nudged_vocoder = copy.deepcopy(module)
    nudged_dit = copy.deepcopy(token2wav.code2wav_dit_model)
    with torch.no_grad():
        next(nudged_vocoder.parameters()).add_(1e-3)  # another vocoder than the child's
        next(nudged_dit.proj_out.parameters()).add_(1e-3)  # another DiT than the child's
    assert Code2WavProcess.start(model_path, 1, chunk_vocoder(nudged_vocoder), flow) is None
    assert Code2WavProcess.start(model_path, 1, local, BatchedFlow(nudged_dit)) is None
    process = Code2WavProcess.start(model_path, 1, local, flow)
    assert process is not None
    process._child.kill()
    process._child.wait()
    with pytest.raises((RuntimeError, OSError, EOFError)):
        process.render(_mel(40, 5))
    process.close()
