"""RunStore: recording, reading, filtering, comparing, retention and crash recovery (SQLite and PostgreSQL)."""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import textwrap
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from PIL import Image
from sqlalchemy import text, update

from studio.media.images import png_bytes
from studio.store import AmbiguousRunId, RunFilter, RunNotFound, RunStore, open_store
from studio.store.base import INTERRUPTED_ERROR
from studio.store.models import Run

pytest_plugins = ["conftest_store"]

REPO = Path(__file__).resolve().parent.parent
CONFIG = {
    "family": "glm_image",
    "model": {"name": "tiny-glm-image", "identity": "tiny:1"},
    "async_chunk": False,
    "stages": [
        {"stage_id": 0, "engine_args": {"max_num_seqs": 1}},
        {"stage_id": 1, "engine_args": {"max_num_seqs": 2}, "default_sampling_params": {"steps": 4}},
    ],
}


def new_run(store: RunStore, prompt: str = "a red fox", **overrides) -> str:
    values = {
        "source": "api",
        "prompt": prompt,
        "model": "tiny-glm-image",
        "request": {"prompt": prompt},
        "parameters": {"seed": 1, "num_inference_steps": 4},
        "seed": 1,
        "config": CONFIG,
        "fingerprint": "omni-studio-0.1.0-aaaa0000",
    }
    values.update(overrides)
    return store.create_run(**values)


def set_created(store: RunStore, run_id: str, when: datetime) -> None:
    with store.engine.begin() as connection:
        connection.execute(update(Run).where(Run.id == run_id).values(created_at=when))


# -- recording and reading ------------------------------------------------------------------------------


def test_a_run_records_everything_and_reads_back(store: RunStore) -> None:
    started = time.time()
    run_id = new_run(store, seed=2**62, parameters={"seed": 2**62, "guidance_scale": 1.5})
    assert store.get_run(run_id).status == "queued"
    assert store.mark_running(run_id, at=started)
    store.add_stage(
        run_id,
        stage_id=0,
        kind="ar",
        status="succeeded",
        started_at=started,
        finished_at=started + 1.25,
        queue_seconds=0.5,
        input_tokens=7,
        output_tokens=64,
        batch_size=2,
    )
    picture = Image.new("RGB", (48, 32), (10, 20, 30))
    sha = store.add_output(run_id, 0, png_bytes(picture), "image/png", 48, 32)
    assert store.finish_run(run_id, "succeeded", text=None, usage={"input_tokens": 7, "output_tokens": 64})

    run = store.get_run(run_id)
    assert (run.status, run.source, run.prompt, run.model) == (
        "succeeded",
        "api",
        "a red fox",
        "tiny-glm-image",
    )
    assert run.seed == 2**62 and run.parameters == {"seed": 2**62, "guidance_scale": 1.5}
    assert run.fingerprint == "omni-studio-0.1.0-aaaa0000"
    assert run.config == CONFIG
    assert (
        run.config_hash
        == hashlib.sha256(
            __import__("json").dumps(CONFIG, sort_keys=True, separators=(",", ":")).encode()
        ).hexdigest()
    )
    assert run.started_at == datetime.fromtimestamp(started, UTC)
    assert run.finished_at >= run.started_at and run.created_at.tzinfo is not None
    assert (run.input_tokens, run.output_tokens) == (7, 64)
    [stage] = run.stages
    assert (stage.stage_id, stage.kind, stage.status, stage.batch_size) == (0, "ar", "succeeded", 2)
    assert stage.seconds == pytest.approx(1.25, abs=1e-3) and stage.queue_seconds == 0.5
    [output] = run.outputs
    assert output.sha256 == sha == hashlib.sha256(output.path.read_bytes()).hexdigest()
    assert output.path == store.data_dir / "outputs" / sha[:2] / f"{sha}.png"
    assert (output.kind, output.mime, output.width, output.height) == ("image", "image/png", 48, 32)
    assert output.size_bytes == output.path.stat().st_size
    assert store.output_file(sha) == output.path
    assert Image.open(output.path).size == (48, 32)


def test_identical_outputs_share_one_file(store: RunStore) -> None:
    data = png_bytes(Image.new("RGB", (8, 8), (1, 2, 3)))
    a, b = new_run(store), new_run(store)
    assert store.add_output(a, 0, data, "image/png", 8, 8) == store.add_output(b, 0, data, "image/png", 8, 8)
    assert len(list((store.data_dir / "outputs").rglob("*.png"))) == 1
    assert store.get_run(a).outputs[0].path == store.get_run(b).outputs[0].path


