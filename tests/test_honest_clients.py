"""Honest clients first, against a live `omni-studio serve` with an API key: a script at concurrency 16 is
served in full (no 429: the queue is not full), each malformed request gets its own 400 naming the field,
and wrong keys never lock out the right one (README, "The API")."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.servers import running_server

KEY = "k-right-0123456789"
CHAT = "/v1/chat/completions"
GOOD = {
    "messages": [{"role": "user", "content": "a red circle on a blue background"}],
    "height": 32,
    "width": 32,
    "num_inference_steps": 1,
}
MALFORMED = [
    (b"{not json", None),
    (json.dumps({"messages": []}).encode(), "messages"),
    (json.dumps({**GOOD, "height": "tall"}).encode(), "height"),
    (json.dumps({**GOOD, "colour": "red"}).encode(), "colour"),
]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with running_server(["serve", "--api-key", KEY], tmp_path_factory.mktemp("honest") / "data") as live:
        yield live


def test_a_script_at_concurrency_16_is_served_in_full(server) -> None:
    headers = {"Authorization": f"Bearer {KEY}"}

    def one(i: int) -> tuple[int, int, str | None]:
        with httpx.Client(base_url=server.url, timeout=300, headers=headers) as client:
            if i % 12 == 11:  # 4 of 48 malformed, in among the rest
                body, param = MALFORMED[(i // 12) % len(MALFORMED)]
                response = client.post(CHAT, content=body, headers={"content-type": "application/json"})
                return i, response.status_code, response.json()["error"]["param"]
            payload = {**GOOD, "seed": i, "stream": i % 2 == 0}
            response = client.post(CHAT, json=payload)
            return i, response.status_code, None

    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(one, range(48)))
    for i, status, param in results:
        if i % 12 == 11:
            assert status == 400 and param == MALFORMED[(i // 12) % len(MALFORMED)][1], (i, status, param)
        else:
            assert status == 200, (i, status)


def test_wrong_keys_never_lock_out_the_right_one(server) -> None:
    with httpx.Client(base_url=server.url, timeout=300) as client:
        right = {"Authorization": f"Bearer {KEY}"}
        statuses = []
        for _ in range(7):
            statuses.append(client.get("/v1/models", headers={"Authorization": "Bearer wrong"}).status_code)
            assert client.get("/v1/models", headers=right).status_code == 200
        assert statuses[:5] == [401] * 5 and set(statuses[5:]) == {429}
        assert client.post(CHAT, json=GOOD, headers=right).status_code == 200


def test_behind_a_trusted_proxy_clients_are_told_apart_by_x_forwarded_for(tmp_path) -> None:
    """`--forwarded-allow-ips`: a proxy's X-Forwarded-For names the client, so one user's failed key does
    not throttle another's behind the same proxy; an untrusted peer's header is ignored."""
    with running_server(
        ["serve", "--api-key", KEY, "--forwarded-allow-ips", "127.0.0.9"], tmp_path / "data"
    ) as live:

        def get(peer: str, forwarded: str | None) -> int:
            transport = httpx.HTTPTransport(local_address=peer)
            headers = {"Authorization": "Bearer wrong"}
            if forwarded:
                headers["X-Forwarded-For"] = forwarded
            with httpx.Client(base_url=live.url, transport=transport) as client:
                return client.get("/v1/models", headers=headers).status_code

        assert [get("127.0.0.9", "10.1.1.1") for _ in range(6)] == [401] * 5 + [429]
        assert get("127.0.0.9", "10.1.1.2") == 401  # another user behind the proxy: its own count
        # An untrusted peer cannot pick its address with the header: its failures are its own.
        assert [get("127.0.0.3", f"10.9.9.{i}") for i in range(6)] == [401] * 5 + [429]
