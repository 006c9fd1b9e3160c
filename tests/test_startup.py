"""Start-up: the port answers while the engine loads, then serves; a failed load still exits 1 with the message.

Live `omni-studio serve` and `omni-studio ui` processes, their engine load (and `ui`'s page) held by the
test-only ``OMNI_STUDIO_TEST_LOAD_HOLD`` (``OMNI_STUDIO_TEST_UI_HOLD``; studio/startup/launch.py) until the
test has checked the loading state and lets go: no test rests on how fast the machine loads.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from studio.startup.launch import LOAD_HOLD_ENV, UI_HOLD_ENV
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
    """An ``omni-studio`` process whose engine load (``hold_load``) and page build (``hold_ui``) wait for
    :meth:`release_load` and :meth:`release_ui` (stopped by PID)."""

    def __init__(self, args: list[str], data_dir: Path, hold_load: bool, hold_ui: bool = False) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        data_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = data_dir / f"server-{self.port}.log"
        command = [sys.executable, "-m", "studio.cli", *args, "--host", "127.0.0.1", "--port", str(self.port)]
        command += ["--data-dir", str(data_dir)]
        self.holds = {env: data_dir / f"{env.lower()}-{self.port}" for env in (LOAD_HOLD_ENV, UI_HOLD_ENV)}
        held = {
            env: str(path) for env, path in self.holds.items() if (hold_load, hold_ui)[env == UI_HOLD_ENV]
        }
        self.started = time.monotonic()
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(
                command,
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**os.environ, **held},
            )

    def release_load(self) -> None:
        self.holds[LOAD_HOLD_ENV].touch()

    def release_ui(self) -> None:
        self.holds[UI_HOLD_ENV].touch()

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
def starting(args: list[str], data_dir: Path, hold_load: bool = True, hold_ui: bool = False):
    server = Starting(args, data_dir, hold_load, hold_ui)
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
        # The first answer comes while the engine still loads (how soon is bench/startup.py's business).
        health, after_s = server.first_answer("/health")
        assert health.status_code == 503, f"answered {health.status_code} after {after_s:.1f} s"
        assert_not_ready(server)
        # Then the real API takes the requests while the engine loads: its own 503 carries Retry-After too.
        models = wait_until(server, lambda: _api_not_ready(httpx.get(server.url + "/v1/models", timeout=5)))
        assert int(models.headers["retry-after"]) > 0 and models.json()["error"]["code"] == "engine_not_ready"
        server.release_load()
        server.wait_ready()
        refused_while_loading_are_recorded(tmp_path, 1)
        assert httpx.get(server.url + "/health", timeout=5).json()["status"] == "ok"
        response = httpx.post(server.url + "/v1/chat/completions", json=CHAT, timeout=120)
        assert response.status_code == 200, response.text
        part = response.json()["choices"][0]["message"]["content"][0]
        assert part["image_url"]["url"].startswith("data:image/png;base64,")
        assert start_up_settled_the_collector(server)


def _api_not_ready(response: httpx.Response) -> httpx.Response | None:
    """``response`` when it is the real API's 503 (not the loading app's: that one names the model)."""
    if response.status_code == 503 and "starting or being rebuilt" in response.json()["error"]["message"]:
        return response
    assert response.status_code == 503, response.text  # the engine must still be loading
    return None


def wait_until(server: Any, probe: Any, timeout: float = 240) -> Any:
    """Poll ``probe()`` until it returns something truthy (the deadline only bounds a hang)."""
    deadline = time.monotonic() + timeout
    while True:
        assert server.process.poll() is None, server.log()
        with contextlib.suppress(httpx.TransportError):
            found = probe()
            if found:
                return found
        assert time.monotonic() < deadline, server.log()
        time.sleep(0.1)


def _gc_metrics(server: Any) -> tuple[float, float]:
    """(objects frozen at the end of start-up, generation-0 collections so far) from ``/metrics``."""
    lines = httpx.get(server.url + "/metrics", timeout=10).text.splitlines()
    frozen = next(float(line.split()[-1]) for line in lines if line.startswith("omni_studio_gc_frozen"))
    gen0 = next(
        float(line.split()[-1])
        for line in lines
        if line.startswith("python_gc_collections_total") and 'generation="0"' in line
    )
    return frozen, gen0


def start_up_settled_the_collector(server: Any) -> bool:
    """The start-up's objects were frozen once, and the garbage collector is back on: serving requests
    runs collections again (engine/environment.py; tests/test_environment.py checks the pair)."""
    frozen, collections = _gc_metrics(server)

    def collected() -> bool:  # how many requests that takes depends on what they leave allocated
        response = httpx.post(server.url + "/v1/chat/completions", json=CHAT, timeout=120)
        assert response.status_code == 200, response.text
        return _gc_metrics(server)[1] > collections

    wait_until(server, collected)
    # Frozen objects that die later leave the count: it may shrink, never grow (no second freeze).
    frozen_after = _gc_metrics(server)[0]
    assert 0 < frozen_after <= frozen, (frozen, frozen_after)
    return True


@pytest.mark.browser  # a live studio through gradio_client, like tests/test_ui_client.py
def test_ui_shows_the_loading_state_then_works(tmp_path):
    from gradio_client import Client

    with starting(["ui", "--ar-backend", "transformers"], tmp_path, hold_ui=True) as server:
        page, _ = server.first_answer("/")
        assert page.status_code == 200
        assert "loading model tiny-glm-image" in page.text
        assert "/health" in page.text  # it polls and reloads itself when the studio is ready
        assert_not_ready(server)
        server.release_load()
        # The engine is loaded, the page still builds: the API already generates; /health says so.
        wait_until(server, lambda: httpx.get(server.url + "/health", timeout=5).json().get("api") == "ready")
        response = httpx.post(server.url + "/v1/chat/completions", json=CHAT, timeout=120)
        assert response.status_code == 200, response.text
        health = httpx.get(server.url + "/health", timeout=5)
        assert health.status_code == 503 and health.json() == {"status": "starting", "api": "ready"}
        assert "loading model" in httpx.get(server.url + "/", timeout=5).text
        server.release_ui()
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


@pytest.mark.browser  # a live studio, like test_ui_shows_the_loading_state_then_works
def test_ui_finishes_a_request_in_flight_across_the_hand_over_to_gradio(tmp_path):
    """`ui` serves the API from its loading server before Gradio's launch() takes the port (studio/startup/launch.py;
    README, first section). A request that is in the middle of arriving when the port moves still gets its
    whole answer, from the loading server; the requests after it go to the studio.

    The request's body is sent in two parts, the second only once the studio has the port: it is in
    flight across the hand-over whatever the machine's speed.
    """
    with starting(["ui", "--ar-backend", "transformers"], tmp_path, hold_load=False, hold_ui=True) as server:
        wait_until(server, lambda: httpx.get(server.url + "/health", timeout=5).json().get("api") == "ready")
        body = json.dumps({**CHAT, "messages": [{"role": "user", "content": "across the hand-over"}]})
        first_part_sent, handed_over = threading.Event(), threading.Event()

        def parts() -> Iterator[bytes]:
            yield body[:20].encode()
            first_part_sent.set()
            handed_over.wait(240)
            yield body[20:].encode()

        answers: list[httpx.Response | BaseException] = []

        def send() -> None:
            try:
                answers.append(
                    httpx.post(
                        server.url + "/v1/chat/completions",
                        content=parts(),
                        headers={"content-type": "application/json"},
                        timeout=240,
                    )
                )
            except BaseException as exc:  # reported by the assertions below
                answers.append(exc)

        client = threading.Thread(target=send)
        client.start()
        try:
            assert first_part_sent.wait(240)
            # Answered after the request was accepted, by the loading server: the request is on it.
            health = httpx.get(server.url + "/health", timeout=5)
            assert health.json() == {"status": "starting", "api": "ready"}, "the hand-over came too early"
            server.release_ui()
            server.wait_ready()  # Gradio's launch() has the port now
            page = wait_until(server, lambda: _studio_page(server))
            assert "loading model" not in page
            assert not answers, "the request in flight was answered before its body was complete"
        finally:
            handed_over.set()
            client.join(240)

        (in_flight,) = answers
        assert isinstance(in_flight, httpx.Response), in_flight
        assert in_flight.status_code == 200, in_flight.text
        part = in_flight.json()["choices"][0]["message"]["content"][0]
        assert part["image_url"]["url"].startswith("data:image/png;base64,")
        run_id = in_flight.headers["x-run-id"]

        after = httpx.post(server.url + "/v1/chat/completions", json=CHAT, timeout=120)
        assert after.status_code == 200, after.text
        assert after.json()["system_fingerprint"] == in_flight.json()["system_fingerprint"]
        assert httpx.get(server.url + "/health", timeout=5).json() == {
            "status": "ok",
            "model": "tiny-glm-image",
        }

    from studio.store import open_store

    with open_store(None, tmp_path) as store:  # the studio has stopped: every run is written
        recorded = store.get_run(run_id)
    assert recorded.status == "succeeded" and recorded.prompt == "across the hand-over"


def _studio_page(server: Any) -> str | None:
    """The page at ``/`` once it is the studio (Gradio's page, with the studio's tabs in its config)."""
    response = httpx.get(server.url + "/", timeout=10)
    if response.status_code != 200 or "loading model" in response.text:
        return None
    text = response.text
    return text if all(f'"{tab}"' in text for tab in ("Chat", "Pipeline", "History")) else None
