"""Pipeline Apply (studio/controller.py, ``Studio.apply_text``) against real parts: the studio's controller
over a real tiny engine, its API served over HTTP on 127.0.0.1 and its run store.

What the Pipeline tab promises (README.md, "Pipeline"; docs/ARCHITECTURE.md): a config whose new engine
does not start leaves the running engine serving, with the same fingerprint; a request in flight while a
new engine is swapped in finishes on the engine it started on, and the requests after the swap run on the
new engine with its fingerprint.
"""

from __future__ import annotations

import base64
import contextlib
import io
import shutil
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import yaml
from PIL import Image

from studio import __version__
from tests.conftest import REPO_ROOT
from tests.servers import free_port

WAIT_S = 120  # bounds a hang only; every wait below is on a state


def chat(url: str, seed: int = 5) -> httpx.Response:
    """A generation with no size or steps: the deploy config's defaults decide them."""
    body = {"messages": [{"role": "user", "content": "a red circle on a blue background"}], "seed": seed}
    return httpx.post(url + "/v1/chat/completions", json=body, timeout=WAIT_S)


def picture(response: httpx.Response) -> np.ndarray:
    assert response.status_code == 200, response.text
    url = response.json()["choices"][0]["message"]["content"][-1]["image_url"]["url"]
    assert url.startswith("data:image/png;base64,")
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(url.split(",", 1)[1]))).convert("RGB"))


