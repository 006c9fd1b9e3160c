"""Aborts free the engine within a second, wherever the request is: queued, decoding, denoising.

Against live `omni-studio serve` processes: a client that disconnects (streaming or not) frees its share of
the engine (a following request starts, `/metrics` in-flight back to 0) within 1 s and its run is recorded
`cancelled`; a request cancelled while queued never runs; a prompt past the model's context is a 400
naming the field before anything is queued.
"""

from __future__ import annotations

import contextlib
import json
import re
import socket
import time

import httpx
import pytest
import yaml

from studio.store import open_store
from tests.conftest import tiny_deploy
from tests.servers import running_server

ABORT_BUDGET_S = 1.0
MEASURED: list[float] = []


@pytest.fixture(scope="module")
def chat_server(tmp_path_factory):
    # min_tokens: a long prompt's request decodes at least 1000 tokens after its prefill (a random tiny
    # model may otherwise end at once; 1000 tokens take seconds), so the client surely walks away from a
    # running request, however late the test sees it start.
    data_dir = tmp_path_factory.mktemp("abort-chat")
    deploy = tiny_deploy("tiny-chat")
    deploy["stages"][0]["default_sampling_params"]["min_tokens"] = 1000
    deploy_path = data_dir / "deploy.yaml"
    deploy_path.write_text(yaml.safe_dump(deploy))
    with running_server(
        ["serve", "--model", "tiny-chat", "--deploy-config", str(deploy_path)], data_dir
    ) as server:
        yield server


@pytest.fixture(scope="module")
def image_server(tmp_path_factory):
    # One AR slot: a long decode holds stage 0 and the next request waits in its queue (with more
    # slots it would join the running decode at once: continuous batching).
    data_dir = tmp_path_factory.mktemp("abort-image")
    deploy_path = data_dir / "deploy.yaml"
    deploy_path.write_text(yaml.safe_dump(tiny_deploy("tiny-glm-image", stage0={"max_num_seqs": 1})))
    with running_server(
        ["serve", "--model", "tiny-glm-image", "--deploy-config", str(deploy_path)], data_dir
    ) as server:
        yield server


def metric(server, name: str) -> float:
    text = httpx.get(server.url + "/metrics", timeout=5).text
    match = re.search(rf"^{name} (\S+)$", text, re.M)
    return float(match.group(1)) if match else 0.0


def wait_for(predicate, timeout: float, interval: float = 0.02) -> float:
    """Seconds until ``predicate()`` holds (fails the test past ``timeout``)."""
    started = time.monotonic()
    while time.monotonic() - started < timeout:
        if predicate():
            return time.monotonic() - started
        time.sleep(interval)
    raise AssertionError(f"not within {timeout} s")


def long_chat(stream: bool) -> dict:
    """A long AR decode: tiny-glm-image's random head only emits image codes, so a 1024x1024 grid never
    ends early: 1280 tokens, over a second even with the lean batched decode (a 512x512 grid's 320 tokens
    could finish inside the test's half-second hold)."""
    return {
        "messages": [{"role": "user", "content": "a red circle"}],
        "height": 1024,
        "width": 1024,
        "num_inference_steps": 2,
        "stream": stream,
    }


def long_image(steps: int = 1, side: int = 64) -> dict:
    return {"prompt": "a red circle", "num_inference_steps": steps, "size": f"{side}x{side}"}


def _post(client: httpx.Client, url: str, body: dict) -> None:
    with contextlib.suppress(httpx.HTTPError):
        client.post(url, json=body)


def send_raw(url: str, body: dict, key: str | None = None) -> socket.socket:
    """POST ``body`` as JSON on a raw socket (closing it is a client going away)."""
    parsed = httpx.URL(url)
    data = json.dumps(body).encode()
    sock = socket.create_connection((parsed.host, parsed.port), timeout=30)
    head = (
        f"POST {parsed.raw_path.decode()} HTTP/1.1\r\nHost: {parsed.host}\r\n"
        + (f"Authorization: Bearer {key}\r\n" if key else "")
        + f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n"
    )
    sock.sendall(head.encode() + data)
    return sock


def drop(sock: socket.socket) -> float:
    closed_at = time.monotonic()
    sock.shutdown(socket.SHUT_RDWR)
    sock.close()
    return closed_at


def start_and_drop(url: str, body: dict, started, hold_s: float = 0.0) -> tuple[float, None]:
    """Send ``body``, wait until ``started()`` says the engine runs it, then close the connection.
    Returns the time of the disconnect."""
    sock = send_raw(url, body)
    try:
        wait_for(started, 30)
        time.sleep(hold_s)
    finally:
        closed_at = drop(sock)
    return closed_at, None


def assert_freed(server, closed_at: float, follow_up: tuple[str, dict]) -> float:
    """The engine is empty again and a following request runs, both within the budget."""
    wait_for(lambda: metric(server, "omni_studio_requests_in_flight") == 0, 5)
    freed = time.monotonic() - closed_at
    path, body = follow_up
    response = httpx.post(server.url + path, json=body, timeout=60)
    assert response.status_code == 200, response.text
    MEASURED.append(freed)
    assert freed <= ABORT_BUDGET_S, f"the engine was freed {freed:.2f} s after the disconnect"
    return freed


