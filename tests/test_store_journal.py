"""Nothing lost: text SQL cannot hold is escaped, and writes the database refuses are journaled and replayed.

Every test runs on SQLite and on PostgreSQL (see conftest_store). The database is made unavailable for
real: on SQLite another connection holds the write lock (with a short busy timeout), on PostgreSQL the
store's writes go to a port where no server listens.
"""

from __future__ import annotations

import shutil
import socket
import sqlite3
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

pytest.register_assert_rewrite("conftest_store")

from conftest_store import (  # noqa: E402
    failure_events,
    image,
    record,
    resolved_request,
    success_events,
)
from sqlalchemy.engine import make_url  # noqa: E402

from engine.config import PipelineConfig  # noqa: E402
from engine.events import RunFinished, RunOutput  # noqa: E402
from studio.store import RunRecorder, RunStore, open_store  # noqa: E402
from studio.store import schema as store_schema  # noqa: E402
from studio.store.schema import create_store_engine  # noqa: E402

pytest_plugins = ["conftest_store"]

SURROGATE = "a red circle \ud800"  # what JSON "a red circle \ud800" decodes to
NUL = "nul\x00byte"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def journal_dir(data_dir: Path) -> Path:
    return data_dir / "journal"  # studio.store.journal.journal_dir


def journal_files(data_dir: Path) -> list[Path]:
    directory = journal_dir(data_dir)
    return sorted(directory.glob("*.jsonl")) if directory.is_dir() else []


# -- 1. text SQL cannot store --------------------------------------------------------------------------


def test_unstorable_text_in_every_field_is_escaped_not_lost(store: RunStore) -> None:
    config = {"family": "glm\x00", "model": {"name": "m\udc80"}, "stages": [{"note": SURROGATE}]}
    run_id = store.create_run(
        source="api",
        prompt=SURROGATE,
        model="model\x00",
        request={"messages": [{"role": "user", "content": SURROGATE}], "k\x00": NUL},
        parameters={"negative_prompt": "\udfff", "list": [NUL]},
        config=config,
        fingerprint="fp\ud800",
    )
    store.add_stage(run_id, stage_id=0, kind="ar", status="succeeded", started_at=1.0, finished_at=2.0)
    assert store.finish_run(run_id, "failed", error="boom \ud800\x00", text="out \udbff")

    run = store.get_run(run_id)
    assert run.prompt == "a red circle \\ud800"
    assert run.model == "model\\u0000"
    assert run.request == {
        "messages": [{"role": "user", "content": "a red circle \\ud800"}],
        "k\\u0000": "nul\\u0000byte",
    }
    assert run.parameters == {"negative_prompt": "\\udfff", "list": ["nul\\u0000byte"]}
    assert run.config == {
        "family": "glm\\u0000",
        "model": {"name": "m\\udc80"},
        "stages": [{"note": run.prompt}],
    }
    assert run.fingerprint == "fp\\ud800"
    assert run.error == "boom \\ud800\\u0000" and run.text == "out \\udbff"
    assert run.status == "failed" and len(run.stages) == 1
    # Searching with the same text finds it (the search term is escaped the same way).
    assert [r.id for r in store.list_runs(_search(SURROGATE))] == [run_id]


def _search(text: str):
    from studio.store import RunFilter

    return RunFilter(search=text)


def test_unstorable_text_through_the_recorder(
    recorder: RunRecorder, store: RunStore, pipeline_config: PipelineConfig
) -> None:
    failed = resolved_request(SURROGATE, seed=3)
    failed_id = record(recorder, pipeline_config, failure_events(failed, message="bad \ud800 \x00"), failed)

    texted = resolved_request("text \x00", seed=4)
    tracker = recorder.start_run(
        "api", texted, pipeline_config, "tiny-glm-image", "fp", {"messages": [{"content": SURROGATE}]}
    )
    tracker.observe(
        RunFinished(texted.request_id, 0, (RunOutput(index=0, seed=4, text="answer \udc00", images=()),))
    )
    rejected_id = recorder.record_rejected(
        "api", {"prompt": NUL, "model": "x\ud800"}, "unknown model 'x\ud800'", "x\ud800", None, None
    )
    recorder.flush()

    run = store.get_run(failed_id)
    assert run.status == "failed" and run.prompt == "a red circle \\ud800"
    assert run.error == "bad \\ud800 \\u0000" and len(run.stages) == 2
    run = store.get_run(texted.request_id)
    assert run.status == "succeeded" and run.text == "answer \\udc00" and run.prompt == "text \\u0000"
    assert run.request == {"messages": [{"content": "a red circle \\ud800"}]}
    assert run.outputs[0].path.read_text() == "answer \\udc00"
    run = store.get_run(rejected_id)
    assert run.status == "failed" and run.prompt == "nul\\u0000byte" and run.model == "x\\ud800"
    assert run.error == "unknown model 'x\\ud800'"


# -- 2. a database that refuses writes -------------------------------------------------------------------


@contextmanager
def database_down(store: RunStore) -> Iterator[None]:
    """Make ``store``'s database refuse writes for real until the block ends."""
    if store.dialect == "sqlite":
        # Another connection holds the write lock: every write of the store gets "database is locked".
        locker = sqlite3.connect(make_url(store.engine.url).database or "", isolation_level=None)
        locker.execute("BEGIN EXCLUSIVE")
        try:
            yield
        finally:
            locker.rollback()
            locker.close()
    else:
        # The server "stops": the store's writes go to a port where nothing listens.
        live = store._write_engine
        down = make_url(store.engine.url.render_as_string(hide_password=False)).set(port=free_port())
        store._write_engine = create_store_engine(
            down.render_as_string(hide_password=False)
        ).execution_options(omni_write=True)
        try:
            yield
        finally:
            store._write_engine.dispose()
            store._write_engine = live


