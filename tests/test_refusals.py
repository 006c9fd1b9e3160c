"""Refused requests are throttled only at sustained abusive rates (studio/api/refusals.py): an honest
client's mistakes each get their own answer naming the field, an oversize upload gets its 413 (never a
reset connection) and costs nothing, and the next valid request goes through."""

from __future__ import annotations

import http.client
import json
import socket

import httpx
import pytest
from fastapi.testclient import TestClient

from studio.api.app import create_app
from studio.api.refusals import MAX_REFUSALS, WINDOW_S, RefusalRate
from studio.api.state import ServingOptions, ServingState
from studio.startup.limits import InputLimits

CHAT = "/v1/chat/completions"
LIMITS = InputLimits(max_body_bytes=300_000, max_prompt_chars=1000)


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def valid() -> dict:
    return {"messages": [{"role": "user", "content": "a lighthouse"}], "seed": 1, "height": 32, "width": 32}


@pytest.fixture()
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture()
def client(glm_engine, clock) -> TestClient:
    state = ServingState(glm_engine, ServingOptions(limits=LIMITS))
    state.refusals = RefusalRate(clock=clock)
    return TestClient(create_app(state))


def test_the_rate_throttles_only_past_20_refusals_a_second_sustained(clock) -> None:
    rate = RefusalRate(clock=clock)
    for _ in range(MAX_REFUSALS):
        rate.record("c", 100)
        clock.now += (WINDOW_S - 0.5) / MAX_REFUSALS
    assert rate.retry_after("c") == 0  # 100 in the window: the limit, not past it
    rate.record("c", 100)
    assert rate.retry_after("c") >= 1 and rate.retry_after("other") == 0
    clock.now += 1.0  # the oldest leave the window: the throttle ends as soon as the rate drops
    assert rate.retry_after("c") == 0


def test_the_rate_counts_refused_bytes_too(clock) -> None:
    rate = RefusalRate(max_bytes=1000, clock=clock)
    rate.record("c", 600)
    assert rate.retry_after("c") == 0
    rate.record("c", 600)
    assert rate.retry_after("c") == 5  # until the first leaves the window
    clock.now += WINDOW_S
    assert rate.retry_after("c") == 0


def test_honest_mistakes_each_get_their_own_answer_and_never_block_the_next_request(client) -> None:
    mistakes = [
        (b"{not json", 400, None),
        (b'{"messages": []}', 400, "messages"),
        (b'{"messages": [{"role": "user", "content": "x"}], "height": "tall"}', 400, "height"),
        (b'{"messages": [{"role": "user", "content": "x"}], "colour": "red"}', 400, "colour"),
    ]
    for _ in range(10):  # 40 mistakes back to back, as a buggy script would send them
        for body, status, param in mistakes:
            response = client.post(CHAT, content=body, headers={"content-type": "application/json"})
            assert response.status_code == status, response.text
            assert response.json()["error"]["param"] == param
    assert client.post(CHAT, json=valid()).status_code == 200


def test_oversize_bodies_are_413_cost_nothing_and_the_next_request_works(client) -> None:
    big = b"x" * (LIMITS.max_body_bytes + 1)
    for _ in range(MAX_REFUSALS + 20):
        response = client.post(CHAT, content=big, headers={"content-type": "application/json"})
        assert response.status_code == 413 and "--max-body-bytes" in response.json()["error"]["message"]
    assert client.post(CHAT, json=valid()).status_code == 200


def test_a_flood_of_refusals_is_throttled_with_a_reason_then_released(client, clock) -> None:
    for _ in range(MAX_REFUSALS + 1):
        assert (
            client.post(CHAT, content=b"{", headers={"content-type": "application/json"}).status_code == 400
        )
    throttled = client.post(CHAT, json=valid())
    assert throttled.status_code == 429
    error = throttled.json()["error"]
    assert error["code"] == "too_many_refused" and error["type"] == "rate_limit_error"
    assert f"more than {MAX_REFUSALS}" in error["message"]
    assert 1 <= int(throttled.headers["retry-after"]) <= WINDOW_S
    other = client.post(CHAT, json=valid(), headers={"authorization": "Bearer another-client"})
    assert other.status_code == 200  # another client (its own key) is not throttled
    clock.now += WINDOW_S + 0.1
    assert client.post(CHAT, json=valid()).status_code == 200


def raw_post(url: str, body: bytes) -> http.client.HTTPResponse:
    """POST ``body`` on a plain socket, all of it sent before the answer is read (as scripts do); a
    connection the server resets before reading the body raises here (BrokenPipe, ConnectionReset)."""
    host, port = url.removeprefix("http://").split(":")
    head = (
        f"POST {CHAT} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode()
    sock = socket.create_connection((host, int(port)), timeout=60)
    sock.sendall(head + body)
    answer = http.client.HTTPResponse(sock)
    answer.begin()
    return answer


def test_a_live_server_answers_big_bodies_instead_of_resetting(tmp_path) -> None:
    """A real socket, as a script sends: a 40 MB body past a 1 MB limit gets its 413; and a client
    throttled for a flood of refusals still gets its 429 (with the reason) for an ordinary 40 kB request,
    not a reset connection."""
    from tests.servers import running_server

    with running_server(["serve", "--max-body-bytes", "1000000"], tmp_path / "data") as server:
        oversize = raw_post(server.url, b"x" * 40_000_000)
        assert oversize.status == 413
        assert json.loads(oversize.read())["error"]["code"] == "body_too_large"
        with httpx.Client(base_url=server.url) as client:
            for _ in range(MAX_REFUSALS + 1):
                client.post(CHAT, content=b"{", headers={"content-type": "application/json"})
        prompt = json.dumps({"messages": [{"role": "user", "content": "cat " * 10_000}]}).encode()
        throttled = raw_post(server.url, prompt)
        assert throttled.status == 429, throttled.read()[:300]
        assert json.loads(throttled.read())["error"]["code"] == "too_many_refused"
