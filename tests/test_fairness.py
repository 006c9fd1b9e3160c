"""Isolation and fairness: a per-client in-flight limit, a bounded queue (429 + Retry-After), queue
positions in /metrics, against a live `omni-studio serve`."""

from __future__ import annotations

import re

import httpx
import pytest
import yaml

from tests.conftest import tiny_deploy
from tests.servers import running_server
from tests.test_abort import drop, image, long_chat, metric, send_raw, wait_for


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    # One AR slot, so later requests wait in stage 0's queue (with more they join the running decode).
    data_dir = tmp_path_factory.mktemp("fairness")
    deploy_path = data_dir / "deploy.yaml"
    deploy_path.write_text(yaml.safe_dump(tiny_deploy("tiny-glm-image", stage0={"max_num_seqs": 1})))
    args = ["serve", "--model", "tiny-glm-image", "--deploy-config", str(deploy_path)]
    args += ["--max-in-flight-per-client", "2", "--max-queue", "3"]
    with running_server(args, data_dir) as live:
        yield live


def post(server, key: str, body: dict) -> httpx.Response:
    return httpx.post(
        server.url + "/v1/images/generations",
        json=body,
        headers={"Authorization": f"Bearer {key}"},
        timeout=60,
    )


def positions(server) -> list[float]:
    text = httpx.get(server.url + "/metrics", timeout=5).text
    return sorted(
        float(v) for v in re.findall(r"^omni_studio_request_queue_position\{[^}]*\} (\S+)$", text, re.M)
    )


def test_per_client_limit_queue_bound_and_positions(server):
    url = server.url + "/v1/chat/completions"
    a1 = send_raw(url, long_chat(False, "a long decode"), key="client-a")
    wait_for(lambda: metric(server, "omni_studio_requests_in_flight") == 1, 30)
    a2 = send_raw(url, long_chat(False, "a long decode"), key="client-a")
    wait_for(lambda: metric(server, "omni_studio_requests_in_flight") == 2, 10)

    # client a is at its limit (2): its third request is refused at once, recorded, with Retry-After
    refused = post(server, "client-a", image("a red circle", steps=1))
    assert refused.status_code == 429, refused.text
    assert refused.headers["retry-after"].isdigit()
    assert refused.json()["error"]["code"] == "client_limit"
    assert refused.headers.get("x-run-id")

    # another client still gets in; while it waits its place in the queue is in /metrics
    b1 = send_raw(server.url + "/v1/images/generations", image("a red circle", steps=1), key="client-b")
    wait_for(lambda: metric(server, "omni_studio_requests_in_flight") == 3, 10)
    wait_for(lambda: positions(server) == [1.0, 2.0], 10)  # a2 behind a1, b1 behind both
    assert re.search(
        r'^omni_studio_queue_waiting\{stage="0"\} 2\.0$', httpx.get(server.url + "/metrics").text, re.M
    )

    # the queue (--max-queue 3) is full: a third client gets 429 + Retry-After
    full = post(server, "client-c", image("a red circle", steps=1))
    assert full.status_code == 429, full.text
    assert full.headers["retry-after"].isdigit()
    assert full.json()["error"]["code"] == "queue_full"

    # client a walks away: client b's request runs to a 200 and client a has slots again
    drop(a1)
    drop(a2)
    drop(b1)
    wait_for(lambda: metric(server, "omni_studio_requests_in_flight") == 0, 5)
    assert post(server, "client-b", image("a red circle", steps=1)).status_code == 200
    assert post(server, "client-a", image("a red circle", steps=1)).status_code == 200


def test_a_streamed_request_over_the_client_limit_is_a_429_not_a_chunk(server):
    url = server.url + "/v1/chat/completions"
    held = [send_raw(url, long_chat(False, "a long decode"), key="client-s") for _ in range(2)]
    try:
        wait_for(lambda: metric(server, "omni_studio_requests_in_flight") == 2, 30)
        response = httpx.post(
            url,
            json={**long_chat(True, "a long decode"), "height": 64, "width": 64},
            headers={"Authorization": "Bearer client-s"},
        )
        assert response.status_code == 429 and response.headers["retry-after"].isdigit()
    finally:
        for sock in held:
            drop(sock)
    wait_for(lambda: metric(server, "omni_studio_requests_in_flight") == 0, 5)


