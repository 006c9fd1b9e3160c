"""Aborts free the engine, wherever the request is: queued, decoding, denoising.

Against live `omni-studio serve` processes: a client that disconnects (streaming or not) while its request
runs frees its share of the engine (`/metrics` in-flight back to 0, a following request runs), its run is
recorded `cancelled` and the stage it was in stopped part-way; a request cancelled while queued never runs;
a prompt past the model's context is a 400 naming the field before anything is queued.

Each test waits on a state (the run recorded as running at a stage, the stream's first decode progress,
the request's place in a queue) before the client goes away, and the work is long by construction (a
5120-token decode, 400 denoising steps, 1000 forced tokens), so a slow or a fast machine gives the same
verdict. How fast an abort frees the engine is measured by bench/abort.py (docs/testing.md).
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
from studio.store.records import RunDetail
from tests.conftest import tiny_deploy
from tests.servers import running_server

# Generous deadlines: they only stop a hang, never decide a verdict.
HANG_S = 120.0
# A 2048x2048 grid: 5120 tokens (tiny-glm-image's random head only emits image codes, so its decode never
# ends early).
LONG_DECODE_SIDE = 2048


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
    text = httpx.get(server.url + "/metrics", timeout=30).text
    match = re.search(rf"^{name} (\S+)$", text, re.M)
    return float(match.group(1)) if match else 0.0


def at_stage(server, stage: int) -> bool:
    """One request in the engine and stage ``stage`` running it (none waiting there)."""
    text = httpx.get(server.url + "/metrics", timeout=30).text
    return (
        metric(server, "omni_studio_requests_in_flight") == 1
        and f'omni_studio_queue_depth{{stage="{stage}"}} 1.0' in text
        and f'omni_studio_queue_waiting{{stage="{stage}"}} 0.0' in text
    )


def wait_for(predicate, timeout: float = HANG_S, interval: float = 0.02):
    """Poll until ``predicate()`` holds (its value); the deadline only stops a hang."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if value := predicate():
            return value
        time.sleep(interval)
    raise AssertionError(f"not within {timeout} s")


def long_chat(stream: bool, prompt: str) -> dict:
    """A long AR decode: 5120 image tokens, then two denoising steps."""
    return {
        "messages": [{"role": "user", "content": prompt}],
        "height": LONG_DECODE_SIDE,
        "width": LONG_DECODE_SIDE,
        "num_inference_steps": 2,
        "stream": stream,
    }


def image(prompt: str, steps: int = 2, side: int = 64) -> dict:
    return {"prompt": prompt, "num_inference_steps": steps, "size": f"{side}x{side}"}


def send_raw(url: str, body: dict, key: str | None = None) -> socket.socket:
    """POST ``body`` as JSON on a raw socket (closing it is a client going away); ``key``: sent as a
    bearer token (who the client is, for the fair queues)."""
    parsed = httpx.URL(url)
    data = json.dumps(body).encode()
    sock = socket.create_connection((parsed.host, parsed.port), timeout=HANG_S)
    auth = f"Authorization: Bearer {key}\r\n" if key else ""
    head = (
        f"POST {parsed.raw_path.decode()} HTTP/1.1\r\nHost: {parsed.host}\r\n{auth}"
        f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n"
    )
    sock.sendall(head.encode() + data)
    return sock


