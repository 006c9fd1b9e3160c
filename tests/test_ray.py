"""Stages as Ray actors on a real Ray cluster on this machine (docs/distributed.md).

One cluster for the module: a head node and two worker nodes with distinct custom resources. Ray binds
every interface, so these tests run only inside a network namespace that has nothing but loopback
(``scripts/test.sh`` runs them there with ``unshare -n``); elsewhere they are skipped with the reason (and
fail in CI, which must run them).

Covered: tiny-glm-shapes with stage 0 on one node and stage 1 on others gives the same bytes as embedded;
two DiT replicas both take work under concurrency; cancel reaches the actor; ``serve --ray-address``
with ``--outputs s3://...`` (moto's S3 server on 127.0.0.1) stores and serves the PNGs; killing a stage
actor mid-run fails that run (recorded, with the error) and the next one succeeds; a node that leaves
sends its stage's requests to the remaining replica.
"""

from __future__ import annotations

import io
import json
import os
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest
import yaml
from PIL import Image

from tests.conftest import png
from tests.servers import s3_server, start_server

pytestmark = pytest.mark.ray

PROMPT = "a red circle on a blue background, top left"


def _loopback_only() -> bool:
    """Whether this process's network namespace has no interface but ``lo`` (what ``unshare -n`` gives)."""
    import socket

    return [name for _, name in socket.if_nameindex()] == ["lo"]


@pytest.fixture(scope="module")
def cluster():
    """Head (``node_a``) + worker (``node_b``, ``dit``) + worker (``dit``), and this process as a driver."""
    reason = None
    if not _loopback_only():
        reason = (
            "the Ray tests run inside a loopback-only network namespace (Ray binds every interface): "
            "run them with scripts/test.sh (as root: unshare -n)"
        )
    else:
        try:
            import ray  # noqa: F401
        except ImportError:
            reason = "Ray is not installed: scripts/setup.sh test (the ray extra)"
    if reason:
        if os.environ.get("CI"):
            pytest.fail(reason)
        pytest.skip(reason)
    import ray
    from ray.cluster_utils import Cluster

    common = {"node_ip_address": "127.0.0.1", "num_cpus": 2}  # each actor takes one
    c = Cluster(
        initialize_head=True,
        head_node_args={**common, "resources": {"node_a": 1}, "include_dashboard": False},
    )
    worker = c.add_node(**common, resources={"node_b": 1, "dit": 1})
    spare = c.add_node(**common, resources={"dit": 1})
    ray.init(address=c.address, namespace="omni-tests", _node_ip_address="127.0.0.1", log_to_driver=False)
    try:
        yield {"cluster": c, "address": c.address, "worker": worker, "spare": spare}
    finally:
        ray.shutdown()
        c.shutdown()


def shapes_deploy(**stage1: object) -> dict:
    """The shipped tiny-glm-shapes preset, stage 0 pinned to the head node, stage 1 with ``stage1``."""
    from engine.paths import DEPLOY_PRESETS_DIR

    deploy = yaml.safe_load((DEPLOY_PRESETS_DIR / "tiny-glm-shapes.yaml").read_text())
    deploy["stages"][0]["resources"] = {"node_a": 1}
    deploy["stages"][1].update(stage1)
    return deploy


def request(prompt: str = PROMPT, seed: int = 7, **params: object):
    from engine.request import GenerationParams, GenerationRequest

    return GenerationRequest(prompt=prompt, params=GenerationParams(seed=seed, **params))


@pytest.fixture(scope="module")
def embedded(tmp_path_factory):
    """The same model embedded (the shipped preset), for byte comparisons."""
    from engine.engine import build_engine

    engine = build_engine("tiny-glm-shapes", data_dir=tmp_path_factory.mktemp("embedded"))
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def ray_engine(cluster, tmp_path_factory):
    """tiny-glm-shapes: stage 0 on the head, two DiT replicas, one per worker node (``dit: 1`` each)."""
    from engine.engine import build_engine

    deploy = shapes_deploy(num_replicas=2, resources={"dit": 1})
    engine = build_engine(
        "tiny-glm-shapes", deploy, data_dir=tmp_path_factory.mktemp("ray"), ray_address=cluster["address"]
    )
    yield engine
    engine.close()


