"""Runs made through a live `omni-studio serve` are recorded: concurrent successes, refusals and failures,
client disconnects, and a server killed mid-run (SQLite and PostgreSQL)."""

from __future__ import annotations

import contextlib
import json
import signal
import socket
import threading

import httpx

from studio.store import RunFilter, open_store
from tests.servers import start_server
from tests.test_abort import wait_for

pytest_plugins = ["conftest_store"]


def chat(prompt: str, **fields) -> dict:
    return {"messages": [{"role": "user", "content": prompt}], **fields}


def test_concurrent_requests_and_failures_are_all_recorded(db_url, tmp_path):
    server = start_server(["serve", "--db", db_url, "--fingerprint-mode", "hash"], tmp_path / "data")
    try:
        statuses: list[int] = []

        def one(seed: int) -> None:
            response = httpx.post(
                server.url + "/v1/chat/completions", timeout=120, json=chat(f"concurrent {seed}", seed=seed)
            )
            statuses.append(response.status_code)

        threads = [threading.Thread(target=one, args=(seed,)) for seed in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert statuses == [200] * 8
        bad = httpx.post(server.url + "/v1/chat/completions", timeout=60, json=chat("bad size", height=50))
        assert bad.status_code == 400
        unknown = httpx.post(
            server.url + "/v1/chat/completions", timeout=60, json={**chat("who"), "model": "nope"}
        )
        assert unknown.status_code == 404
        fingerprint = httpx.get(server.url + "/v1/models").json()["data"][0]["config_hash"][:8]
    finally:
        server.stop()  # SIGTERM: the recorder flushes on the way out

    store = open_store(db_url, tmp_path / "data")
    try:
        succeeded = store.list_runs(RunFilter(status="succeeded", source="api"), limit=100)
        assert sorted(r.prompt for r in succeeded) == sorted(f"concurrent {s}" for s in range(8))
        for summary in succeeded:
            run = store.get_run(summary.id)
            assert run.fingerprint == f"omni-studio-0.1.0-{fingerprint}"
            assert run.config_hash.startswith(fingerprint) and run.config["family"] == "glm-image"
            assert [(s.stage_id, s.status) for s in run.stages] == [(0, "succeeded"), (1, "succeeded")]
            assert all((s.seconds or 0) > 0 for s in run.stages)
            (image,) = run.images
            assert image.path.is_file() and image.path.stat().st_size == image.size_bytes
        failed = {r.prompt: r for r in store.list_runs(RunFilter(status="failed"), limit=100)}
        assert "height: must be a multiple of 32" in failed["bad size"].error
        assert "does not exist" in failed["who"].error
    finally:
        store.close()


def post_and_hold(url: str, body: dict) -> socket.socket:
    """POST ``body`` on a raw socket and leave the answer unread: closing the socket is the client going
    away, whenever the test chooses."""
    target = httpx.URL(url)
    data = json.dumps(body).encode()
    sock = socket.create_connection((target.host, target.port), timeout=30)
    head = (
        f"POST {target.raw_path.decode()} HTTP/1.1\r\nHost: {target.host}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n"
    )
    sock.sendall(head.encode() + data)
    return sock


def test_client_disconnect_is_recorded_as_cancelled(tmp_path):
    server = start_server(["serve"], tmp_path / "data")
    try:
        store = open_store(None, tmp_path / "data")
        try:
            # 200 steps at 512x512 after a 320-token decode: far longer than the few polls it takes to
            # see the run recorded as running, so the client surely walks away mid-run.
            sock = post_and_hold(
                server.url + "/v1/chat/completions",
                chat("walk away", seed=1, height=512, width=512, num_inference_steps=200),
            )
            try:
                wait_for(lambda: store.list_runs(RunFilter(search="walk away", status="running")), timeout=60)
            finally:
                sock.shutdown(socket.SHUT_RDWR)
                sock.close()
            run = wait_for(
                lambda: next(iter(store.list_runs(RunFilter(search="walk away", status="cancelled"))), None),
                timeout=60,
            )
            assert "disconnected" in store.get_run(run.id).error
            assert [r.id for r in store.list_runs(RunFilter(search="walk away"))] == [run.id]
        finally:
            store.close()
        # the engine let go of it: a new request runs
        assert (
            httpx.post(server.url + "/v1/chat/completions", timeout=60, json=chat("next")).status_code == 200
        )
    finally:
        server.stop()


def test_kill_9_mid_run_then_restart_marks_the_run_interrupted(db_url, tmp_path):
    data = tmp_path / "data"
    server = start_server(["serve", "--db", db_url], data)
    try:

        def doomed() -> None:
            with contextlib.suppress(httpx.HTTPError):  # the server dies under this request
                httpx.post(
                    server.url + "/v1/chat/completions",
                    timeout=120,
                    json=chat("killed mid-run", height=512, width=512, num_inference_steps=300),
                )

        threading.Thread(target=doomed, daemon=True).start()
        store = open_store(db_url, data)
        try:
            wait_for(
                lambda: store.list_runs(RunFilter(search="killed mid-run", status="running")), timeout=60
            )
        finally:
            store.close()
        server.stop(signal.SIGKILL)
    finally:
        server.stop()
    restarted = start_server(["serve", "--db", db_url], data)
    try:
        store = open_store(db_url, data)
        try:
            runs = store.list_runs(RunFilter(search="killed mid-run"))
            assert [r.status for r in runs] == ["interrupted"]
            assert store.count_runs(RunFilter(status=["running", "queued"])) == 0
        finally:
            store.close()
    finally:
        restarted.stop()