def drop(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
    sock.close()


def read_until_decoding(sock: socket.socket) -> dict:
    """Read an SSE answer until a chunk reports decode progress (tokens generated, not yet all); that
    chunk's progress."""
    buffer = b""
    while True:
        received = sock.recv(65536)
        assert received, f"the stream ended before any decode progress: {buffer[-500:]!r}"
        buffer += received
        for line in buffer.split(b"\n"):
            if not line.startswith(b"data: {"):
                continue
            with contextlib.suppress(ValueError):
                progress = json.loads(line[len(b"data: ") :]).get("progress") or {}
                if progress.get("kind") == "ar" and 0 < progress["step"] < progress["total"]:
                    return progress


def run_ids(server) -> set[str]:
    store = open_store(None, server.data_dir)
    try:
        return {run.id for run in store.list_runs(limit=100)}
    finally:
        store.close()


def runs_by_prompt(server, prompt: str, before: set[str] = frozenset()) -> list[RunDetail]:
    """The recorded runs of ``prompt`` not among ``before``."""
    store = open_store(None, server.data_dir)
    try:
        return [
            store.get_run(run.id)
            for run in store.list_runs(limit=100)
            if run.id not in before and run.prompt == prompt
        ]
    finally:
        store.close()


def finished_run(server, prompt: str, before: set[str] = frozenset()) -> RunDetail:
    """The one run of ``prompt`` not among ``before``, once it has an outcome."""

    def settled() -> RunDetail | None:
        runs = runs_by_prompt(server, prompt, before)
        assert len(runs) <= 1, [r.status for r in runs]
        return runs[0] if runs and runs[0].status not in ("queued", "running") else None

    return wait_for(settled, interval=0.2)


def assert_freed(server, follow_up: tuple[str, dict]) -> None:
    """The engine is empty again and a following request runs."""
    wait_for(lambda: metric(server, "omni_studio_requests_in_flight") == 0)
    path, body = follow_up
    response = httpx.post(server.url + path, json=body, timeout=HANG_S)
    assert response.status_code == 200, response.text


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_disconnect_during_a_long_decode_frees_the_engine(image_server, stream):
    prompt = f"a red circle, decode {stream}"
    sock = send_raw(image_server.url + "/v1/chat/completions", long_chat(stream, prompt))
    try:
        if stream:  # the stream has yielded decode progress
            read_until_decoding(sock)
        else:  # stage 0 (the decode) runs the request
            wait_for(lambda: at_stage(image_server, 0))
    finally:
        drop(sock)
    assert_freed(image_server, ("/v1/images/generations", image("after a decode abort")))
    run = finished_run(image_server, prompt)
    assert run.status == "cancelled" and "disconnected" in (run.error or ""), (run.status, run.error)
    assert not run.images  # the image was never made


def test_disconnect_during_diffusion_frees_the_engine(image_server):
    prompt = "a red circle, denoising"
    sock = send_raw(image_server.url + "/v1/images/generations", image(prompt, steps=400))
    try:
        wait_for(lambda: at_stage(image_server, 1))  # the AR stage is done; stage 1 denoises
    finally:
        drop(sock)
    assert_freed(image_server, ("/v1/images/generations", image("after a denoising abort")))
    run = finished_run(image_server, prompt)
    assert run.status == "cancelled" and "disconnected" in (run.error or ""), (run.status, run.error)
    assert not run.images  # the 400 steps never finished


def test_a_request_cancelled_while_queued_never_runs(image_server):
    url = image_server.url + "/v1/chat/completions"
    # One long decode holds the AR stage (max_num_seqs 1): the next request waits in its queue.
    holder = send_raw(url, long_chat(True, "a red circle, holding the queue"))
    try:
        read_until_decoding(holder)
        queued = send_raw(image_server.url + "/v1/images/generations", image("queued"))
        try:
            wait_for(
                lambda: "omni_studio_request_queue_position{" in httpx.get(image_server.url + "/metrics").text
            )
        finally:
            drop(queued)
        run = finished_run(image_server, "queued")
        assert run.status == "cancelled" and run.started_at is None, (run.status, run.started_at)  # never ran
        assert all(stage.status == "cancelled" for stage in run.stages), run.stages
        # the queued request left the engine; the holder, which never went away, is still in it
        wait_for(lambda: metric(image_server, "omni_studio_requests_in_flight") == 1)
    finally:
        drop(holder)
    wait_for(lambda: metric(image_server, "omni_studio_requests_in_flight") == 0)
    assert finished_run(image_server, "a red circle, holding the queue").status == "cancelled"


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_disconnect_during_the_prefill_of_a_long_prompt_frees_the_engine(chat_server, stream):
    """A ~1000-token prompt (half tiny-chat's context) that must decode at least 1000 tokens: the client
    goes away as soon as the engine takes it (its prefill, one forward over the whole prompt, or its first
    tokens), and the engine is free."""
    before = run_ids(chat_server)
    words = " ".join(["cat"] * 1000)
    body = {"messages": [{"role": "user", "content": words}], "max_tokens": 1040, "stream": stream}
    sock = send_raw(chat_server.url + "/v1/chat/completions", body)
    try:
        wait_for(lambda: metric(chat_server, "omni_studio_requests_in_flight") >= 1)
    finally:
        drop(sock)
    follow_up = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 2}
    assert_freed(chat_server, ("/v1/chat/completions", follow_up))
    run = finished_run(chat_server, words, before)
    assert run.status == "cancelled" and "disconnected" in (run.error or ""), (run.status, run.error)
    assert run.text is None  # no answer was kept


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


def test_no_run_is_left_running_after_the_aborts(chat_server, image_server):
    """Every abort above ended its run: both engines are empty and no run is left queued or running."""
    for server in (chat_server, image_server):
        assert metric(server, "omni_studio_requests_in_flight") == 0
        store = open_store(None, server.data_dir)
        try:
            statuses = {run.status for run in store.list_runs(limit=100)}
        finally:
            store.close()
        assert statuses and statuses <= {"succeeded", "cancelled", "failed"}, statuses