def test_the_first_outcome_wins(store: RunStore) -> None:
    run_id = new_run(store)
    assert store.finish_run(run_id, "cancelled", error="client disconnected")
    assert not store.finish_run(run_id, "succeeded")
    assert not store.mark_running(run_id)
    run = store.get_run(run_id)
    assert (run.status, run.error) == ("cancelled", "client disconnected")
    with pytest.raises(ValueError, match="finishes as one of"):
        store.finish_run(run_id, "running")


def test_unknown_ids_and_prefixes(store: RunStore) -> None:
    with pytest.raises(RunNotFound):
        store.get_run("0" * 32)
    a = new_run(store, run_id="abc1" + "0" * 28)
    new_run(store, run_id="abc2" + "0" * 28)
    assert store.resolve_run_id("abc1") == a
    assert store.resolve_run_id(a) == a
    with pytest.raises(AmbiguousRunId):
        store.resolve_run_id("abc")
    with pytest.raises(RunNotFound):
        store.resolve_run_id("fff")


def test_rejects_unknown_source_and_status(store: RunStore) -> None:
    with pytest.raises(ValueError, match="source"):
        new_run(store, source="web")
    with pytest.raises(ValueError, match="unknown status 'done'"):
        store.list_runs(RunFilter(status="done"))


def test_sqlite_connection_settings(data_dir: Path) -> None:
    with open_store(None, data_dir) as store, store.engine.connect() as connection:
        assert connection.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"
        assert connection.exec_driver_sql("PRAGMA foreign_keys").scalar() == 1
        assert connection.exec_driver_sql("PRAGMA synchronous").scalar() == 1  # NORMAL
        assert connection.exec_driver_sql("PRAGMA busy_timeout").scalar() >= 1000


def test_default_database_is_sqlite_in_the_data_dir(data_dir: Path) -> None:
    with open_store(None, data_dir) as store:
        assert store.url == f"sqlite:///{data_dir.resolve() / 'runs.db'}"
        new_run(store)
    assert (data_dir / "runs.db").exists()


# -- queries for the UI ---------------------------------------------------------------------------------


@pytest.fixture
def populated(store: RunStore) -> dict[str, str]:
    now = datetime.now(UTC)
    ids = {
        "fox": new_run(store, "A Red FOX in snow", source="ui"),
        "cat": new_run(store, "a black cat", model="tiny-chat", fingerprint="custom-fp"),
        "owl": new_run(store, "an owl, 100% wise_", source="cli", config={**CONFIG, "async_chunk": True}),
        "old": new_run(store, "an old fox"),
    }
    store.finish_run(ids["fox"], "succeeded")
    store.finish_run(ids["cat"], "failed", error="boom")
    store.finish_run(ids["old"], "succeeded")
    for i, key in enumerate(("fox", "cat", "owl")):
        set_created(store, ids[key], now - timedelta(minutes=i))
    set_created(store, ids["old"], now - timedelta(days=40))
    return ids


def listed(store: RunStore, **filters) -> list[str]:
    return [r.id for r in store.list_runs(RunFilter(**filters), limit=100)]


def test_filters(store: RunStore, populated: dict[str, str]) -> None:
    p = populated
    assert listed(store) == [p["fox"], p["cat"], p["owl"], p["old"]]  # newest first
    assert listed(store, search="fox") == [p["fox"], p["old"]]  # case-insensitive substring
    assert listed(store, search="red fox") == [p["fox"]]
    assert listed(store, search="100%") == [p["owl"]]  # LIKE wildcards are literal
    assert listed(store, search="_") == [p["owl"]]
    assert listed(store, status="failed") == [p["cat"]]
    assert listed(store, status=["queued", "failed"]) == [p["cat"], p["owl"]]
    assert listed(store, model="tiny-chat") == [p["cat"]]
    assert listed(store, fingerprint="custom-fp") == [p["cat"]]
    owl_hash = store.get_run(p["owl"]).config_hash
    assert listed(store, config_hash=owl_hash[:8]) == [p["owl"]]
    assert listed(store, config_hash=owl_hash) == [p["owl"]]
    assert listed(store, source="cli") == [p["owl"]]
    assert listed(store, since=datetime.now(UTC) - timedelta(days=1)) == [p["fox"], p["cat"], p["owl"]]
    assert listed(store, until=time.time() - 86400) == [p["old"]]
    assert listed(store, search="fox", status="succeeded", source="ui") == [p["fox"]]
    assert store.count_runs(RunFilter(search="fox")) == 2
    assert store.count_runs() == 4