def test_stages_run_on_their_nodes_and_give_the_embedded_bytes(cluster, ray_engine, embedded):
    import ray

    from engine.engine import engine_placement
    from engine.events import DiffusionStep, RunFinished, TokenProgress

    nodes = [n for n in ray.nodes() if n["Alive"]]
    head = next(n["NodeID"] for n in nodes if n["Resources"].get("node_a"))
    workers = {n["NodeID"] for n in nodes if n["Resources"].get("dit")}
    placement = engine_placement(ray_engine)
    assert [r["node_id"] for r in placement[0]] == [head]
    assert {r["node_id"] for r in placement[1]} == workers  # one DiT replica on each dit node

    events = list(ray_engine.stream(ray_engine.resolve(request())))
    finished = events[-1]
    assert isinstance(finished, RunFinished), events[-1]
    # Progress streams back from both actors while they run.
    assert any(isinstance(e, TokenProgress) and e.stage_id == 0 for e in events)
    assert [e.step for e in events if isinstance(e, DiffusionStep)] == list(range(1, 9))

    alone = embedded.run(request())
    assert png(finished.images[0]) == png(alone.images[0])
    assert finished.outputs[0].output_tokens == alone.outputs[0].output_tokens


def test_text_deltas_and_previews_stream_from_the_actors(cluster, ray_engine, chat_engine, tmp_path):
    from engine.engine import build_engine
    from engine.events import DiffusionStep, RunFinished, TextDelta
    from engine.request import GenerationParams, GenerationRequest
    from tests.conftest import tiny_deploy

    events = list(ray_engine.stream(ray_engine.resolve(request(preview_every=4))))
    previews = [e.preview for e in events if isinstance(e, DiffusionStep) and e.preview is not None]
    assert len(previews) == 1 and previews[0].size == (128, 128)  # steps 4 (8 is the final image)

    deploy = tiny_deploy("tiny-chat", stage0={"backend": "transformers"})
    chat = build_engine("tiny-chat", deploy, data_dir=tmp_path, ray_address=cluster["address"])
    try:
        ask = GenerationRequest("hello there", GenerationParams(seed=1, max_tokens=12))
        on_ray = list(chat.stream(chat.resolve(ask)))
    finally:
        chat.close()
    alone = list(chat_engine.stream(chat_engine.resolve(ask)))
    pieces = [e.text for e in on_ray if isinstance(e, TextDelta)]
    assert len(pieces) > 1  # streamed piece by piece, not at the end
    assert pieces == [e.text for e in alone if isinstance(e, TextDelta)]
    assert isinstance(on_ray[-1], RunFinished) and on_ray[-1].text == "".join(pieces) == alone[-1].text


