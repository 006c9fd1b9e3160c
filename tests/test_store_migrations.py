"""Each Alembic migration of the run store, on an empty and on a populated database, SQLite and PostgreSQL."""

from __future__ import annotations

import json
from collections.abc import Callable
from datetime import datetime
from pathlib import Path

import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Connection, Engine, inspect, text
from sqlalchemy.exc import IntegrityError

from studio.store import StoreError, open_store
from studio.store.models import Base
from studio.store.schema import (
    alembic_config,
    create_store_engine,
    current_revision,
    downgrade_schema,
    head_revision,
    upgrade_schema,
)
from studio.store.search import FTS_TABLE, SEARCH_OBJECTS, search_index_present

pytest_plugins = ["conftest_store"]

REVISIONS = [
    rev.revision for rev in reversed(list(ScriptDirectory.from_config(alembic_config()).walk_revisions()))
]
NOW = datetime(2025, 1, 2, 3, 4, 5)


def columns(connection: Connection, table: str) -> set[str]:
    return {c["name"] for c in inspect(connection).get_columns(table)}


def tables(connection: Connection) -> set[str]:
    return set(inspect(connection).get_table_names()) - {"alembic_version"}


# What each migration adds (checked after upgrading an empty database, gone after downgrading).
def _added_0001(connection: Connection) -> None:
    assert tables(connection) >= {"runs", "run_stages", "outputs", "config_snapshots"}
    assert {
        "id",
        "status",
        "prompt",
        "request",
        "parameters",
        "seed",
        "config_hash",
        "fingerprint",
        "error",
        "text",
    } <= columns(connection, "runs")
    indexes = {i["name"] for i in inspect(connection).get_indexes("runs")}
    assert {
        "ix_runs_status",
        "ix_runs_model",
        "ix_runs_fingerprint",
        "ix_runs_config_hash",
        "ix_runs_created_at",
        "ix_runs_source",
    } <= indexes


def _removed_0001(connection: Connection) -> None:
    assert not tables(connection) & {"runs", "run_stages", "outputs", "config_snapshots"}


def _added_0002(connection: Connection) -> None:
    assert "owner" in columns(connection, "runs")
    assert "ix_runs_owner" in {i["name"] for i in inspect(connection).get_indexes("runs")}


def _removed_0002(connection: Connection) -> None:
    assert "owner" not in columns(connection, "runs")


# Rows put in at the previous revision, and what must hold for them after the migration.
def _populate_before_0001(connection: Connection) -> None:
    # A database that already holds something else (e.g. a shared PostgreSQL database).
    connection.execute(text("CREATE TABLE unrelated (id INTEGER PRIMARY KEY, note VARCHAR(20))"))
    connection.execute(text("INSERT INTO unrelated (id, note) VALUES (1, 'keep me')"))


def _check_after_0001(connection: Connection) -> None:
    assert connection.execute(text("SELECT note FROM unrelated")).scalar() == "keep me"


def _populate_before_0002(connection: Connection) -> None:
    connection.execute(
        text(
            "INSERT INTO config_snapshots (hash, body, family, model_name, created_at) "
            "VALUES (:h, :b, 'glm_image', 'tiny', :t)"
        ),
        {"h": "a" * 64, "b": json.dumps({"family": "glm_image"}), "t": NOW},
    )
    for run_id, status in (("r1", "succeeded"), ("r2", "running")):
        connection.execute(
            text(
                "INSERT INTO runs (id, source, created_at, status, prompt, model, request, parameters, seed, "
                "config_hash) VALUES (:id, 'api', :t, :s, 'a fox', 'tiny', '{}', '{\"seed\": 3}', 3, :h)"
            ),
            {"id": run_id, "t": NOW, "s": status, "h": "a" * 64},
        )
    connection.execute(
        text(
            "INSERT INTO run_stages (run_id, variant_index, stage_id, kind, status, queue_seconds, "
            "input_tokens, output_tokens, batch_size) VALUES ('r1', 0, 0, 'ar', 'succeeded', 0.5, 3, 9, 1)"
        )
    )
    connection.execute(
        text(
            'INSERT INTO outputs (run_id, "index", kind, sha256, mime, width, height, size_bytes) '
            "VALUES ('r1', 0, 'image', :sha, 'image/png', 32, 32, 100)"
        ),
        {"sha": "b" * 64},
    )


def _check_after_0002(connection: Connection) -> None:
    rows = connection.execute(text("SELECT id, status, owner, seed FROM runs ORDER BY id")).all()
    assert [tuple(r) for r in rows] == [("r1", "succeeded", None, 3), ("r2", "running", None, 3)]
    assert connection.execute(text("SELECT output_tokens FROM run_stages")).scalar() == 9
    assert connection.execute(text("SELECT sha256 FROM outputs")).scalar() == "b" * 64


