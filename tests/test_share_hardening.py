"""Share-mode hardening (see README, "--share"): the UI serves only the outputs it shows (never the data
dir or the database), ``/metrics`` needs the API key or a UI login once either is configured, secrets are
compared in constant time, and failed API keys / UI logins are limited per client address."""

from __future__ import annotations

import re
import urllib.parse
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient

from studio.api import auth
from studio.api.app import create_app
from studio.api.state import ServingOptions, ServingState
from tests.servers import LiveServer, running_server


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


# --- the limiter on its own (injected clock) ---------------------------------------------------------------


def test_limiter_blocks_a_client_for_a_minute_after_five_failures_then_twice_as_long():
    clock = FakeClock()
    limiter = auth.FailedLoginLimiter(clock=clock)
    for _ in range(4):
        assert limiter.record_failure("10.0.0.1") is None
        clock.now += 1
    assert limiter.retry_after("10.0.0.1") is None
    assert limiter.record_failure("10.0.0.1") == 60  # the fifth: blocked from now on
    assert limiter.retry_after("10.0.0.1") == 60
    assert limiter.retry_after("10.0.0.2") is None  # per address
    clock.now += 59.5
    assert limiter.retry_after("10.0.0.1") == 1
    clock.now += 1
    assert limiter.retry_after("10.0.0.1") is None  # a minute later it may try again
    assert limiter.record_failure("10.0.0.1") is None  # and its old failures are forgotten
    for _ in range(3):
        limiter.record_failure("10.0.0.1")
    assert limiter.record_failure("10.0.0.1") == 120  # blocked again: twice as long


def test_limiter_counts_failures_within_a_minute_only():
    clock = FakeClock()
    limiter = auth.FailedLoginLimiter(clock=clock)
    for _ in range(10):
        assert limiter.record_failure("10.0.0.1") is None
        clock.now += 15  # 4 per minute stay under the limit
    assert limiter.retry_after("10.0.0.1") is None


def test_limiter_memory_is_bounded():
    clock = FakeClock()
    limiter = auth.FailedLoginLimiter(clock=clock, max_clients=100)
    for i in range(1000):
        limiter.record_failure(f"10.1.{i // 256}.{i % 256}")
    assert len(limiter) <= 100
    clock.now += 3600
    limiter.record_failure("10.9.9.9")
    assert len(limiter) == 1  # expired entries are dropped


# --- the API over HTTP (in process) --------------------------------------------------------------------------


def test_api_key_is_compared_in_constant_time(monkeypatch):
    calls = []
    real = auth.hmac.compare_digest

    def spy(a, b):
        calls.append((a, b))
        return real(a, b)

    monkeypatch.setattr(auth.hmac, "compare_digest", spy)
    client = TestClient(create_app(ServingState(None, ServingOptions(api_key="k-right"))))
    assert client.get("/v1/models", headers={"Authorization": "Bearer k-wrong"}).status_code == 401
    assert calls


def test_five_failures_of_one_key_block_that_key_never_the_right_one():
    """Behind a proxy everyone shares one address: a stranger's wrong key, tried five times, gets 429 with
    Retry-After; the right key from the same address works at once, and another wrong key still gets
    its own 401."""
    app = create_app(ServingState(None, ServingOptions(api_key="k-right")))
    client = TestClient(app, client=("10.0.0.1", 5000))
    right = {"Authorization": "Bearer k-right"}
    wrong = {"Authorization": "Bearer k-wrong"}
    assert client.get("/v1/models", headers=right).status_code == 503  # authenticated (no engine here)
    for _ in range(5):
        assert client.get("/v1/models", headers=wrong).status_code == 401
    response = client.get("/v1/models", headers=wrong)
    assert response.status_code == 429
    assert 0 < int(response.headers["Retry-After"]) <= 60
    assert response.json()["error"]["type"] == "rate_limit_error"
    assert client.get("/v1/models", headers=right).status_code == 503  # the right key: through at once
    assert client.get("/metrics", headers=right).status_code == 200
    other_wrong = client.get("/v1/models", headers={"Authorization": "Bearer k-other"})
    assert other_wrong.status_code == 401 and other_wrong.json()["error"]["code"] == "invalid_api_key"
    assert client.get("/v1/models").status_code == 401  # no key: told so, never a 429


def test_metrics_need_the_key_when_one_is_set():
    client = TestClient(create_app(ServingState(None, ServingOptions(api_key="k-right"))))
    response = client.get("/metrics")
    assert response.status_code == 401
    assert response.json()["error"]["type"] == "authentication_error"
    assert client.get("/metrics", headers={"Authorization": "Bearer k-wrong"}).status_code == 401
    assert client.get("/metrics", headers={"Authorization": "Bearer k-right"}).status_code == 200


