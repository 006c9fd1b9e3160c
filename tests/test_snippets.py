"""The Serving tab's curl and Python snippets come from the running model and deploy config, and they work:
run as shown against a live studio on `tiny-glm-shapes`, the picture is what the prompt asks (the shapes
classifier). Requests outside what a model supports still run, with a warning in the UI, CLI and API."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import httpx
import numpy as np
import pytest
from gradio_client import Client
from PIL import Image

from studio.cli import main
from studio.controller import API_KEY_ENV, api_snippets
from tests.servers import running_server
from tools.shapes.classify import classify
from tools.shapes.world import parse_caption

KEY = "snippet-test-key"
VENV_BIN = str(Path(sys.executable).parent)


@pytest.fixture(scope="module")
def shapes_studio(tmp_path_factory):
    data = tmp_path_factory.mktemp("snippets")
    with running_server(["ui", "--model", "tiny-glm-shapes", "--api-key", KEY], data) as server:
        yield server


@pytest.fixture(scope="module")
def snippets(shapes_studio) -> tuple[str, str]:
    """The snippets as the live Serving tab shows them (the Set API key button returns them)."""
    result = Client(shapes_studio.url + "/", verbose=False).predict(KEY, api_name="/set_api_key")
    return result[1], result[2]


def assert_draws(path: Path, prompt: str) -> None:
    with Image.open(path) as image:
        assert image.size == (128, 128)
        reading = classify(np.asarray(image.convert("RGB")))
    scene = parse_caption(prompt)
    assert scene is not None
    assert all(reading.correct(scene).values()), reading


def snippet_env() -> dict[str, str]:
    return {**os.environ, API_KEY_ENV: KEY, "PATH": VENV_BIN + os.pathsep + os.environ.get("PATH", "")}


def test_snippets_use_the_models_defaults_name_and_a_key_placeholder(snippets, shapes_studio):
    curl, python = snippets
    for text in (curl, python):
        assert "tiny-glm-shapes" in text
        assert "a red circle on a blue background, top left" in text  # the model card's example prompt
        assert '"height": 128' in text and '"width": 128' in text and '"num_inference_steps": 8' in text
        assert f"127.0.0.1:{shapes_studio.port}/v1" in text
        assert KEY not in text  # read from the environment, never shown
    assert f"Bearer ${API_KEY_ENV}" in curl
    assert f'os.environ["{API_KEY_ENV}"]' in python


def test_curl_snippet_runs_and_draws_the_prompt(snippets, tmp_path):
    curl, _ = snippets
    done = subprocess.run(
        ["bash", "-c", "set -eo pipefail\n" + curl],
        cwd=tmp_path,
        env=snippet_env(),
        capture_output=True,
        timeout=180,
    )
    assert done.returncode == 0, done.stderr.decode()
    assert_draws(tmp_path / "image.png", "a red circle on a blue background, top left")


def test_python_snippet_runs_and_draws_the_prompt(snippets, tmp_path):
    _, python = snippets
    (tmp_path / "snippet.py").write_text(python)
    done = subprocess.run(
        [sys.executable, "snippet.py"], cwd=tmp_path, env=snippet_env(), capture_output=True, timeout=180
    )
    assert done.returncode == 0, done.stderr.decode()
    assert_draws(tmp_path / "image.png", "a red circle on a blue background, top left")


def test_api_warns_outside_the_supported_size_and_steps(shapes_studio):
    headers = {"Authorization": f"Bearer {KEY}"}
    body = {
        "messages": [{"role": "user", "content": "a red circle on a blue background, top left"}],
        "seed": 1,
    }
    ok = httpx.post(shapes_studio.url + "/v1/chat/completions", json=body, headers=headers, timeout=120)
    assert ok.status_code == 200
    assert "warnings" not in ok.json() and "x-omni-studio-warning" not in ok.headers
    odd = httpx.post(
        shapes_studio.url + "/v1/chat/completions",
        json={**body, "height": 64, "width": 64, "num_inference_steps": 4},
        headers=headers,
        timeout=120,
    )
    assert odd.status_code == 200  # it still runs
    (warning,) = odd.json()["warnings"]
    assert "supports size 128x128, 8 steps" in warning and "64x64 and 4 steps" in warning
    assert odd.headers["x-omni-studio-warning"] == warning
    images = httpx.post(
        shapes_studio.url + "/v1/images/generations",
        json={"prompt": "a red circle on a blue background", "size": "64x64"},
        headers=headers,
        timeout=120,
    )
    assert images.status_code == 200 and "64x64" in images.json()["warnings"][0]
    assert "64x64" in images.headers["x-omni-studio-warning"]


def test_cli_warns_outside_the_supported_size(tmp_path, capsys):
    out = tmp_path / "x.png"
    argv = ["run", "a red circle on a blue background, top left", "--model", "tiny-glm-shapes"]
    assert (
        main(
            [
                *argv,
                "--height",
                "64",
                "--width",
                "64",
                "--out",
                str(out),
                "--quiet",
                "--data-dir",
                str(tmp_path),
            ]
        )
        == 0
    )
    err = capsys.readouterr().err
    assert "omni-studio run: warning: tiny-glm-shapes supports size 128x128, 8 steps" in err
    assert Image.open(out).size == (64, 64)
    assert main([*argv, "--out", str(out), "--quiet", "--data-dir", str(tmp_path)]) == 0
    assert "warning" not in capsys.readouterr().err
    assert_draws(out, "a red circle on a blue background, top left")  # defaults from the model: 128x128


def test_chat_snippets_for_a_text_model_and_an_open_server():
    curl, python = api_snippets(
        "http://h:1/v1", "tiny-chat", "Say hello", {"max_tokens": 32}, makes_images=False, api_key_set=False
    )
    assert "Authorization" not in curl and '"max_tokens": 32' in curl and "python3" not in curl
    assert 'api_key="unused"' in python and "max_tokens=32" in python and "extra_body" not in python
    compile(python, "snippet", "exec")