def test_two_dit_replicas_both_take_work_under_concurrency(ray_engine):
    from engine.engine import engine_placement

    before = {r["replica"]: r["served"] for r in engine_placement(ray_engine)[1]}
    results: list[object] = []
    threads = [
        threading.Thread(
            target=lambda i=i: results.append(ray_engine.run(request(f"a green square {i}", seed=i)))
        )
        for i in range(4)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert len(results) == 4 and all(r.images for r in results)  # type: ignore[attr-defined]
    after = {r["replica"]: r["served"] for r in engine_placement(ray_engine)[1]}
    assert all(after[i] > before[i] for i in after), (before, after)


def test_cancel_reaches_the_actor(ray_engine):
    from engine.engine import engine_placement
    from engine.events import DiffusionStep, RunFailed

    seen = threading.Event()
    events: list[object] = []

    def sink(event: object) -> None:
        events.append(event)
        if isinstance(event, DiffusionStep):
            seen.set()

    handle = ray_engine.submit(ray_engine.resolve(request(num_inference_steps=400)), sink)
    assert seen.wait(60)
    cancelled_at = time.monotonic()
    ray_engine.cancel(handle.request_id)
    while handle.terminal is None and time.monotonic() - cancelled_at < 5:
        time.sleep(0.02)
    assert isinstance(handle.terminal, RunFailed) and handle.terminal.cancelled
    # The actor stopped too: its replica is free again well before 400 steps could have run.
    while (
        any(r["in_flight"] for r in engine_placement(ray_engine)[1]) and time.monotonic() - cancelled_at < 5
    ):
        time.sleep(0.02)
    assert not any(r["in_flight"] for r in engine_placement(ray_engine)[1])
    steps = [e.step for e in events if isinstance(e, DiffusionStep)]
    assert max(steps) < 400


@pytest.fixture(scope="module")
def s3():
    """moto's S3-compatible server on 127.0.0.1 with a bucket, and the AWS variables that reach it."""
    import s3fs

    with s3_server("omni-outputs") as endpoint:
        yield {"endpoint": endpoint, "fs": s3fs.S3FileSystem(endpoint_url=endpoint)}


@pytest.fixture(scope="module")
def ray_server(cluster, s3, tmp_path_factory):
    """``serve --ray-address`` with outputs in S3 and a fixed Ray namespace (so the test finds its actors)."""
    data = tmp_path_factory.mktemp("ray-serve")
    deploy = shapes_deploy()
    del deploy["stages"][0]["resources"]
    deploy["ray"] = {"namespace": "omni-test-serve", "max_restarts": 3}
    path = data / "deploy.yaml"
    path.write_text(yaml.safe_dump(deploy))
    server = start_server(
        [
            "serve",
            "--model",
            "tiny-glm-shapes",
            "--deploy-config",
            str(path),
            "--ray-address",
            cluster["address"],
            "--outputs",
            "s3://omni-outputs/runs",
            "--outputs-option",
            f"endpoint_url={s3['endpoint']}",
            "--api-key",
            "k",
        ],
        data / "studio",
        timeout=240,
    )
    yield server
    server.stop()


AUTH = {"Authorization": "Bearer k"}


def test_serve_on_ray_stores_and_serves_outputs_in_s3(ray_server, s3, embedded):
    body = {"model": "tiny-glm-shapes", "prompt": PROMPT, "seed": 3, "response_format": "url"}
    response = httpx.post(ray_server.url + "/v1/images/generations", json=body, headers=AUTH, timeout=120)
    assert response.status_code == 200, response.text
    url = response.json()["data"][0]["url"]
    served = httpx.get(url if url.startswith("http") else ray_server.url + url, timeout=30)
    assert served.status_code == 200 and served.content.startswith(b"\x89PNG")
    # What a user gets is the embedded studio's picture, and its recipe names the same config.
    image = Image.open(io.BytesIO(served.content))
    assert image.tobytes() == embedded.run(request(seed=3)).images[0].tobytes()
    assert json.loads(image.text["omni_studio"])["config_hash"] == embedded.config_hash
    sha = url.split("/v1/outputs/")[1].split(".png")[0]
    fs = s3["fs"]
    fs.invalidate_cache()
    assert fs.cat_file(f"omni-outputs/runs/{sha[:2]}/{sha}.png") == served.content
    # Another studio sharing the store has none of it cached: the file comes from S3.
    cache = ray_server.data_dir / "outputs-cache"
    for file in cache.rglob(f"{sha}.png"):
        file.unlink()
    again = httpx.get(ray_server.url + f"/v1/outputs/{sha}.png", headers=AUTH, timeout=30)
    assert again.status_code == 200 and again.content == served.content


def _runs(data_dir: Path) -> list[dict]:
    from studio.store import RunFilter, open_store

    store = open_store(None, data_dir)
    try:
        return [
            {"id": r.id, "status": r.status, "error": r.error} for r in store.list_runs(RunFilter(), limit=50)
        ]
    finally:
        store.close()


def test_a_killed_stage_actor_fails_its_run_and_the_next_one_succeeds(ray_server):
    import ray

    names = [
        a["name"]
        for a in ray.util.list_named_actors(all_namespaces=True)
        if a["namespace"] == "omni-test-serve" and a["name"].startswith("stage-1-replica-0-")
    ]
    assert len(names) == 1, names
    actor = ray.get_actor(names[0], namespace="omni-test-serve")
    pid = ray.get(actor.describe.remote())["pid"]

    body = {
        "model": "tiny-glm-shapes",
        "messages": [{"role": "user", "content": PROMPT}],
        "stream": True,
        "seed": 5,
        "num_inference_steps": 400,
    }
    chunks: list[str] = []
    with httpx.stream(
        "POST", ray_server.url + "/v1/chat/completions", json=body, headers=AUTH, timeout=120
    ) as response:
        assert response.status_code == 200
        killed = False
        for line in response.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[len("data: ") :])
            chunks.append(chunk)
            progress = chunk.get("progress") or {}
            if not killed and progress.get("kind") == "diffusion" and progress.get("step", 0) >= 1:
                os.kill(pid, signal.SIGKILL)  # the DiT actor dies mid-run
                killed = True
    assert killed, chunks[-3:]
    error = chunks[-1].get("error") or {}
    assert "stage 1 replica 0" in error.get("message", "") and "was lost mid-run" in error["message"], chunks[
        -1
    ]
    failed = [r for r in _runs(ray_server.data_dir) if r["status"] == "failed"]
    assert failed and "stage 1 replica 0" in failed[0]["error"] and "lost mid-run" in failed[0]["error"]

    # Ray restarts the actor (reloading the model); the next request waits for it and succeeds.
    succeeded = sum(r["status"] == "succeeded" for r in _runs(ray_server.data_dir))
    response = httpx.post(
        ray_server.url + "/v1/images/generations",
        json={"model": "tiny-glm-shapes", "prompt": PROMPT, "seed": 6},
        headers=AUTH,
        timeout=180,
    )
    assert response.status_code == 200, response.text
    assert ray.get(actor.describe.remote())["pid"] != pid
    deadline = time.monotonic() + 10  # the recorder writes on its own thread
    while sum(r["status"] == "succeeded" for r in _runs(ray_server.data_dir)) == succeeded:
        assert time.monotonic() < deadline, _runs(ray_server.data_dir)[:3]
        time.sleep(0.1)


