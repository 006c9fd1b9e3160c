"""SIGTERM stops `serve` and `ui` gracefully: the engine stops, the writes still queued reach the run
store, exit code 143 (studio/errors.py ``Terminated``)."""

from __future__ import annotations

import signal
import subprocess

import httpx
import pytest

from studio.store import RunFilter, open_store
from studio.store.recorder import WRITE_DELAY_ENV
from tests.servers import start_server

CHAT = {
    "model": "tiny-glm-image",
    "messages": [{"role": "user", "content": "stopped while writing"}],
    "seed": 3,
}


@pytest.mark.parametrize("command", ["serve", "ui"])
def test_sigterm_writes_the_queued_runs_before_the_process_ends(command, tmp_path, monkeypatch):
    monkeypatch.setenv(WRITE_DELAY_ENV, "1.5")  # a slow database: the run's writes are still queued
    server = start_server([command, "--ar-backend", "transformers"], tmp_path / "data", timeout=180)
    try:
        response = httpx.post(server.url + "/v1/chat/completions", json=CHAT, timeout=120)
        assert response.status_code == 200, response.text
        server.process.send_signal(signal.SIGTERM)
        try:
            returncode = server.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            pytest.fail(f"{command} did not stop within 60 s of SIGTERM:\n{server.log()}")
    finally:
        server.stop(signal.SIGKILL)
    assert returncode == 143, server.log()
    store = open_store(None, tmp_path / "data")
    try:
        (run,) = store.list_runs(RunFilter(search="stopped while writing"), limit=10)
        assert run.status == "succeeded", run
        (image,) = store.get_run(run.id).images
        assert image.path.is_file()
    finally:
        store.close()