def _added_0003(connection: Connection) -> None:
    indexes = {i["name"] for i in inspect(connection).get_indexes("runs")}
    composite = {f"ix_runs_{c}_created" for c in ("status", "model", "source", "fingerprint", "config_hash")}
    assert composite | {"ix_runs_created_at_id"} <= indexes
    assert not {"ix_runs_status", "ix_runs_model", "ix_runs_created_at"} & indexes
    assert search_index_present(connection)


def _removed_0003(connection: Connection) -> None:
    indexes = {i["name"] for i in inspect(connection).get_indexes("runs")}
    assert {"ix_runs_status", "ix_runs_created_at"} <= indexes and "ix_runs_created_at_id" not in indexes
    assert not search_index_present(connection)
    assert FTS_TABLE not in set(inspect(connection).get_table_names())


def _populate_before_0003(connection: Connection) -> None:
    _populate_before_0002(connection)
    connection.execute(text("UPDATE runs SET prompt = 'a Fox in 100% snow' WHERE id = 'r2'"))


def _fts_ids(connection: Connection, phrase: str) -> set[str]:
    rows = connection.execute(
        text(
            f"SELECT id FROM runs WHERE rowid IN (SELECT rowid FROM {FTS_TABLE} WHERE {FTS_TABLE} MATCH :q)"
        ),
        {"q": f'"{phrase}"'},
    )
    return {r[0] for r in rows}


def _check_after_0003(connection: Connection) -> None:
    rows = connection.execute(text("SELECT id, prompt FROM runs ORDER BY id")).all()
    assert [tuple(r) for r in rows] == [("r1", "a fox"), ("r2", "a Fox in 100% snow")]
    if connection.dialect.name == "sqlite":
        # The runs recorded before the migration are indexed, and the triggers keep it in sync.
        assert _fts_ids(connection, "fox") == {"r1", "r2"}
        assert _fts_ids(connection, "0% s") == {"r2"}
        connection.execute(text("UPDATE runs SET prompt = 'an owl' WHERE id = 'r1'"))
        connection.execute(text("DELETE FROM runs WHERE id = 'r2'"))
        assert _fts_ids(connection, "fox") == set()
        assert _fts_ids(connection, "owl") == {"r1"}
    else:
        # The trigram index serves a substring ILIKE (the planner is told to avoid a scan of 2 rows).
        connection.execute(text("SET LOCAL enable_seqscan = off"))
        plan = " ".join(
            r[0]
            for r in connection.execute(text("EXPLAIN SELECT id FROM runs WHERE prompt ILIKE '%fox in%'"))
        )
        assert "ix_runs_prompt_trgm" in plan, plan


def _added_0004(connection: Connection) -> None:
    assert "replay_of" in columns(connection, "runs")
    assert "ix_runs_replay_of" in {i["name"] for i in inspect(connection).get_indexes("runs")}
    assert search_index_present(connection)


def _removed_0004(connection: Connection) -> None:
    assert "replay_of" not in columns(connection, "runs")
    # Dropping the column must not take the prompt-search index (0003's triggers) with it.
    assert search_index_present(connection)


def _check_after_0004(connection: Connection) -> None:
    _check_after_0002(connection)
    rows = connection.execute(text("SELECT id, replay_of FROM runs ORDER BY id")).all()
    assert [tuple(r) for r in rows] == [("r1", None), ("r2", None)]


def _added_0005(connection: Connection) -> None:
    assert {"jobs", "job_items"} <= tables(connection)
    assert {
        "id",
        "status",
        "owner",
        "spec",
        "total",
        "succeeded",
        "failed",
        "cancelled",
        "position",
        "worker",
        "grid_sha256",
        "grid_run_id",
    } <= columns(connection, "jobs")
    assert {"job_id", "index", "axes", "status", "run_id", "attempts"} <= columns(connection, "job_items")
    inspector = inspect(connection)
    assert "ix_jobs_status_position" in {i["name"] for i in inspector.get_indexes("jobs")}
    assert "ix_job_items_run_id" in {i["name"] for i in inspector.get_indexes("job_items")}
    unique = {tuple(u["column_names"]) for u in inspector.get_unique_constraints("job_items")}
    assert ("job_id", "index") in unique
    # A cell exists once per job: a second row for the same (job, index) is refused by the database.
    connection.execute(
        text(
            "INSERT INTO jobs (id, created_at, status, source, spec, total, succeeded, failed, cancelled, "
            "position) VALUES ('j0', :t, 'queued', 'api', '{}', 1, 0, 0, 0, 1)"
        ),
        {"t": NOW},
    )
    item = text(
        "INSERT INTO job_items (job_id, \"index\", axes, status, attempts) VALUES ('j0', 0, '{}', 'queued', 0)"
    )
    connection.execute(item)
    with pytest.raises(IntegrityError), connection.begin_nested():
        connection.execute(item)
    connection.rollback()


