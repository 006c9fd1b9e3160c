"""History at scale: the indexed prompt search answers exactly what a plain scan answers, keyset pages,
capped counts, delete/prune by filter, maintenance. SQLite and PostgreSQL."""

from __future__ import annotations

import os
import random
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from sqlalchemy import event, text, update

from studio.store import RunCount, RunFilter, RunStore, open_store
from studio.store.models import Run
from studio.store.search import FTS_TABLE, drop_pg_search, drop_sqlite_search, search_index_present

pytest_plugins = ["conftest_store"]

# Fragments the generated prompts are made of: unicode (with case pairs beyond ASCII), quotes, LIKE
# wildcards and the escape character, FTS5 syntax, and what the store escapes on write (NUL, a lone
# surrogate).
FRAGMENTS = [
    "red",
    "Fox",
    "FOX",
    "fox",
    "owl",
    "snow",
    "Ünïcode",
    "ÜNÏCODE",
    "straße",
    "狐狸",
    "🦊",
    "'single'",
    '"double"',
    "100%",
    "50% off",
    "a_b",
    "under_score",
    "/slash/",
    "back\\slash",
    "NEAR(a b)",
    "col:umn",
    "x*",
    "-not",
    "nul\x00byte",
    "lone\ud800half",
    "  spaced  ",
    "",
]
SEARCHES = [
    "",  # no search at all
    "f",
    "fo",
    "fox",
    "FOX",
    "red fox",
    "ox r",
    "Ü",
    "ünï",
    "ÜNÏ",
    "straße",
    "STRASSE",
    "狐",
    "狐狸",
    "🦊",
    "'",
    "'single'",
    '"',
    '"double"',
    '"dou',
    "%",
    "100%",
    "0% ",
    "_",
    "a_b",
    "a%b",
    "/",
    "\\",
    "back\\slash",
    "NEAR(a",
    "col:umn",
    "x*",
    "-not",
    "nul\x00byte",
    "\x00",
    "lone\ud800",
    "\\u0000",
    "  ",
    "not in any prompt",
]