def test_metrics_stay_open_without_a_key():
    client = TestClient(create_app(ServingState(None, ServingOptions())))
    assert client.get("/metrics").status_code == 200


# --- a live shared studio ------------------------------------------------------------------------------------


def from_address(server, address: str) -> httpx.Client:
    """A client whose connections come from ``address`` (any 127.x.y.z reaches the server on 127.0.0.1)."""
    return httpx.Client(base_url=server.url, transport=httpx.HTTPTransport(local_address=address))


def file_url(path) -> str:
    return "/gradio_api/file=" + urllib.parse.quote(str(path))


@dataclass
class Shared:
    server: LiveServer
    data_dir: Path
    user: str
    password: str
    key: str

    @property
    def bearer(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.key}"}

    def logged_in(self, address: str = "127.0.0.1") -> httpx.Client:
        client = from_address(self.server, address)
        response = client.post("/login", data={"username": self.user, "password": self.password})
        assert response.status_code == 200, response.text
        return client


@pytest.fixture(scope="module")
def shared(tmp_path_factory, share_guard) -> Iterator[Shared]:
    data_dir = tmp_path_factory.mktemp("shared") / "data"
    with running_server(["ui", "--share"], data_dir) as server:
        log = server.log()
        # no public link: the share step went to the test run's refusing stand-in (tests/share_guard.py)
        assert any(call[call.index("-l") + 1] == str(server.port) for call in share_guard.calls())
        assert "share link: not available" in log, log
        login = re.search(r"UI login: (\S+) / (\S+)", log)
        key = re.search(r"API key \(required on /v1 when shared\): (\S+)", log)
        assert login and key, log
        yield Shared(server, data_dir, login.group(1), login.group(2), key.group(1))


@pytest.mark.browser
def test_shared_metrics_need_the_key_or_a_login(shared):
    me = from_address(shared.server, "127.0.0.1")
    response = me.get("/metrics")
    assert response.status_code == 401 and response.json()["error"]["type"] == "authentication_error"
    assert me.get("/metrics", headers=shared.bearer).status_code == 200
    assert shared.logged_in().get("/metrics").status_code == 200


@pytest.mark.browser
def test_shared_ui_shows_chat_images_but_not_the_data_dir(shared):
    me = shared.logged_in()
    chat = me.post(
        "/gradio_api/call/chat",
        json={"data": [{"text": "a red cube", "files": []}, [], 7, 64, 64, 2, 1.5, "", 8, 0.8, [], 0]},
    )
    assert chat.status_code == 200, chat.text
    stream = me.get(f"/gradio_api/call/chat/{chat.json()['event_id']}", timeout=120).text
    assert "event: complete" in stream, stream[-2000:]
    image_urls = re.findall(r'"url": ?"([^"]+\.png)"', stream)
    assert image_urls, stream[-2000:]
    image = me.get(image_urls[-1].replace(shared.server.url, ""))
    assert image.status_code == 200 and image.content[:4] == b"\x89PNG"

    data_dir = shared.data_dir
    outputs = sorted((data_dir / "outputs").rglob("*.png"))
    assert outputs  # the chat's image is in the run store, which the UI may read
    assert me.get(file_url(outputs[0])).status_code == 200
    (data_dir / "secret.txt").write_text("not for the UI")
    assert (data_dir / "runs.db").is_file()
    for path in (data_dir / "runs.db", data_dir / "secret.txt", outputs[0].parent / "../../runs.db"):
        assert me.get(file_url(path)).status_code != 200, path


@pytest.mark.browser
def test_shared_failed_logins_block_that_login_never_the_right_one(shared):
    intruder = from_address(shared.server, "127.0.0.2")
    for _ in range(5):
        response = intruder.post("/login", data={"username": shared.user, "password": "nope"})
        assert response.status_code == 400
    response = intruder.post("/login", data={"username": shared.user, "password": "nope"})
    assert response.status_code == 429 and 0 < int(response.headers["Retry-After"]) <= 60
    # The right login and the API key from the same address work at once.
    response = intruder.post("/login", data={"username": shared.user, "password": shared.password})
    assert response.status_code == 200, response.text
    assert intruder.get("/v1/models", headers=shared.bearer).status_code == 200


@pytest.mark.browser
def test_shared_failed_keys_block_that_key_never_the_right_one(shared):
    guesser = from_address(shared.server, "127.0.0.3")
    for _ in range(5):
        assert guesser.get("/v1/models", headers={"Authorization": "Bearer nope"}).status_code == 401
    response = guesser.get("/v1/models", headers={"Authorization": "Bearer nope"})
    assert response.status_code == 429 and 0 < int(response.headers["Retry-After"]) <= 60
    assert response.json()["error"]["type"] == "rate_limit_error"
    assert guesser.get("/v1/models", headers=shared.bearer).status_code == 200