def _removed_0005(connection: Connection) -> None:
    assert not {"jobs", "job_items"} & tables(connection)
    assert search_index_present(connection)  # the runs table and its search index are untouched


def _check_after_0005(connection: Connection) -> None:
    _check_after_0004(connection)
    assert connection.execute(text("SELECT count(*) FROM jobs")).scalar() == 0
    # Jobs can reference the runs recorded before the migration (cells and runs link by id).
    connection.execute(
        text(
            "INSERT INTO jobs (id, created_at, status, source, spec, total, succeeded, failed, cancelled, "
            "position) VALUES ('j1', :t, 'succeeded', 'cli', '{\"prompts\": [\"a fox\"]}', 1, 1, 0, 0, 1)"
        ),
        {"t": NOW},
    )
    connection.execute(
        text(
            'INSERT INTO job_items (job_id, "index", axes, status, run_id, attempts) '
            "VALUES ('j1', 0, '{\"seed\": 3}', 'succeeded', 'r1', 1)"
        )
    )
    row = connection.execute(
        text("SELECT r.prompt FROM job_items i JOIN runs r ON r.id = i.run_id WHERE i.job_id = 'j1'")
    ).one()
    assert row[0] == "a fox"


AUDIO_RUN_COLUMNS = {"ttfp_seconds", "audio_seconds", "realtime_factor"}
AUDIO_OUTPUT_COLUMNS = {"duration_seconds", "sample_rate"}


def _added_0006(connection: Connection) -> None:
    assert columns(connection, "runs") >= AUDIO_RUN_COLUMNS
    assert columns(connection, "outputs") >= AUDIO_OUTPUT_COLUMNS
    assert search_index_present(connection)


def _removed_0006(connection: Connection) -> None:
    assert not AUDIO_RUN_COLUMNS & columns(connection, "runs")
    assert not AUDIO_OUTPUT_COLUMNS & columns(connection, "outputs")
    # Dropping the columns must not take the prompt-search index (0003's triggers) with it.
    assert search_index_present(connection)


def _check_after_0006(connection: Connection) -> None:
    _check_after_0005(connection)
    rows = connection.execute(
        text("SELECT id, ttfp_seconds, audio_seconds, realtime_factor FROM runs ORDER BY id")
    ).all()
    assert [tuple(r) for r in rows] == [("r1", None, None, None), ("r2", None, None, None)]
    image = connection.execute(text("SELECT kind, width, duration_seconds, sample_rate FROM outputs")).one()
    assert tuple(image) == ("image", 32, None, None)
    # An audio run and its WAV, as the recorder writes them now.
    connection.execute(
        text(
            "UPDATE runs SET ttfp_seconds = 0.25, audio_seconds = 1.2, realtime_factor = 0.3 WHERE id = 'r1'"
        )
    )
    connection.execute(
        text(
            'INSERT INTO outputs (run_id, "index", kind, sha256, mime, size_bytes, duration_seconds, '
            "sample_rate) VALUES ('r1', 0, 'audio', :sha, 'audio/wav', 57644, 1.2, 24000)"
        ),
        {"sha": "c" * 64},
    )
    audio = connection.execute(
        text(
            "SELECT o.duration_seconds, o.sample_rate, r.audio_seconds FROM outputs o "
            "JOIN runs r ON r.id = o.run_id WHERE o.kind = 'audio'"
        )
    ).one()
    assert tuple(audio) == (1.2, 24000, 1.2)
    if connection.dialect.name == "sqlite":  # the prompt search still follows the runs table
        connection.execute(text("UPDATE runs SET prompt = 'say hello' WHERE id = 'r1'"))
        assert _fts_ids(connection, "say hello") == {"r1"}


def _added_0007(connection: Connection) -> None:
    assert "user_name" in columns(connection, "runs")
    assert columns(connection, "users") >= {"name", "password_hash", "admin"}
    assert columns(connection, "api_keys") >= {"id", "user_id", "secret_sha256", "revoked_at"}
    assert search_index_present(connection)


def _removed_0007(connection: Connection) -> None:
    assert "user_name" not in columns(connection, "runs")
    assert not {"users", "api_keys"} & set(inspect(connection).get_table_names())
    assert search_index_present(connection)


