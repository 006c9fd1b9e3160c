"""code2wav's vocoder process (engine/pipelines/qwen_omni/vocoder_process.py, docs/speech.md "The vocoder
on the second core"): a child process with the model's BigVGAN gives this process's samples bit for bit,
its start-up check refuses a child whose samples differ, and a failed child raises for the caller to
vocode in process. The scheduler's use of it: tests/test_dit_batch.py."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from engine.models import describe_model, materialize
from engine.pipelines.qwen_omni.vocoder_process import VocoderProcess, load_vocoder


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


def _mel(vocoder: torch.nn.Module, frames: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn((1, int(vocoder.config.mel_dim), frames), generator=generator)


def test_the_vocoder_process_gives_this_process_samples(model_path, one_thread):
    local = load_vocoder(model_path)
    process = VocoderProcess.start(model_path, 1, local)
    assert process is not None
    try:
        for frames, seed in ((40, 1), (64, 2), (77, 3), (1, 4)):
            mel = _mel(local, frames, seed)
            samples = process.render(mel)
            assert samples.dtype == torch.float32 and samples.shape == (frames * 240,)
            assert torch.equal(samples, local(mel).reshape(-1))
    finally:
        process.close()


def test_a_process_whose_samples_differ_is_not_used_and_a_dead_one_raises(model_path, one_thread):
    local = load_vocoder(model_path)
    nudged = copy.deepcopy(local)
    with torch.no_grad():
        next(nudged.parameters()).add_(1e-3)  # another vocoder than the child's
    assert VocoderProcess.start(model_path, 1, nudged) is None
    process = VocoderProcess.start(model_path, 1, local)
    assert process is not None
    process._child.kill()
    process._child.wait()
    with pytest.raises((RuntimeError, OSError, EOFError)):
        process.render(_mel(local, 40, 5))
    process.close()
