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