def generate_history(store: RunStore, count: int, seed: int = 0) -> None:
    rng = random.Random(seed)
    now = datetime.now(UTC)
    for i in range(count):
        prompt = " ".join(rng.choices(FRAGMENTS, k=rng.randint(0, 5)))
        run_id = store.create_run(
            source=rng.choice(["ui", "api", "cli"]),
            prompt=prompt,
            model=rng.choice(["tiny-glm-image", "tiny-chat"]),
            request={"prompt": prompt},
            parameters={"seed": i},
            seed=i,
            status=rng.choice(["succeeded", "succeeded", "failed"]),
            # Ties in created_at on purpose: the id orders them.
            created_at=now - timedelta(minutes=i // 3),
        )
        if i % 7 == 0:
            store.finish_run(run_id, "succeeded")


def answers(store: RunStore, flt: RunFilter) -> tuple[list[str], int, RunCount]:
    return (
        [r.id for r in store.list_runs(flt, limit=10_000)],
        store.count_runs(flt),
        store.count_matching(flt, cap=40),
    )


def drop_search_index(store: RunStore) -> None:
    with store.engine.begin() as connection:
        if store.dialect == "sqlite":
            drop_sqlite_search(connection)
        else:
            drop_pg_search(connection)
        assert not search_index_present(connection)
    store.search_indexed = False


def test_indexed_search_gives_the_same_answers_as_a_plain_scan(store: RunStore) -> None:
    assert store.search_indexed
    if store.dialect == "postgresql":
        # A few hundred rows would be scanned anyway: make the planner use the trigram index.
        event.listen(store.engine, "connect", lambda dbapi, _: dbapi.execute("SET enable_seqscan = off"))
        store.engine.dispose()
    generate_history(store, 400)
    # Deleted runs must leave the index too (SQLite: the delete trigger).
    for run in store.list_runs(RunFilter(search="owl"), limit=15):
        store.delete_run(run.id)
    filters = [
        RunFilter(search=term, **extra)
        for term in SEARCHES
        for extra in ({}, {"status": "succeeded", "model": "tiny-chat"}, {"source": ["ui", "cli"]})
    ]
    if store.dialect == "sqlite":  # the FTS candidates drive these searches
        with store.engine.connect() as connection:
            assert len(store._search_condition(connection, "fox")) == 2
            assert len(store._search_condition(connection, "fo")) == 1  # below a trigram: scanned
    indexed = [answers(store, flt) for flt in filters]
    if store.dialect == "postgresql":
        with store.engine.connect() as connection:
            plan = " ".join(
                r[0]
                for r in connection.execute(text("EXPLAIN SELECT id FROM runs WHERE prompt ILIKE '%fox%'"))
            )
        assert "ix_runs_prompt_trgm" in plan, plan

    drop_search_index(store)
    scanned = [answers(store, flt) for flt in filters]
    for flt, got, expected in zip(filters, indexed, scanned, strict=True):
        assert got == expected, flt
    # Not vacuous: searches matched something, and the cap was reached by some.
    assert any(ids for ids, _count, _capped in scanned[3:])
    assert any(not capped.exact for _ids, _count, capped in scanned)
    assert answers(store, RunFilter(search="fox"))[1] == sum(
        "fox" in r.prompt.lower() for r in store.list_runs(limit=10_000)
    )


def test_the_store_keeps_the_index_in_sync_and_rebuilds_it_when_missing(db_url: str, data_dir: Path) -> None:
    with open_store(db_url, data_dir) as store:
        first = store.create_run(
            source="api", prompt="a quiet lighthouse", model="m", request={}, parameters={}
        )
        assert store.search_indexed
        if store.dialect == "sqlite":  # as a table rebuild (Alembic batch mode) would leave it
            with store.engine.begin() as connection:
                for trigger in ("ai", "ad", "au"):
                    connection.exec_driver_sql(f"DROP TRIGGER {FTS_TABLE}_{trigger}")
        else:
            drop_search_index(store)
    with open_store(db_url, data_dir) as store:  # the index is re-installed and rebuilt at open
        assert store.search_indexed
        second = store.create_run(
            source="api", prompt="another lighthouse", model="m", request={}, parameters={}
        )
        assert [r.id for r in store.list_runs(RunFilter(search="lighthouse"))] == [second, first]
        store.maintain(vacuum=True)  # VACUUM keeps what the index points at
        assert [r.id for r in store.list_runs(RunFilter(search="LIGHTHOUSE"))] == [second, first]
        assert store.database_bytes()


def test_keyset_pages_walk_every_run_once_in_order(store: RunStore) -> None:
    generate_history(store, 130)
    for flt in (None, RunFilter(status="succeeded"), RunFilter(search="fox", source=["api", "ui"])):
        everything = [r.id for r in store.list_runs(flt, limit=1000)]
        walked, cursor = [], None
        while True:
            page = store.list_page(flt, limit=17, cursor=cursor)
            walked += [r.id for r in page.runs]
            if page.next_cursor is None:
                break
            cursor = page.next_cursor
        assert walked == everything
    # A run recorded meanwhile does not shift the next page (it is newer than the cursor).
    page = store.list_page(limit=10)
    store.create_run(source="ui", prompt="late", model="m", request={}, parameters={})
    assert store.list_page(limit=10, cursor=page.next_cursor).runs == store.list_runs(limit=10, offset=11)
    with pytest.raises(ValueError, match="cursor"):
        store.list_page(cursor="nonsense")


def test_counts_are_exact_up_to_the_cap(store: RunStore) -> None:
    for i in range(7):
        store.create_run(source="api", prompt=f"fox {i}", model="m", request={}, parameters={})
    assert store.count_matching(RunFilter(search="fox"), cap=7) == RunCount(7, True)
    capped = store.count_matching(RunFilter(search="fox"), cap=5)
    assert capped == RunCount(5, False) and capped.text == "5+"
    assert store.count_matching(RunFilter(search="owl")) == RunCount(0, True)
    assert RunCount(12_345, True).text == "12,345"


def _run_with_file(store: RunStore, prompt: str, data: bytes, status: str = "succeeded") -> tuple[str, str]:
    run_id = store.create_run(source="api", prompt=prompt, model="m", request={}, parameters={})
    sha = store.add_output(run_id, 0, data, "text/plain")
    if status != "queued":
        store.finish_run(run_id, status)
    return run_id, sha


def test_delete_by_filter_removes_runs_and_the_files_no_run_uses(store: RunStore) -> None:
    fox, fox_sha = _run_with_file(store, "a fox", b"fox only")
    shared, shared_sha = _run_with_file(store, "a fox too", b"shared")
    _owl, _ = _run_with_file(store, "an owl", b"shared")
    active, _ = _run_with_file(store, "a running fox", b"active", status="queued")
    failed, _ = _run_with_file(store, "an old failed cat", b"cat", status="failed")
    with store.engine.begin() as connection:
        connection.execute(
            update(Run).where(Run.id == failed).values(created_at=datetime.now(UTC) - timedelta(days=90))
        )

    assert store.delete_runs(RunFilter(search="FOX")) == 2  # the queued one stays
    assert {r.id for r in store.list_runs(RunFilter(search="fox"))} == {active}
    assert not store.file_path(fox_sha, "text/plain").exists()
    assert store.file_path(shared_sha, "text/plain").exists()  # the owl still uses it
    assert shared not in {r.id for r in store.list_runs()}
    assert store.delete_runs(RunFilter(status="failed"), older_than_days=100) == 0
    assert store.delete_runs(RunFilter(status="failed"), older_than_days=30) == 1
    assert store.count_runs() == 2


def test_prune_files_removes_only_old_unreferenced_files(store: RunStore) -> None:
    _run, used = _run_with_file(store, "kept", b"referenced")
    orphan_sha, orphan = store.write_file(b"left by a crash", "image/png")
    fresh_sha, fresh = store.write_file(b"its row is about to be written", "image/png")
    old = time.time() - 7200
    for path in (orphan, store.file_path(used, "text/plain")):
        os.utime(path, (old, old))
    assert store.prune_files() == (1, len(b"left by a crash"))
    assert not orphan.exists() and fresh.exists() and store.file_path(used, "text/plain").exists()
    assert store.prune_files(min_age_seconds=0) == (1, len(b"its row is about to be written"))
    assert orphan_sha != fresh_sha


def test_output_kind_keeps_the_runs_that_spoke_and_lists_their_figures(store: RunStore) -> None:
    """``RunFilter(output_kind=...)``: the History tab's "Output" filter (docs/speech.md "In the studio")."""
    now = datetime.now(UTC)

    def run(prompt: str, minutes: int, outputs: list[tuple[str, bytes]], audio=None) -> str:
        run_id = store.create_run(
            source="api",
            prompt=prompt,
            model="m",
            request={},
            parameters={},
            created_at=now - timedelta(minutes=minutes),
        )
        for index, (mime, data) in enumerate(outputs):
            duration = 1.5 if mime == "audio/wav" else None
            store.add_output(
                run_id, index, data, mime, duration_seconds=duration, sample_rate=24000 if duration else None
            )
        store.finish_run(run_id, "succeeded", audio=audio)
        return run_id

    figures = {"ttfp_seconds": 0.25, "audio_seconds": 1.5, "realtime_factor": 0.5}
    spoke = run("say good night", 1, [("audio/wav", b"RIFF one"), ("text/plain", b"good night")], figures)
    twice = run("say it twice", 2, [("audio/wav", b"RIFF two"), ("audio/wav", b"RIFF three")], figures)
    drew = run("draw a night sky", 3, [("image/png", b"png")])
    wrote = run("write good night", 4, [("text/plain", b"good night")])
    silent = run("say nothing", 5, [], {"ttfp_seconds": None, "audio_seconds": 0.0, "realtime_factor": None})

    def ids(**flt) -> list[str]:
        return [r.id for r in store.list_runs(RunFilter(**flt), limit=100)]

    assert ids(output_kind="audio") == [spoke, twice]  # a run that asked for audio and said nothing: not
    assert ids(output_kind="image") == [drew]
    assert ids(output_kind="text") == [spoke, wrote]
    assert ids(output_kind=["audio", "image"]) == [spoke, twice, drew]
    assert ids(output_kind="audio", search="GOOD NIGHT") == [spoke]  # with the prompt search
    assert ids(search="good night") == [spoke, wrote]
    assert store.count_runs(RunFilter(output_kind="audio")) == 2
    assert store.count_matching(RunFilter(output_kind="audio")).value == 2
    assert silent in ids()
    with pytest.raises(ValueError, match="unknown output kind 'sound'; one of: image, text, source, audio"):
        ids(output_kind="sound")

    # The list's rows carry a spoken run's figures, how many audio outputs it has and the first one's file.
    rows = {r.id: r for r in store.list_runs(limit=100)}
    first = rows[twice]
    assert (first.audio_count, first.image_count) == (2, 0)
    assert first.audio_sha256 == store.get_run(twice).audio[0].sha256
    assert (first.audio_seconds, first.ttfp_seconds, first.realtime_factor) == (1.5, 0.25, 0.5)
    assert (
        rows[drew].audio_count == 0 and rows[drew].audio_sha256 is None and rows[drew].audio_seconds is None
    )
    assert rows[drew].image_count == 1 and rows[drew].thumbnail_sha256
    assert rows[silent].audio_seconds == 0.0 and rows[silent].audio_count == 0
    assert rows[spoke].to_dict()["audio_seconds"] == 1.5