def latest_status(server) -> dict[str, str]:
    store = open_store(None, server.data_dir)
    try:
        return {run.id: run.status for run in store.list_runs(limit=50)}
    finally:
        store.close()


def wait_cancelled(server, before: set[str]) -> None:
    def cancelled() -> bool:
        new = {rid: status for rid, status in latest_status(server).items() if rid not in before}
        return "cancelled" in new.values()

    try:
        wait_for(cancelled, 10, 0.2)
    except AssertionError:
        raise AssertionError(f"no cancelled run among {latest_status(server)} (before: {before})") from None


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_disconnect_during_a_long_decode_frees_the_engine(image_server, stream):
    before = set(latest_status(image_server))
    closed_at, _ = start_and_drop(
        image_server.url + "/v1/chat/completions",
        long_chat(stream),
        lambda: metric(image_server, "omni_studio_requests_in_flight") == 1,
        hold_s=0.5,  # well inside the decode
    )
    assert_freed(image_server, closed_at, ("/v1/images/generations", long_image(steps=2)))
    wait_cancelled(image_server, before)


def test_disconnect_during_diffusion_frees_the_engine(image_server):
    before = set(latest_status(image_server))

    def denoising() -> bool:  # the AR stage is done; stage 1 runs
        text = httpx.get(image_server.url + "/metrics", timeout=5).text
        return 'omni_studio_queue_depth{stage="1"} 1.0' in text

    closed_at, _ = start_and_drop(
        image_server.url + "/v1/images/generations", long_image(steps=400, side=64), denoising, hold_s=0.2
    )
    assert_freed(image_server, closed_at, ("/v1/images/generations", long_image(steps=2)))
    wait_cancelled(image_server, before)


def test_a_request_cancelled_while_queued_never_runs(image_server):
    before = set(latest_status(image_server))
    url = image_server.url + "/v1/chat/completions"
    # One long decode holds the AR stage (max_num_seqs 1): the next request waits in its queue.
    holder = send_raw(url, long_chat(False))
    wait_for(lambda: metric(image_server, "omni_studio_requests_in_flight") == 1, 30)
    closed_at, _ = start_and_drop(
        image_server.url + "/v1/images/generations",
        {**long_image(steps=2), "prompt": "queued"},
        lambda: "omni_studio_request_queue_position{" in httpx.get(image_server.url + "/metrics").text,
        hold_s=0.1,
    )
    wait_for(lambda: metric(image_server, "omni_studio_requests_in_flight") == 1, ABORT_BUDGET_S)
    MEASURED.append(time.monotonic() - closed_at)
    drop(holder)
    wait_for(lambda: metric(image_server, "omni_studio_requests_in_flight") == 0, ABORT_BUDGET_S + 1)
    store = open_store(None, image_server.data_dir)
    try:
        runs = [run for run in store.list_runs(limit=50) if run.id not in before and run.prompt == "queued"]
        assert len(runs) == 1 and runs[0].status == "cancelled"
        assert runs[0].started_at is None  # it never ran
    finally:
        store.close()


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_disconnect_during_the_prefill_of_a_long_prompt_frees_the_engine(chat_server, stream):
    """A ~1000-token prompt (half tiny-chat's context): the client goes away as soon as the engine takes it
    (its prefill, one forward over the whole prompt, or its first tokens), and the engine is free within
    the budget."""
    url = chat_server.url + "/v1/chat/completions"
    before = set(latest_status(chat_server))
    body = {
        "messages": [{"role": "user", "content": " ".join(["cat"] * 1000)}],
        "max_tokens": 1040,
        "stream": stream,
    }
    closed_at, _ = start_and_drop(
        url, body, lambda: metric(chat_server, "omni_studio_requests_in_flight") >= 1
    )
    follow_up = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 2}
    assert_freed(chat_server, closed_at, ("/v1/chat/completions", follow_up))
    wait_cancelled(chat_server, before)


def test_a_prompt_past_the_context_is_refused_before_the_queue(chat_server, image_server):
    words = " ".join(["cat"] * 3000)  # 3000 tokens > tiny-chat's 2048 positions, < --max-prompt-chars
    response = httpx.post(
        chat_server.url + "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": words}], "max_tokens": 4},
        timeout=30,
    )
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "messages" and "2048" in error["message"]
    assert metric(chat_server, "omni_studio_requests_in_flight") == 0

    response = httpx.post(
        image_server.url + "/v1/images/generations",
        json={"prompt": " ".join(["red"] * 6000), "size": "64x64", "num_inference_steps": 1},
        timeout=30,
    )
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "prompt" and "context" in error["message"]


def test_report_abort_times():
    if MEASURED:
        print(f"\nabort -> engine free: max {max(MEASURED):.3f} s over {len(MEASURED)} aborts")
