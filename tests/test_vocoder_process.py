"""code2wav's vocoder process (engine/pipelines/qwen_omni/vocoder_process.py, docs/speech.md "The vocoder
on the second core"): a child process with the model's BigVGAN gives this process's samples bit for bit,
alone and in the batches its check allows, its start-up check refuses a child whose samples differ, and a
failed child raises for the caller to vocode in process. The scheduler's use of it: tests/test_dit_batch.py."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from engine.models import describe_model, materialize
from engine.pipelines.qwen_omni.bigvgan_cpu import Vocoder, batch_holds, chunk_vocoder
from engine.pipelines.qwen_omni.vocoder_process import VocoderProcess, load_vocoder

MELS = 80  # the tiny model's mel bins


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> Path:
    source = materialize(describe_model("tiny-qwen-omni"), tmp_path_factory.mktemp("models"))
    assert source.path is not None
    return source.path


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


def test_the_vocoder_process_gives_this_process_samples_alone_and_in_batches(model_path, one_thread):
    local: Vocoder = chunk_vocoder(load_vocoder(model_path))
    process = VocoderProcess.start(model_path, 1, local, MELS, (64, 77), 3)
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
    finally:
        process.close()


def test_a_process_whose_samples_differ_is_not_used_and_a_dead_one_raises(model_path, one_thread):
    module = load_vocoder(model_path)
    local = chunk_vocoder(module)
    nudged_module = copy.deepcopy(module)
    with torch.no_grad():
        next(nudged_module.parameters()).add_(1e-3)  # another vocoder than the child's
    assert VocoderProcess.start(model_path, 1, chunk_vocoder(nudged_module), MELS) is None
    process = VocoderProcess.start(model_path, 1, local, MELS)
    assert process is not None
    process._child.kill()
    process._child.wait()
    with pytest.raises((RuntimeError, OSError, EOFError)):
        process.render(_mel(40, 5))
    process.close()
