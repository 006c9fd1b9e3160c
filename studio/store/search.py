"""The prompt search index: SQLite FTS5 (trigram tokenizer) or PostgreSQL ``pg_trgm``.

Both are candidate filters only. The condition that decides whether a run matches is always the plain
case-insensitive substring test (``RunFilter.search``), so an index answers exactly what a scan answers;
it only narrows which rows are tested.

SQLite: ``runs_fts`` is an external-content FTS5 table over ``runs.prompt`` keyed by the ``runs`` rowid,
kept in sync by three triggers (insert, delete, update of the prompt). A trigram index cannot look up
terms shorter than three characters; those searches scan (newest first, stopping at the page size).
VACUUM keeps the rowids of ``runs`` (its rows are copied as they are); a migration that rebuilds
``runs`` (Alembic batch mode copies the table and drops the old one, triggers included) must call
:func:`install_sqlite_search` afterwards, and :func:`ensure_search_index` re-installs missing triggers
with a rebuild when the store opens.

PostgreSQL: a GIN ``gin_trgm_ops`` index on ``prompt`` serves ``ILIKE '%term%'`` directly. It needs the
``pg_trgm`` extension: when it cannot be created (no privilege, not installed), the store works without
the index (searches scan) and tries again at the next open.
"""

from __future__ import annotations

import logging

from sqlalchemy import Connection

log = logging.getLogger(__name__)

FTS_TABLE = "runs_fts"
PG_TRGM_INDEX = "ix_runs_prompt_trgm"
MIN_INDEXED_TERM = 3  # trigrams: shorter terms cannot use the index
# What the schema comparison with the models ignores: objects that exist only on one backend, or only
# when the extension is available.
SEARCH_OBJECTS = frozenset(
    {
        FTS_TABLE,
        f"{FTS_TABLE}_data",
        f"{FTS_TABLE}_idx",
        f"{FTS_TABLE}_docsize",
        f"{FTS_TABLE}_config",
        f"{FTS_TABLE}_content",
        PG_TRGM_INDEX,
    }
)

_SQLITE_TRIGGERS = {
    f"{FTS_TABLE}_ai": (
        f"CREATE TRIGGER {FTS_TABLE}_ai AFTER INSERT ON runs BEGIN "
        f"INSERT INTO {FTS_TABLE}(rowid, prompt) VALUES (new.rowid, new.prompt); END"
    ),
    f"{FTS_TABLE}_ad": (
        f"CREATE TRIGGER {FTS_TABLE}_ad AFTER DELETE ON runs BEGIN "
        f"INSERT INTO {FTS_TABLE}({FTS_TABLE}, rowid, prompt) VALUES ('delete', old.rowid, old.prompt); END"
    ),
    f"{FTS_TABLE}_au": (
        f"CREATE TRIGGER {FTS_TABLE}_au AFTER UPDATE OF prompt ON runs BEGIN "
        f"INSERT INTO {FTS_TABLE}({FTS_TABLE}, rowid, prompt) VALUES ('delete', old.rowid, old.prompt); "
        f"INSERT INTO {FTS_TABLE}(rowid, prompt) VALUES (new.rowid, new.prompt); END"
    ),
}


def _sqlite_objects(connection: Connection) -> set[str]:
    rows = connection.exec_driver_sql(
        "SELECT name FROM sqlite_master WHERE name = ? OR (type = 'trigger' AND tbl_name = 'runs')",
        (FTS_TABLE,),
    )
    return {row[0] for row in rows}


def sqlite_fts_available(connection: Connection) -> bool:
    """Whether this SQLite has FTS5 with the trigram tokenizer (3.34+, compiled with FTS5)."""
    try:
        connection.exec_driver_sql(
            "CREATE VIRTUAL TABLE temp._omni_fts_probe USING fts5(x, tokenize='trigram')"
        )
    except Exception:  # noqa: BLE001 - any failure means "not available"
        return False
    connection.exec_driver_sql("DROP TABLE temp._omni_fts_probe")
    return True