def test_paging(store: RunStore, populated: dict[str, str]) -> None:
    pages = [[r.id for r in store.list_runs(limit=3, offset=offset)] for offset in (0, 3, 6)]
    assert pages == [[populated["fox"], populated["cat"], populated["owl"]], [populated["old"]], []]


def test_summary_shows_first_image(store: RunStore) -> None:
    run_id = new_run(store)
    shas = [
        store.add_output(run_id, i, png_bytes(Image.new("RGB", (4, 4), (i, 0, 0))), "image/png", 4, 4)
        for i in range(2)
    ]
    store.add_output(run_id, 0, b"hello", "text/plain; charset=utf-8")
    [summary] = store.list_runs()
    assert (summary.image_count, summary.thumbnail_sha256) == (2, shas[0])
    assert summary.to_dict()["created_at"].endswith("+00:00")


def test_diff_of_two_runs(store: RunStore) -> None:
    a = new_run(store, parameters={"seed": 1, "num_inference_steps": 4, "height": 32})
    b = new_run(
        store,
        "a blue fox",
        parameters={"seed": 2, "num_inference_steps": 4, "width": 64},
        config={
            **CONFIG,
            "stages": [CONFIG["stages"][0], {**CONFIG["stages"][1], "engine_args": {"max_num_seqs": 4}}],
        },
    )
    diff = store.diff_runs(a, b)
    assert diff["parameters"] == {"seed": (1, 2), "height": (32, None), "width": (None, 64)}
    assert diff["config"] == {"stages.1.engine_args.max_num_seqs": (2, 4)}
    assert diff["run"]["prompt"] == ("a red fox", "a blue fox")
    assert "config_hash" in diff["run"] and "model" not in diff["run"]
    assert store.diff_runs(a, a) == {"run": {}, "parameters": {}, "config": {}}


# -- retention ------------------------------------------------------------------------------------------


def test_retention_deletes_old_runs_and_orphaned_files_only(store: RunStore) -> None:
    shared = png_bytes(Image.new("RGB", (4, 4), (9, 9, 9)))
    only_old = png_bytes(Image.new("RGB", (4, 4), (1, 1, 1)))
    old, keep, old_active = new_run(store), new_run(store), new_run(store)
    store.add_stage(old, stage_id=0, kind="ar", status="succeeded", started_at=0, finished_at=1)
    shared_sha = store.add_output(old, 0, shared, "image/png", 4, 4)
    old_sha = store.add_output(old, 1, only_old, "image/png", 4, 4)
    store.add_output(keep, 0, shared, "image/png", 4, 4)
    store.finish_run(old, "succeeded")
    store.finish_run(keep, "succeeded")
    for run_id in (old, old_active):
        set_created(store, run_id, datetime.now(UTC) - timedelta(days=31))

    assert store.delete_runs_older_than(30) == 1
    with pytest.raises(RunNotFound):
        store.get_run(old)
    assert store.get_run(old_active).status == "queued"  # still in progress: kept whatever its age
    assert store.output_file(shared_sha).exists()  # still used by `keep`
    with pytest.raises(FileNotFoundError):
        store.output_file(old_sha)
    assert not list((store.data_dir / "outputs").rglob(f"{old_sha}*"))
    with store.engine.connect() as connection:  # cascaded, not left dangling
        assert connection.execute(text("SELECT count(*) FROM run_stages")).scalar() == 0
        assert connection.execute(text("SELECT count(*) FROM outputs")).scalar() == 1


def test_delete_one_run(store: RunStore) -> None:
    run_id = new_run(store)
    sha = store.add_output(run_id, 0, b"text", "text/plain")
    assert store.delete_run(run_id)
    assert not store.delete_run(run_id)
    assert store.count_runs() == 0
    with pytest.raises(FileNotFoundError):
        store.output_file(sha)


# -- crash recovery ---------------------------------------------------------------------------------------