def test_waiting_requests_are_served_round_robin_across_clients(tmp_path):
    """One client queues eight requests, then another client one: with one AR slot, the second client's
    request runs right after the one running now, not behind the other seven (its stage 0 start order)."""
    import threading

    from engine import GenerationParams, GenerationRequest, build_engine
    from engine.events import StageStarted

    deploy = tiny_deploy("tiny-glm-image", stage0={"max_num_seqs": 1})
    engine = build_engine("tiny-glm-image", deploy, data_dir=tmp_path)
    started: list[str] = []
    lock = threading.Lock()

    def run(client: str, index: int, steps: int) -> None:
        request = GenerationRequest(
            f"{client} {index}",
            GenerationParams(seed=index, height=128, width=128, num_inference_steps=steps),
        )
        request = GenerationRequest(request.prompt, request.params, client=client)
        for event in engine.stream(engine.resolve(request)):
            if isinstance(event, StageStarted) and event.stage_id == 0:
                with lock:
                    started.append(client)

    try:
        first = threading.Thread(target=run, args=("busy", 0, 512))  # a long decode: the others queue
        first.start()
        wait_for(lambda: started == ["busy"], 30)  # running: the others wait in stage 0's queue
        threads = [threading.Thread(target=run, args=("busy", i, 64)) for i in range(1, 8)]
        for thread in threads:
            thread.start()
        wait_for(lambda: engine.waiting_depths()[0] == 7 or len(started) > 1, 30)
        late = threading.Thread(target=run, args=("quiet", 0, 64))
        late.start()
        for thread in [first, *threads, late]:
            thread.join(timeout=300)
        assert len(started) == 9
        # Served round-robin: the quiet client's one request is at most one "busy" job behind the one that
        # was running when it arrived (FIFO would have put it last, behind all seven).
        assert started.index("quiet") <= 2, started
    finally:
        engine.close()


def test_a_newcomer_joins_the_running_decode_beside_a_client_holding_every_slot(tmp_path):
    """Fair admission (docs/batching.md): one client holds all four AR slots with long decodes and queues
    more; another client's short request joins the running steps at once, so it starts and finishes its
    decode while the busy rows are still decoding. Lighter clients first: the busy client is heavy (4
    rows, engine/client_load.py), so the newcomer steps alone (1 row, not max_num_seqs' 4), every busy
    row paused meanwhile. Without it, the newcomer would wait for a
    slot (a busy decode has ~16x its tokens), then decode in full steps beside the busy rows. The paused
    rows lose nothing: their pictures equal the ones they draw alone."""
    import threading

    from engine import GenerationParams, GenerationRequest, build_engine
    from engine.events import RunFinished, StageFinished, StageStarted

    deploy = tiny_deploy("tiny-glm-image", stage0={"max_num_seqs": 4})
    engine = build_engine("tiny-glm-image", deploy, data_dir=tmp_path)
    log: list[tuple[str, str, int]] = []  # (event, request name, step rows)
    images: dict[str, bytes] = {}
    lock = threading.Lock()
    handles = {}

    def request(name: str, client: str, size: int) -> GenerationRequest:
        params = GenerationParams(seed=len(name), height=size, width=size, num_inference_steps=1)
        return GenerationRequest(f"a lighthouse, {name}", params, client=client)

    def run(name: str, client: str, size: int) -> None:
        resolved = engine.resolve(request(name, client, size))

        def sink(event) -> None:
            with lock:
                if isinstance(event, StageStarted) and event.stage_id == 0:
                    log.append(("started", name, 0))
                if isinstance(event, StageFinished) and event.stage_id == 0:
                    log.append(("finished", name, event.step_rows))
                if isinstance(event, RunFinished) and event.images:
                    images[name] = event.images[0].tobytes()

        handles[name] = engine.submit(resolved, sink)

    def names(kind: str) -> list[str]:
        with lock:
            return [name for event, name, _ in log if event == kind]

    try:
        for name in ("busy-1", "busy-2", "busy-3", "busy-4"):
            run(name, "busy", 256)
        wait_for(lambda: len(names("started")) == 4, 60)
        run("busy-5", "busy", 64)  # queued: every slot is taken by the busy client
        wait_for(lambda: engine.waiting_depths()[0] == 1, 30)
        run("quiet", "quiet", 64)
        wait_for(lambda: "quiet" in images, 120)
        with lock:
            events = list(log)
        started_quiet = events.index(("started", "quiet", 0))
        finished_quiet = next(i for i, e in enumerate(events) if e[:2] == ("finished", "quiet"))
        busy_finished = [i for i, e in enumerate(events) if e[0] == "finished" and e[1].startswith("busy")]
        assert not busy_finished or min(busy_finished) > finished_quiet, events  # decoded beside both
        assert events[finished_quiet][2] == 1, events  # lighter client first: every busy row paused
        assert "busy-5" not in names("started")[: started_quiet + 1], events  # ahead of the queued one
        wait_for(lambda: len(images) == 6, 300)
        for name in ("busy-1", "busy-3"):  # busy rows: paused while the newcomer decoded
            alone = engine.run(request(name, "alone", 256))
            assert alone.images[0].tobytes() == images[name], name
    finally:
        engine.close()