@pytest.fixture(autouse=True)
def quick_lock_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    """A locked SQLite database fails a write after 50 ms instead of 30 s (set before any connection)."""
    monkeypatch.setattr(store_schema, "SQLITE_BUSY_TIMEOUT_MS", 50)


def _record_during_outage(
    recorder: RunRecorder, store: RunStore, config: PipelineConfig, stop: bool = False
) -> dict[str, tuple]:
    """Runs of every shape, recorded while the database refuses writes; returns id -> expectations.

    ``stop``: the recorder and the store are closed while the database is still down (the process ends
    before it comes back).
    """
    expected: dict[str, tuple] = {}  # run id -> (status, stages, outputs)
    # A run that started while the database was up and finishes while it is down.
    early = resolved_request("before the outage", seed=1)
    events = success_events(early)
    tracker = recorder.start_run("api", early, config, "tiny-glm-image", "fp", {"prompt": "before"})
    for event in events[:2]:
        tracker.observe(event)
    recorder.flush()
    assert store.get_run(early.request_id).status == "running"
    with database_down(store):
        for event in events[2:]:
            tracker.observe(event)
        expected[early.request_id] = ("succeeded", 2, 1)
        for seed in (10, 11):
            resolved = resolved_request(f"fox {seed}", seed=seed, n=2)
            expected[record(recorder, config, success_events(resolved), resolved)] = ("succeeded", 4, 2)
        with_source = resolved_request("img2img", seed=12, source_image=image((1, 2, 3)))
        expected[record(recorder, config, success_events(with_source), with_source)] = ("succeeded", 2, 2)
        failed = resolved_request("doomed", seed=13)
        expected[record(recorder, config, failure_events(failed), failed)] = ("failed", 2, 0)
        rejected = recorder.record_rejected(
            "api", {"prompt": "x"}, "bad field", "tiny-glm-image", config, "fp"
        )
        expected[rejected] = ("failed", 0, 0)
        recorder.flush()
        assert recorder.errors == 0, recorder.last_error
        assert recorder.journaled > 0 and journal_files(store.data_dir)
        for run_id in expected:
            if run_id != early.request_id:
                assert store.existing_ids([run_id]) == set()
        if stop:
            recorder.close()
            store.close()
    return expected


def _check_recorded(store: RunStore, expected: dict[str, tuple]) -> None:
    for run_id, (status, stages, outputs) in expected.items():
        run = store.get_run(run_id)
        assert (run.status, len(run.stages), len(run.outputs)) == (status, stages, outputs), run_id
        assert all(o.path.exists() for o in run.outputs)
        if status == "succeeded":
            assert run.error is None and run.finished_at is not None
    assert store.count_runs() == len(expected)


def test_writes_refused_by_the_database_are_journaled_and_written_at_next_open(
    db_url: str, data_dir: Path, pipeline_config: PipelineConfig
) -> None:
    store = open_store(db_url, data_dir)
    recorder = RunRecorder(store)
    try:
        expected = _record_during_outage(recorder, store, pipeline_config, stop=True)
    finally:
        recorder.close()
        store.close()
    assert journal_files(data_dir)
    saved = journal_dir(data_dir).with_name("journal-copy")
    shutil.copytree(journal_dir(data_dir), saved)

    with open_store(db_url, data_dir) as reopened:
        assert reopened.replayed_at_open == len(expected)  # the early run's later writes were journaled
        _check_recorded(reopened, expected)
        assert journal_files(data_dir) == []

    # Replaying the same journal again (a crash before it was removed) records nothing twice.
    for path in saved.glob("*.jsonl"):
        shutil.copy(path, journal_dir(data_dir) / path.name)
    with open_store(db_url, data_dir) as again:
        _check_recorded(again, expected)
        assert journal_files(data_dir) == []


def test_the_journal_is_written_as_soon_as_the_database_takes_writes_again(
    store: RunStore, pipeline_config: PipelineConfig
) -> None:
    recorder = RunRecorder(store)
    try:
        expected = _record_during_outage(recorder, store, pipeline_config)
        after = resolved_request("after the outage", seed=20)
        expected[record(recorder, pipeline_config, success_events(after), after)] = ("succeeded", 2, 1)
        recorder.flush()
        _check_recorded(store, expected)
        assert journal_files(store.data_dir) == []
        assert recorder.errors == 0, recorder.last_error
    finally:
        recorder.close()


def test_a_run_that_cannot_be_replayed_stays_in_the_journal(
    db_url: str, data_dir: Path, pipeline_config: PipelineConfig
) -> None:
    store = open_store(db_url, data_dir)
    recorder = RunRecorder(store)
    try:
        with database_down(store):
            good = resolved_request("good", seed=1)
            good_id = record(recorder, pipeline_config, success_events(good), good)
            # A stage of a run that was never created: refused by the foreign key at every replay.
            orphan = resolved_request("orphan", seed=2)
            recorder.start_run("api", orphan, pipeline_config, "m", None, {}).observe(
                failure_events(orphan)[1]
            )
            recorder.close()  # the process stops while the database is down
            store.close()
    finally:
        recorder.close()
        store.close()
    journal = journal_files(data_dir)[0]
    lines = journal.read_text().splitlines()
    journal.write_text(
        "\n".join(line for line in lines if '"op":"create_run","run":"' + orphan.request_id not in line)
    )

    with open_store(db_url, data_dir) as reopened:
        assert reopened.replayed_at_open == 1
        assert reopened.get_run(good_id).status == "succeeded"
        (left,) = journal_files(data_dir)
        assert orphan.request_id in left.read_text() and good_id not in left.read_text()