def test_runs_of_a_closed_store_are_interrupted_at_the_next_open(db_url: str, data_dir: Path) -> None:
    first = open_store(db_url, data_dir)
    running, queued, done = new_run(first), new_run(first), new_run(first)
    first.mark_running(running)
    first.finish_run(done, "succeeded")
    first.close()  # the process "died": nothing finished its runs

    second = open_store(db_url, data_dir)
    try:
        assert second.interrupted_at_open == 2
        for run_id in (running, queued):
            run = second.get_run(run_id)
            assert (run.status, run.error) == ("interrupted", INTERRUPTED_ERROR)
            assert run.finished_at is not None
        assert second.get_run(done).status == "succeeded"
    finally:
        second.close()


def test_runs_of_a_live_store_are_left_alone(db_url: str, data_dir: Path) -> None:
    """`omni-studio history ls` (or a second studio) opening the store must not interrupt live runs."""
    server = open_store(db_url, data_dir)
    try:
        run_id = new_run(server)
        server.mark_running(run_id)
        viewer = open_store(db_url, data_dir)
        viewer.close()
        assert viewer.interrupted_at_open == 0
        assert server.get_run(run_id).status == "running"
        assert server.finish_run(run_id, "succeeded")
    finally:
        server.close()


CRASHING_PROCESS = textwrap.dedent("""
    import os, signal, sys
    from pathlib import Path
    from studio.store import open_store
    store = open_store(sys.argv[1], Path(sys.argv[2]))
    run_id = store.create_run(source="api", prompt="a long run", model="m", request={}, parameters={})
    store.mark_running(run_id)
    print(run_id, flush=True)
    sys.stdin.readline()  # the parent checks the run while this process is alive, then says go
    os.kill(os.getpid(), signal.SIGKILL)
""")


def test_kill_9_during_a_run_leaves_it_interrupted_not_running(db_url: str, data_dir: Path) -> None:
    process = subprocess.Popen(
        [sys.executable, "-c", CRASHING_PROCESS, db_url, str(data_dir)],
        cwd=REPO,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    try:
        run_id = process.stdout.readline().strip()
        assert run_id, "the child process did not start"
        with open_store(db_url, data_dir) as alive_check:  # the recording process still lives
            assert alive_check.interrupted_at_open == 0
            assert alive_check.get_run(run_id).status == "running"
        process.stdin.write("go\n")
        process.stdin.flush()
        assert process.wait(timeout=30) == -signal.SIGKILL
    finally:
        process.kill()
    with open_store(db_url, data_dir) as restarted:
        assert restarted.interrupted_at_open == 1
        assert restarted.get_run(run_id).status == "interrupted"
        assert restarted.count_runs(RunFilter(status=["queued", "running"])) == 0


WRITER_PROCESS = textwrap.dedent("""
    import sys
    from pathlib import Path
    from studio.store import open_store
    store = open_store(sys.argv[1], Path(sys.argv[2]))
    for i in range(int(sys.argv[3])):
        run_id = store.create_run(source="api", prompt=f"{sys.argv[4]} {i}", model="m", request={},
                                  parameters={"i": i}, config={"family": "f", "model": {"name": "m"}})
        store.mark_running(run_id)
        store.add_stage(run_id, stage_id=0, kind="ar", status="succeeded", started_at=0, finished_at=1)
        store.add_output(run_id, 0, f"{sys.argv[4]} {i}".encode(), "text/plain")
        store.finish_run(run_id, "succeeded")
    store.close()
""")


def test_two_processes_writing_at_once_lose_nothing(db_url: str, data_dir: Path) -> None:
    """Several studio processes on one database (the reason to use PostgreSQL; SQLite must cope too)."""
    with open_store(db_url, data_dir):  # migrate first, so the writers race on rows, not on the schema
        pass
    writers = [
        subprocess.Popen(
            [sys.executable, "-c", WRITER_PROCESS, db_url, str(data_dir), "40", name],
            cwd=REPO,
            env={**os.environ, "PYTHONPATH": str(REPO)},
        )
        for name in ("alpha", "beta")
    ]
    assert [w.wait(timeout=120) for w in writers] == [0, 0]
    with open_store(db_url, data_dir) as store:
        assert store.count_runs(RunFilter(status="succeeded")) == 80
        assert store.count_runs(RunFilter(search="alpha")) == store.count_runs(RunFilter(search="beta")) == 40
        assert all(len(store.get_run(r.id).stages) == 1 for r in store.list_runs(limit=100))
