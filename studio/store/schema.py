"""The run database: engines with the right connection settings, and the Alembic migrations applied at open.

Migrations live in ``migrations/versions`` (one per file) and run through Alembic's Python API with the
script location inside this package, so nothing outside the installed package (no alembic.ini) is needed.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from sqlalchemy import Connection, Engine, create_engine, event
from sqlalchemy.engine import make_url
from sqlalchemy.pool import StaticPool

from studio.store.errors import StoreError

MIGRATIONS_DIR = Path(__file__).resolve().parent / "migrations"
SQLITE_BUSY_TIMEOUT_MS = 30_000
_MIGRATION_LOCK_KEY = 7_304_551_001  # PostgreSQL advisory lock held while one process migrates


def default_url(data_dir: Path) -> str:
    """The SQLite file in the data dir."""
    return f"sqlite:///{Path(data_dir).resolve() / 'runs.db'}"


def _install_sqlite_hooks(engine: Engine) -> None:
    """WAL, foreign keys, NORMAL sync and a busy timeout on every connection; our own BEGIN.

    pysqlite's own transaction handling starts transactions lazily and as DEFERRED, so two writers can
    deadlock upgrading their read locks (SQLITE_BUSY without waiting). We emit BEGIN ourselves: IMMEDIATE
    for writes (they queue on the busy timeout instead), plain BEGIN for reads.
    """

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_connection: Any, _record: Any) -> None:
        dbapi_connection.isolation_level = None
        cursor = dbapi_connection.cursor()
        try:
            cursor.execute(f"PRAGMA busy_timeout = {SQLITE_BUSY_TIMEOUT_MS}")
            cursor.execute("PRAGMA journal_mode = WAL")
            cursor.execute("PRAGMA synchronous = NORMAL")  # safe with WAL; a commit costs no fsync
            cursor.execute("PRAGMA foreign_keys = ON")
        finally:
            cursor.close()

    @event.listens_for(engine, "begin")
    def _on_begin(connection: Connection) -> None:
        write = connection.get_execution_options().get("omni_write", False)
        connection.exec_driver_sql("BEGIN IMMEDIATE" if write else "BEGIN")


def create_store_engine(url: str) -> Engine:
    """A SQLAlchemy engine for ``url`` with the run store's connection settings."""
    parsed = make_url(url)
    if parsed.drivername in ("postgresql", "postgres"):
        parsed = parsed.set(drivername="postgresql+psycopg")  # the driver we ship (psycopg 3)
    if parsed.get_backend_name() == "sqlite":
        memory = parsed.database in (None, "", ":memory:")
        if parsed.database and not memory:
            Path(parsed.database).expanduser().parent.mkdir(parents=True, exist_ok=True)
        kwargs: dict[str, Any] = {"connect_args": {"check_same_thread": False}}
        if memory:
            kwargs["poolclass"] = StaticPool  # one shared connection, or every session sees an empty DB
        engine = create_engine(parsed, **kwargs)
        _install_sqlite_hooks(engine)
        return engine
    return create_engine(parsed, pool_pre_ping=True)


def alembic_config(connection: Connection | None = None) -> Any:
    """Alembic's config for the run store's migrations (no alembic.ini: everything is set here)."""
    from alembic.config import Config

    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS_DIR))
    config.attributes["connection"] = connection
    return config


def head_revision() -> str:
    """The newest migration this code knows."""
    from alembic.script import ScriptDirectory

    head = ScriptDirectory.from_config(alembic_config()).get_current_head()
    assert head is not None
    return head


def _sqlite_pragma(connection: Connection, pragma: str) -> None:
    """Run a PRAGMA on the DBAPI connection itself (outside any transaction SQLAlchemy would open)."""
    driver = connection.connection.driver_connection
    if driver is None:  # only after the connection was invalidated
        raise RuntimeError("the SQLite connection is closed")
    driver.execute(pragma)


@contextmanager
def _migration_connection(engine: Engine) -> Iterator[Connection]:
    """A connection holding the database's write lock for the whole migration.

    On SQLite, foreign keys are switched off meanwhile: Alembic's batch mode rebuilds a table by
    dropping it, which with foreign keys on would cascade-delete the rows that reference it.
    """
    with engine.connect() as connection:
        sqlite = engine.dialect.name == "sqlite"
        if sqlite:
            _sqlite_pragma(connection, "PRAGMA foreign_keys = OFF")
        try:
            connection.execution_options(omni_write=True)
            with connection.begin():
                if engine.dialect.name == "postgresql":
                    connection.exec_driver_sql(f"SELECT pg_advisory_xact_lock({_MIGRATION_LOCK_KEY})")
                yield connection
        finally:
            if sqlite:
                _sqlite_pragma(connection, "PRAGMA foreign_keys = ON")


def current_revision(engine: Engine) -> str | None:
    """The migration the database is at (``None``: an empty database)."""
    from alembic.runtime.migration import MigrationContext

    with engine.connect() as connection:
        return MigrationContext.configure(connection).get_current_revision()


def upgrade_schema(engine: Engine, revision: str = "head") -> None:
    """Apply migrations up to ``revision``; concurrent openers wait for each other."""
    from alembic import command
    from alembic.script import ScriptDirectory

    script = ScriptDirectory.from_config(alembic_config())
    current = current_revision(engine)
    known = {rev.revision for rev in script.walk_revisions()}
    if current is not None and current not in known:
        raise StoreError(
            f"the run database is at schema revision {current}, which this omni-studio does not know "
            f"(newest known: {script.get_current_head()}); it was written by a newer omni-studio"
        )
    if revision == "head" and current == script.get_current_head():
        return  # the common case: nothing to do, no write lock taken
    with _migration_connection(engine) as connection:
        command.upgrade(alembic_config(connection), revision)


def downgrade_schema(engine: Engine, revision: str) -> None:
    """Revert migrations down to ``revision`` (``"base"``: an empty database). For tests and rollbacks."""
    from alembic import command

    with _migration_connection(engine) as connection:
        command.downgrade(alembic_config(connection), revision)
