"""A stage in a process of its own (``own_process: true``; docs/batching.md): the same bytes as in this
process, a cancel that reaches it, and a process that dies fails only its jobs."""

from __future__ import annotations

import os
import queue
import signal
import time
from collections.abc import Iterator

import pytest

from engine import GenerationParams, GenerationRequest
from engine.distributed import spawn
from engine.engine import OmniEngine
from engine.events import DiffusionStep, RunFailed, RunFinished, StageFinished
from tests.conftest import REPO_ROOT, _engine, png, tiny_deploy


@pytest.fixture(scope="module")
def process_engine(session_data_dir) -> Iterator[OmniEngine]:
    deploy = tiny_deploy("tiny-glm-image", stage0={"backend": "transformers"}, stage1={"own_process": True})
    engine = _engine("tiny-glm-image", session_data_dir, deploy)
    yield engine
    engine.close()


def t2i(seed: int = 5, **params) -> GenerationRequest:
    return GenerationRequest(
        "a red 'cat' on a mat", GenerationParams(seed=seed, height=64, width=64, **params)
    )


def stage_pid(engine: OmniEngine) -> int:
    return engine.runners[1].placement()[0]["pid"]  # type: ignore[attr-defined]


def submit(engine: OmniEngine, request: GenerationRequest) -> tuple[object, queue.SimpleQueue]:
    events: queue.SimpleQueue = queue.SimpleQueue()
    handle = engine.submit(engine.resolve(request), events.put)
    return handle, events


def wait_for(events: queue.SimpleQueue, kind: type, timeout: float = 120.0):
    deadline = time.monotonic() + timeout
    while True:
        event = events.get(timeout=max(0.01, deadline - time.monotonic()))
        if isinstance(event, (kind, RunFinished, RunFailed)):
            return event


def test_the_stage_runs_in_another_process_and_gives_the_same_bytes(process_engine, glm_engine):
    pid = stage_pid(process_engine)
    assert pid != os.getpid()
    os.kill(pid, 0)  # alive
    for request in (t2i(), t2i(seed=9, guidance_scale=2.0, temperature=1.0)):
        here, there = glm_engine.run(request), process_engine.run(request)
        assert png(here.images[0]) == png(there.images[0])
    assert "own process" in process_engine.config.summary()


def test_diffusion_progress_streams_back_from_the_process(process_engine):
    events = list(process_engine.stream(process_engine.resolve(t2i(num_inference_steps=4))))
    steps = [e.step for e in events if isinstance(e, DiffusionStep)]
    assert steps == [1, 2, 3, 4]
    finished = [e for e in events if isinstance(e, StageFinished) and e.stage_id == 1]
    assert finished and finished[0].status == "succeeded"
    assert isinstance(events[-1], RunFinished)


def test_cancel_reaches_the_process_and_ends_the_run_cancelled(process_engine):
    """Cancelled once the process has sent its first step: the run ends cancelled long before its 1000
    steps are done, and the process keeps serving (how fast: bench/abort.py)."""
    handle, events = submit(process_engine, t2i(num_inference_steps=1000))
    first = wait_for(events, DiffusionStep)
    assert isinstance(first, DiffusionStep) and first.step < 1000
    handle.cancel()  # type: ignore[attr-defined]
    steps = [first.step]
    while not isinstance(end := wait_for(events, DiffusionStep), (RunFinished, RunFailed)):
        steps.append(end.step)
    assert isinstance(end, RunFailed) and end.cancelled, end
    assert max(steps) < 1000  # the steps stopped: the cancel reached the process
    assert process_engine.run(t2i()).images  # the process keeps serving


def test_a_process_that_dies_fails_its_jobs_and_the_next_batch_starts_a_new_one(process_engine):
    pid = stage_pid(process_engine)
    _, events = submit(process_engine, t2i(num_inference_steps=1000))
    assert isinstance(wait_for(events, DiffusionStep), DiffusionStep)
    os.kill(pid, signal.SIGKILL)
    end = wait_for(events, RunFailed, timeout=30)
    assert isinstance(end, RunFailed) and not end.cancelled and end.stage_id == 1
    assert f"pid {pid}" in end.message and "exited mid-run" in end.message
    result = process_engine.run(t2i())
    assert result.images
    assert stage_pid(process_engine) not in (None, pid)


def test_the_studio_starts_the_process_early_and_the_stage_takes_it(session_data_dir):
    """``ui``/``serve`` start the processes a deploy file asks for before importing the model libraries
    (engine/distributed/spawn.py); the stage then uses that process instead of starting another."""
    presets = REPO_ROOT / "assets" / "deploy"
    assert spawn.stage_processes_wanted((presets / "tiny-glm-shapes.yaml").read_text()) == 1
    assert spawn.stage_processes_wanted((presets / "tiny-glm-image.yaml").read_text()) == 0
    assert spawn.stage_processes_wanted("stages: [{own_process: yes}, 3]\n: :") == 0  # not YAML
    spawn.prestart(1)
    started = spawn._started[0].process.pid
    deploy = tiny_deploy("tiny-glm-image", stage0={"backend": "transformers"}, stage1={"own_process": True})
    engine = _engine("tiny-glm-image", session_data_dir, deploy)
    try:
        assert stage_pid(engine) == started and not spawn._started
        assert engine.run(t2i()).images
    finally:
        engine.close()


def test_a_model_the_process_cannot_load_fails_the_build_naming_the_stage(glm_engine, tmp_path):
    """The child reports why it could not load (here: a corrupt DiT weights file); the engine build fails
    with that reason and the stages already started are shut down."""
    import shutil

    from engine import build_engine
    from engine.engine import EngineBuildError

    folder = tmp_path / "broken-glm"
    shutil.copytree(glm_engine.model.path, folder)
    (folder / "transformer" / "diffusion_pytorch_model.safetensors").write_bytes(b"not safetensors")
    deploy = {"stages": [{"stage_id": 0, "backend": "transformers"}, {"stage_id": 1, "own_process": True}]}
    with pytest.raises(EngineBuildError) as caught:
        build_engine(str(folder), deploy, data_dir=tmp_path / "data")
    message = str(caught.value)
    assert "stage 1 (diffusion) failed to start" in message
    assert "stage 1's process could not load the model" in message