def test_a_stage_the_cluster_cannot_place_fails_the_start_saying_what_is_missing(cluster, tmp_path):
    from engine.engine import EngineBuildError, build_engine

    deploy = {**shapes_deploy(), "ray": {"start_timeout_s": 2}}
    deploy["stages"][0]["resources"] = {"tpu_pod": 1}
    with pytest.raises(EngineBuildError) as info:
        build_engine("tiny-glm-shapes", deploy, data_dir=tmp_path, ray_address=cluster["address"])
    message = str(info.value)
    assert "stage 0 replica(s) 0 not started within 2 s" in message, message
    assert "'tpu_pod': 1.0" in message and "node_b" in message and "docs/distributed.md" in message


def test_a_node_that_leaves_sends_its_stage_to_the_other_replica(cluster, ray_engine):
    """Last in the module: it removes a worker node."""
    from engine.engine import engine_placement
    from engine.events import RunFinished

    spare = cluster["spare"].node_id
    assert spare in {r["node_id"] for r in engine_placement(ray_engine)[1]}
    cluster["cluster"].remove_node(cluster["spare"])
    results = [ray_engine.run(request(f"a yellow triangle {i}", seed=20 + i)) for i in range(3)]
    assert all(isinstance(r, RunFinished) and r.images for r in results)
    placement = {r["node_id"]: r for r in engine_placement(ray_engine)[1]}
    live = [r for r in placement.values() if r["up"]]
    assert len(live) == 1 and live[0]["node_id"] != spare