def wait_for(condition: Any, what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        assert time.monotonic() < deadline, f"never: {what}"
        time.sleep(0.05)


@dataclass
class LiveStudio:
    studio: Any  # studio.controller.Studio
    url: str
    model_dir: Path


@pytest.fixture()
def live(tmp_path, model_cache) -> Iterator[LiveStudio]:
    """A studio serving a private copy of tiny-diffusion (a local model folder: Apply reloads its files)."""
    from engine.engine import build_engine
    from engine.models import describe_model, materialize
    from studio.api.app import create_app
    from studio.api.state import ServingState
    from studio.controller import Studio
    from studio.startup.launch import BackgroundServer, close_recorder, listen, open_recorder, serving_options
    from studio.startup.settings import StudioSettings

    built = materialize(describe_model("tiny-diffusion"), model_cache)
    assert built.path is not None
    model_dir = tmp_path / "tiny-diffusion-copy"
    shutil.copytree(built.path, model_dir)
    settings = StudioSettings(data_dir=tmp_path / "data", model=str(model_dir), port=free_port())
    settings.data_dir.mkdir()
    deploy_text = (REPO_ROOT / "assets" / "deploy" / "tiny-diffusion.yaml").read_text()  # 4 steps, 64x64
    engine = build_engine(str(model_dir), yaml.safe_load(deploy_text), data_dir=settings.data_dir)
    recorder = open_recorder(settings)
    serving = ServingState(engine, serving_options(settings), recorder=recorder, source="api")
    studio = Studio(
        engine, serving, settings.data_dir, recorder=recorder, store=recorder.store, deploy_text=deploy_text
    )
    server = BackgroundServer(create_app(serving), listen(settings))
    url = f"http://127.0.0.1:{settings.port}"
    wait_for(lambda: _answers(url), "the API answers /health")
    try:
        yield LiveStudio(studio, url, model_dir)
    finally:
        server.stop()
        server.thread.join(timeout=WAIT_S)
        studio.engine.close()
        close_recorder(recorder)


def _answers(url: str) -> bool:
    with contextlib.suppress(httpx.TransportError):
        return httpx.get(url + "/health", timeout=5).status_code == 200
    return False


def fewer_steps(studio: Any) -> str:
    """The running deploy YAML with 3 denoising steps instead of the model's default (a new config hash)."""
    text = studio.deploy_text.replace("num_inference_steps: 4", "num_inference_steps: 3")
    report = studio.validate_text(text)
    assert report.ok, report.problems
    assert report.config.hash8 != studio.config.hash8
    return text


def recorded(studio: Any, run_id: str) -> Any:
    """The run as the store has it once the recorder wrote its outcome."""
    from studio.store.errors import RunNotFound

    def finished() -> bool:
        with contextlib.suppress(RunNotFound):
            return studio.store.get_run(run_id).status not in ("queued", "running")
        return False

    wait_for(finished, f"run {run_id} recorded as finished")
    return studio.store.get_run(run_id)


def test_an_apply_whose_engine_does_not_start_leaves_the_old_one_serving(live):
    studio = live.studio
    before = chat(live.url)
    fingerprint = before.json()["system_fingerprint"]
    assert fingerprint == f"omni-studio-{__version__}-{studio.config.hash8}"
    running, deploy_text = studio.engine, studio.deploy_text
    assert studio.model.path == live.model_dir.resolve()  # Apply rebuilds from this folder
    text = fewer_steps(studio)

    # The model's weights go missing on disk: the new engine cannot load them (the running one has them
    # in memory already). Validation still passes: it reads the config, not the weights.
    (live.model_dir / "transformer" / "diffusion_pytorch_model.safetensors").unlink()
    report = studio.apply_text(text)

    assert not report.ok
    assert [p.message for p in report.problems][0].startswith("the new engine did not start: stage 0")
    assert studio.engine is running and not running.closed
    assert studio.deploy_text == deploy_text  # the editor's "running" side is still the old config
    models = httpx.get(live.url + "/v1/models", timeout=10)
    assert models.status_code == 200 and models.json()["data"][0]["id"] == "tiny-diffusion-copy"
    after = chat(live.url)
    assert after.json()["system_fingerprint"] == fingerprint
    assert np.array_equal(picture(after), picture(before))  # same engine, same config, same seed
    run = recorded(studio, after.headers["x-run-id"])
    assert run.status == "succeeded" and run.fingerprint == fingerprint


def test_a_request_in_flight_during_a_swap_finishes_on_the_old_engine(live):
    studio = live.studio
    reference = chat(live.url)  # the old engine's picture for this seed
    old_fingerprint = reference.json()["system_fingerprint"]
    old = studio.engine
    text = fewer_steps(studio)

    # Hold the old engine's denoising stage at its start until the swap is done, so that the request is
    # in flight across it whatever the machine's speed (the stage's own run() does the work).
    entered, release = threading.Event(), threading.Event()
    runner = old.runners[0]
    run = runner.run

    def held(jobs: list[Any]) -> None:
        entered.set()
        assert release.wait(WAIT_S)
        run(jobs)

    runner.run = held
    answers: list[httpx.Response] = []
    client = threading.Thread(target=lambda: answers.append(chat(live.url)))
    client.start()
    try:
        assert entered.wait(WAIT_S), "the request never reached the engine"
        report = studio.apply_text(text)
        assert report.ok, report.problems
        new = studio.engine
        assert new is not old and old.in_flight == 1 and not old.closed  # the old engine still has it

        # Meanwhile the next request runs on the new engine: the new fingerprint, its 3 steps.
        following = chat(live.url)
        new_fingerprint = following.json()["system_fingerprint"]
        assert new_fingerprint == f"omni-studio-{__version__}-{new.config.hash8}" != old_fingerprint
        assert not np.array_equal(picture(following), picture(reference))
        assert recorded(studio, following.headers["x-run-id"]).parameters["num_inference_steps"] == 3
        assert not answers, "the held request answered before its stage ran"
    finally:
        release.set()
        client.join(WAIT_S)

    # The request in flight got its whole answer, from the engine and config it started on.
    (in_flight,) = answers
    assert in_flight.json()["system_fingerprint"] == old_fingerprint
    assert np.array_equal(picture(in_flight), picture(reference))
    run_record = recorded(studio, in_flight.headers["x-run-id"])
    assert run_record.status == "succeeded" and run_record.fingerprint == old_fingerprint
    assert run_record.parameters["num_inference_steps"] == 4
    wait_for(lambda: old.closed, "the old engine is released once its last request finished")
    assert not studio.engine.closed
    assert chat(live.url).json()["system_fingerprint"] == new_fingerprint