def _check_after_0007(connection: Connection) -> None:
    _check_after_0006(connection)
    # Runs recorded before accounts belong to no account; a user, a key and an owned run fit the schema.
    rows = connection.execute(text("SELECT id, user_name FROM runs ORDER BY id")).all()
    assert [tuple(r) for r in rows] == [("r1", None), ("r2", None)]
    connection.execute(
        text("INSERT INTO users (name, password_hash, admin, created_at) VALUES ('alice', 'h', false, :t)"),
        {"t": NOW},
    )
    connection.execute(
        text(
            "INSERT INTO api_keys (id, user_id, secret_sha256, created_at) "
            "SELECT 'k1', id, :sha, :t FROM users WHERE name = 'alice'"
        ),
        {"sha": "d" * 64, "t": NOW},
    )
    connection.execute(text("UPDATE runs SET user_name = 'alice' WHERE id = 'r1'"))
    owned = connection.execute(
        text(
            "SELECT r.id, k.id FROM runs r JOIN users u ON u.name = r.user_name JOIN api_keys k ON k.user_id = u.id"
        )
    ).all()
    assert [tuple(r) for r in owned] == [("r1", "k1")]


ADDED: dict[str, tuple[Callable[[Connection], None], Callable[[Connection], None]]] = {
    "0001": (_added_0001, _removed_0001),
    "0002": (_added_0002, _removed_0002),
    "0003": (_added_0003, _removed_0003),
    "0004": (_added_0004, _removed_0004),
    "0005": (_added_0005, _removed_0005),
    "0006": (_added_0006, _removed_0006),
    "0007": (_added_0007, _removed_0007),
}
POPULATED: dict[str, tuple[Callable[[Connection], None], Callable[[Connection], None]]] = {
    "0001": (_populate_before_0001, _check_after_0001),
    "0002": (_populate_before_0002, _check_after_0002),
    "0003": (_populate_before_0003, _check_after_0003),
    "0004": (_populate_before_0002, _check_after_0004),
    "0005": (_populate_before_0002, _check_after_0005),
    "0006": (_populate_before_0002, _check_after_0006),
    "0007": (_populate_before_0002, _check_after_0007),
}


def previous(revision: str) -> str:
    index = REVISIONS.index(revision)
    return REVISIONS[index - 1] if index else "base"


@pytest.fixture
def engine(db_url: str) -> Engine:
    engine = create_store_engine(db_url)
    yield engine
    engine.dispose()


def test_every_migration_has_tests() -> None:
    assert REVISIONS, "no migrations found"
    assert set(REVISIONS) == set(ADDED) == set(POPULATED), "a migration without its tests"
    assert REVISIONS[-1] == head_revision()


@pytest.mark.parametrize("revision", REVISIONS)
def test_migration_on_empty_database(engine: Engine, revision: str) -> None:
    added, removed = ADDED[revision]
    upgrade_schema(engine, revision)
    assert current_revision(engine) == revision
    with engine.connect() as connection:
        added(connection)
    downgrade_schema(engine, previous(revision))
    assert current_revision(engine) == (None if previous(revision) == "base" else previous(revision))
    with engine.connect() as connection:
        removed(connection)


@pytest.mark.parametrize("revision", REVISIONS)
def test_migration_on_populated_database(engine: Engine, revision: str) -> None:
    populate, check = POPULATED[revision]
    if previous(revision) != "base":
        upgrade_schema(engine, previous(revision))
    with engine.begin() as connection:
        populate(connection)
    upgrade_schema(engine, revision)
    with engine.connect() as connection:
        check(connection)
        ADDED[revision][0](connection)


def test_models_match_the_migrated_schema(engine: Engine) -> None:
    upgrade_schema(engine)
    with engine.connect() as connection:
        # The search index (FTS5 tables, the pg_trgm index) exists on one backend only: not in the models.
        context = MigrationContext.configure(
            connection, opts={"include_name": lambda name, *_: name not in SEARCH_OBJECTS}
        )
        diffs = compare_metadata(context, Base.metadata)
    assert diffs == []


def test_open_store_migrates_an_old_database_and_interrupts_its_unowned_runs(
    db_url: str, data_dir: Path, engine: Engine
) -> None:
    upgrade_schema(engine, "0001")
    with engine.begin() as connection:
        _populate_before_0002(connection)
    store = open_store(db_url, data_dir)
    try:
        assert current_revision(engine) == head_revision()
        assert store.interrupted_at_open == 1  # r2 was running with no owner that could finish it
        assert store.get_run("r2").status == "interrupted"
        assert store.get_run("r1").status == "succeeded"
    finally:
        store.close()


def test_open_refuses_a_database_from_a_newer_version(db_url: str, data_dir: Path, engine: Engine) -> None:
    upgrade_schema(engine)
    with engine.begin() as connection:
        connection.execute(text("UPDATE alembic_version SET version_num = '9999'"))
    with pytest.raises(StoreError, match="9999.*newer omni-studio"):
        open_store(db_url, data_dir)