def test_a_quiet_clients_job_runs_in_a_denoise_batch_of_its_own(tmp_path):
    """A heavy client's jobs never share a batch with other clients' (engine/workers.py,
    docs/batching.md): while a long denoise holds the stage, a busy client queues four jobs and a quiet
    one queues one; the busy four run as one batch, the quiet job in a batch of its own (FIFO batching
    would put the quiet one into the busy batch, paced by it)."""
    import threading

    from engine import GenerationParams, GenerationRequest, build_engine
    from engine.events import RunFinished, StageFinished, StageStarted

    deploy = tiny_deploy("tiny-glm-image", stage1={"max_num_seqs": 5})
    engine = build_engine("tiny-glm-image", deploy, data_dir=tmp_path)
    batch_sizes: dict[str, int] = {}
    started: list[str] = []
    finished: list[str] = []
    lock = threading.Lock()

    def run(name: str, client: str, steps: int) -> None:
        params = GenerationParams(seed=len(name), height=64, width=64, num_inference_steps=steps)
        resolved = engine.resolve(GenerationRequest(f"a lighthouse, {name}", params, client=client))

        def sink(event) -> None:
            with lock:
                if isinstance(event, StageStarted) and event.stage_id == 1:
                    started.append(name)
                if isinstance(event, StageFinished) and event.stage_id == 1:
                    batch_sizes[name] = event.batch_size
                if isinstance(event, RunFinished):
                    finished.append(name)

        engine.submit(resolved, sink)

    try:
        run("blocker", "blocker", 400)  # a long denoise: the others queue at stage 1 behind it
        wait_for(lambda: "blocker" in started, 60)
        for i in range(4):
            run(f"busy-{i}", "busy", 2)
        run("quiet", "quiet", 2)
        wait_for(lambda: engine.waiting_depths()[1] == 5 or "blocker" in finished, 60)
        assert engine.waiting_depths()[1] == 5, "the blocker ended before the others queued behind it"
        wait_for(lambda: len(finished) == 6, 300)
        assert batch_sizes["quiet"] == 1, batch_sizes
        assert [batch_sizes[f"busy-{i}"] for i in range(4)] == [4, 4, 4, 4], batch_sizes
    finally:
        engine.close()


def test_a_heavier_clients_batch_waits_while_a_lighter_request_is_in_flight(tmp_path, monkeypatch):
    """Lighter clients first across stages (engine/client_load.py): four jobs of a busy (heavy) client
    wait at the DiT stage behind a long denoise; a quiet client's request is decoding its tokens when the denoise
    ends. The busy batch is held back (here without a time limit) until the quiet request reaches the
    stage, which then denoises it first, instead of the busy batch taking the stage while the quiet
    request decodes and the quiet one waiting for it."""
    import threading

    import engine.workers as workers
    from engine import GenerationParams, GenerationRequest, build_engine
    from engine.events import RunFinished, StageStarted, TokenProgress

    monkeypatch.setattr(workers, "HOLD_LIMIT_S", 600.0)
    engine = build_engine("tiny-glm-image", tiny_deploy("tiny-glm-image"), data_dir=tmp_path)
    started: list[str] = []
    finished: list[str] = []
    decoding, release = threading.Event(), threading.Event()
    lock = threading.Lock()

    def run(name: str, client: str, steps: int) -> None:
        params = GenerationParams(seed=len(name), height=64, width=64, num_inference_steps=steps)
        resolved = engine.resolve(GenerationRequest(f"a lighthouse, {name}", params, client=client))

        def sink(event) -> None:
            if name == "quiet" and isinstance(event, TokenProgress) and not decoding.is_set():
                decoding.set()
                release.wait(120)  # holds the quiet request mid-decode (this is the decode thread)
            with lock:
                if isinstance(event, StageStarted) and event.stage_id == 1:
                    started.append(name)
                if isinstance(event, RunFinished):
                    finished.append(name)

        engine.submit(resolved, sink)

    try:
        run("blocker", "blocker", 300)
        wait_for(lambda: "blocker" in started, 60)
        for i in range(4):  # a heavy client (engine/client_load.py)
            run(f"busy-{i}", "busy", 2)
        wait_for(lambda: engine.waiting_depths()[1] == 4 or "blocker" in finished, 60)
        assert engine.waiting_depths()[1] == 4, "the blocker ended before the busy jobs queued behind it"
        run("quiet", "quiet", 2)
        assert decoding.wait(60)
        wait_for(lambda: "blocker" in finished, 120)
        release.set()
        wait_for(lambda: len(finished) == 6, 120)
        assert started[:2] == ["blocker", "quiet"] and sorted(started[2:]) == [
            f"busy-{i}" for i in range(4)
        ], started
    finally:
        release.set()
        engine.close()