def install_sqlite_search(connection: Connection) -> bool:
    """Create the FTS table and triggers where missing and (re)build the index; False without FTS5."""
    present = _sqlite_objects(connection)
    if FTS_TABLE not in present:
        if not sqlite_fts_available(connection):
            log.warning("run store: this SQLite has no FTS5 trigram tokenizer; prompt search scans")
            return False
        connection.exec_driver_sql(
            f"CREATE VIRTUAL TABLE {FTS_TABLE} USING fts5("
            "prompt, content='runs', content_rowid='rowid', tokenize='trigram')"
        )
    for name, ddl in _SQLITE_TRIGGERS.items():
        if name not in present:
            connection.exec_driver_sql(ddl)
    connection.exec_driver_sql(f"INSERT INTO {FTS_TABLE}({FTS_TABLE}) VALUES ('rebuild')")
    return True


def drop_sqlite_search(connection: Connection) -> None:
    for name in _SQLITE_TRIGGERS:
        connection.exec_driver_sql(f"DROP TRIGGER IF EXISTS {name}")
    connection.exec_driver_sql(f"DROP TABLE IF EXISTS {FTS_TABLE}")


def _pg_trgm_schema(connection: Connection) -> str | None:
    return connection.exec_driver_sql(
        "SELECT n.nspname FROM pg_extension e JOIN pg_namespace n ON n.oid = e.extnamespace "
        "WHERE e.extname = 'pg_trgm'"
    ).scalar()


def _pg_index_exists(connection: Connection) -> bool:
    return bool(connection.exec_driver_sql(f"SELECT to_regclass('{PG_TRGM_INDEX}') IS NOT NULL").scalar())


def install_pg_search(connection: Connection) -> bool:
    """Create ``pg_trgm`` (if allowed) and the trigram index on ``runs.prompt``; False when not possible.

    Each attempt runs in a savepoint, so a refusal leaves the surrounding transaction (a migration) usable.
    The extension goes to the ``public`` schema when there is one, so that dropping the store's own schema
    does not take it (and other schemas' indexes) along.
    """
    if _pg_index_exists(connection):
        return True
    schema = _pg_trgm_schema(connection)
    if schema is None:
        reason: Exception | None = None
        for statement in (
            "CREATE EXTENSION IF NOT EXISTS pg_trgm WITH SCHEMA public",
            "CREATE EXTENSION IF NOT EXISTS pg_trgm",
        ):
            try:
                with connection.begin_nested():
                    connection.exec_driver_sql(statement)
                break
            except Exception as exc:  # noqa: BLE001 - no privilege, not installed, no public schema
                reason = exc
        schema = _pg_trgm_schema(connection)
        if schema is None:
            log.warning(
                "run store: the pg_trgm extension is not available (%s); prompt search scans. "
                "`CREATE EXTENSION pg_trgm` as a superuser, and the index is built at the next start",
                str(reason).splitlines()[0],
            )
            return False
    quoted = schema.replace('"', '""')
    connection.exec_driver_sql(
        f'CREATE INDEX {PG_TRGM_INDEX} ON runs USING gin (prompt "{quoted}".gin_trgm_ops)'
    )
    return True


def drop_pg_search(connection: Connection) -> None:
    connection.exec_driver_sql(f"DROP INDEX IF EXISTS {PG_TRGM_INDEX}")


def search_index_present(connection: Connection) -> bool:
    """Whether the prompt search index exists on this database (read only)."""
    if connection.dialect.name == "sqlite":
        return {FTS_TABLE, *_SQLITE_TRIGGERS} <= _sqlite_objects(connection)
    if connection.dialect.name == "postgresql":
        return _pg_index_exists(connection)
    return False


def ensure_search_index(connection: Connection) -> bool:
    """Install the search index where the migration could not (or a later table rebuild dropped it)."""
    if search_index_present(connection):
        return True
    if connection.dialect.name == "sqlite":
        return install_sqlite_search(connection)
    if connection.dialect.name == "postgresql":
        return install_pg_search(connection)
    return False
