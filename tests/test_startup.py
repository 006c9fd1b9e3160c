"""Start-up: the port answers while the engine loads, then serves; a failed load still exits 1 with the message.

Live `omni-studio serve` and `omni-studio ui` processes, with loading made observably slow through the
test-only ``OMNI_STUDIO_TEST_LOAD_DELAY_S`` (studio/launch.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from studio.launch import LOAD_DELAY_ENV, UI_DELAY_ENV, BackgroundServer
from studio.starting import StartingApp
from tests.servers import free_port

CHAT = {
    "model": "tiny-glm-image",
    "messages": [{"role": "user", "content": "a red circle on a blue background"}],
    "seed": 3,
    "height": 64,
    "width": 64,
    "num_inference_steps": 2,
}


class Starting:
    """An ``omni-studio`` process started with a slow engine load (stopped by PID)."""

    def __init__(self, args: list[str], data_dir: Path, delay_s: float, ui_delay_s: float = 0) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        data_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = data_dir / f"server-{self.port}.log"
        command = [sys.executable, "-m", "studio.cli", *args, "--host", "127.0.0.1", "--port", str(self.port)]
        command += ["--data-dir", str(data_dir)]
        self.started = time.monotonic()
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(
                command,
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**os.environ, LOAD_DELAY_ENV: str(delay_s), UI_DELAY_ENV: str(ui_delay_s)},
            )

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def first_answer(self, path: str, timeout: float = 60) -> tuple[httpx.Response, float]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.process.poll() is None, self.log()
            with contextlib.suppress(httpx.TransportError):
                response = httpx.get(self.url + path, timeout=5)
                return response, time.monotonic() - self.started
            time.sleep(0.05)
        raise AssertionError(f"{path} never answered:\n{self.log()}")

    def wait_ready(self, timeout: float = 240) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.process.poll() is None, self.log()
            with contextlib.suppress(httpx.TransportError):  # the UI hands its port to Gradio
                if httpx.get(self.url + "/health", timeout=5).status_code == 200:
                    return
            time.sleep(0.2)
        raise AssertionError(f"never ready:\n{self.log()}")

    def stop(self) -> None:
        if self.process.poll() is None:
            os.kill(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.kill(self.process.pid, signal.SIGKILL)
                self.process.wait(timeout=10)


@contextlib.contextmanager
def starting(args: list[str], data_dir: Path, delay_s: float = 15, ui_delay_s: float = 0):
    server = Starting(args, data_dir, delay_s, ui_delay_s)
    try:
        yield server
    finally:
        server.stop()


def assert_not_ready(server: Starting) -> None:
    """/health says starting and /v1 refuses with an OpenAI 503 and Retry-After (the engine still loads)."""
    health = httpx.get(server.url + "/health", timeout=5)
    assert health.status_code == 503 and health.json() == {"status": "starting"}
    assert int(health.headers["retry-after"]) > 0
    for response in (
        httpx.post(server.url + "/v1/chat/completions", json=CHAT, timeout=5),
        httpx.get(server.url + "/v1/models", timeout=5),
    ):
        assert response.status_code == 503, response.text
        assert int(response.headers["retry-after"]) > 0
        error = response.json()["error"]
        assert error["code"] == "engine_not_ready" and error["type"] == "service_unavailable"
        assert error["message"]


def refused_while_loading_are_recorded(data_dir: Path, expected: int) -> None:
    """Every generation request refused while loading is a failed run once the store is open."""
    from studio.store import RunFilter, open_store

    deadline = time.monotonic() + 30
    while True:
        store = open_store(None, data_dir)
        try:
            runs = store.list_runs(RunFilter(status="failed"), limit=50)
        finally:
            store.close()
        refused = [r for r in runs if "engine_not_ready" in (r.error or "")]
        if len(refused) >= expected or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert len(refused) == expected, [r.error for r in runs]


def test_serve_answers_while_the_engine_loads_then_serves(tmp_path):
    with starting(["serve"], tmp_path) as server:
        health, after_s = server.first_answer("/health")
        assert health.status_code == 503, f"answered {health.status_code} after {after_s:.1f} s"
        assert after_s < 15, f"/health first answered {after_s:.1f} s after the start"
        assert_not_ready(server)
        server.wait_ready()
        refused_while_loading_are_recorded(tmp_path, 1)
        assert httpx.get(server.url + "/health", timeout=5).json()["status"] == "ok"
        response = httpx.post(server.url + "/v1/chat/completions", json=CHAT, timeout=120)
        assert response.status_code == 200, response.text
        part = response.json()["choices"][0]["message"]["content"][0]
        assert part["image_url"]["url"].startswith("data:image/png;base64,")
        assert start_up_settled_the_collector(server)


def start_up_settled_the_collector(server: Any) -> bool:
    """The start-up's objects were frozen, and with that the garbage collector turned back on
    (engine/environment.py; tests/test_environment.py checks the pair)."""
    text = httpx.get(server.url + "/metrics", timeout=10).text
    frozen = next(
        float(line.split()[-1]) for line in text.splitlines() if line.startswith("omni_studio_gc_frozen")
    )
    return frozen > 100_000


@pytest.mark.browser  # a live studio through gradio_client, like tests/test_ui_client.py
def test_ui_shows_the_loading_state_then_works(tmp_path):
    from gradio_client import Client

    with starting(["ui", "--ar-backend", "transformers"], tmp_path, ui_delay_s=20) as server:
        page, after_s = server.first_answer("/")
        assert page.status_code == 200 and after_s < 15
        assert "loading model tiny-glm-image" in page.text
        assert "/health" in page.text  # it polls and reloads itself when the studio is ready
        assert_not_ready(server)
        # The engine is loaded, the page still builds: the API already generates; /health says so.
        deadline = time.monotonic() + 120
        while httpx.get(server.url + "/health", timeout=5).json().get("api") != "ready":
            assert time.monotonic() < deadline, server.log()
            time.sleep(0.2)
        response = httpx.post(server.url + "/v1/chat/completions", json=CHAT, timeout=120)
        assert response.status_code == 200, response.text
        health = httpx.get(server.url + "/health", timeout=5)
        assert health.status_code == 503 and health.json() == {"status": "starting", "api": "ready"}
        assert "loading model" in httpx.get(server.url + "/", timeout=5).text
        server.wait_ready()
        refused_while_loading_are_recorded(tmp_path, 1)
        page = httpx.get(server.url + "/", timeout=10)
        assert page.status_code == 200 and "loading model" not in page.text
        info = Client(server.url + "/", verbose=False).predict(api_name="/system_info")
        assert info["running"]["model"] == "tiny-glm-image"
        response = httpx.post(server.url + "/v1/chat/completions", json=CHAT, timeout=120)
        assert response.status_code == 200, response.text
        assert start_up_settled_the_collector(server)


@pytest.mark.parametrize(
    ("command", "flags", "message"),
    [
        ("serve", ["--model", "/nonexistent/model-folder"], "is neither a built-in model"),
        ("ui", ["--model", "/nonexistent/model-folder"], "is neither a built-in model"),
        ("serve", ["--deploy-config", "BAD"], "unknown key 'bogus'"),
    ],
)
def test_a_failed_engine_start_exits_1_with_the_message(tmp_path, command, flags, message):
    bad = tmp_path / "bad.yaml"
    bad.write_text("stages:\n- stage_id: 0\n  bogus: 1\n")
    flags = [str(bad) if flag == "BAD" else flag for flag in flags]
    port = free_port()
    done = subprocess.run(
        [sys.executable, "-m", "studio.cli", command, *flags, "--host", "127.0.0.1", "--port", str(port)]
        + ["--data-dir", str(tmp_path / "data")],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert done.returncode == 1, done.stderr
    assert f"omni-studio {command}: cannot start:" in done.stderr and message in done.stderr


def test_a_taken_port_is_a_clear_start_up_error(tmp_path):
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = subprocess.run(
            [sys.executable, "-m", "studio.cli", "serve", "--port", str(port), "--data-dir", str(tmp_path)],
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert done.returncode == 1 and f"cannot listen on 127.0.0.1:{port}" in done.stderr


def test_starting_app_answers_and_then_hands_over():
    async def scenario() -> list[httpx.Response]:
        from fastapi import FastAPI
        from fastapi.responses import JSONResponse

        front = StartingApp("some-model", page=True)
        transport = httpx.ASGITransport(app=front)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            answers = [await client.get("/"), await client.get("/health"), await client.post("/v1/x")]
            real = FastAPI()
            real.add_api_route("/health", lambda: JSONResponse({"status": "rebuilding"}, 503))
            real.add_api_route("/v1/models", lambda: {"data": []})
            front.target = real
            answers += [await client.get("/health"), await client.get("/v1/models")]
        return answers

    page, health, api, handed_health, handed_models = asyncio.run(scenario())
    assert page.status_code == 200 and "loading model some-model" in page.text
    assert health.status_code == 503 and health.headers["retry-after"] == "2"
    assert api.status_code == 503 and api.json()["error"]["code"] == "engine_not_ready"
    assert handed_health.status_code == 503 and handed_health.headers["retry-after"] == "2"
    assert handed_models.status_code == 200 and handed_models.json() == {"data": []}


def test_starting_app_serves_the_api_before_the_page():
    async def scenario() -> list[httpx.Response]:
        from fastapi import FastAPI

        front = StartingApp("some-model", page=True)
        api = FastAPI()
        api.add_api_route("/v1/models", lambda: {"data": [{"id": "some-model"}]})
        front.api = api
        transport = httpx.ASGITransport(app=front)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return [await client.get("/"), await client.get("/health"), await client.get("/v1/models")]

    page, health, models = asyncio.run(scenario())
    assert page.status_code == 200 and "loading model some-model" in page.text
    assert health.status_code == 503 and health.json() == {"status": "starting", "api": "ready"}
    assert models.status_code == 200 and models.json()["data"][0]["id"] == "some-model"


def test_the_loading_server_frees_its_port_at_once_and_finishes_requests_in_flight(tmp_path):
    """The UI's hand-over: the port is free for Gradio while a generation sent earlier still finishes."""
    import socket
    import threading

    from studio.launch import listen
    from studio.settings import StudioSettings

    async def slow(scope, receive, send) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                else:
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        await asyncio.sleep(2)
        await send(
            {"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]}
        )
        await send({"type": "http.response.body", "body": b"finished"})

    port = free_port()
    server = BackgroundServer(slow, listen(StudioSettings(data_dir=tmp_path, host="127.0.0.1", port=port)))
    url = f"http://127.0.0.1:{port}/v1/anything"
    deadline = time.monotonic() + 10
    while True:  # the server is up when it accepts
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            assert time.monotonic() < deadline
            time.sleep(0.05)
    answers: list[httpx.Response] = []
    client = threading.Thread(target=lambda: answers.append(httpx.get(url, timeout=30)))
    client.start()
    time.sleep(0.5)  # the request is in flight
    started = time.monotonic()
    server.stop()
    assert time.monotonic() - started < 1.5, "stop() waited for the request in flight"
    with socket.socket() as successor:  # what launch() does next: bind the same port
        successor.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        successor.bind(("127.0.0.1", port))
    client.join(timeout=30)
    assert answers and answers[0].status_code == 200 and answers[0].text == "finished"
