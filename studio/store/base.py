"""The run store's foundation: the database engine, this instance's owner id, transactions and files.

:class:`StoreBase` is what every part of :class:`studio.store.store.RunStore` stands on; the parts are
one idea each and build on one another in this order: ``queries.py`` (reading and search),
``writes.py`` (recording runs), ``maintenance.py`` (orphaned runs, deleting, pruning, vacuum), and
``store.py`` (``RunStore``: opening, and the bulk work for the layers built on the store).
"""

from __future__ import annotations

import hashlib
import os
import socket
import threading
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext, suppress
from pathlib import Path
from typing import Any, Self

from sqlalchemy import ClauseElement, Connection, Engine, bindparam, event, func, text
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session

from studio.store import search
from studio.store.files import OutputFiles
from studio.store.models import ACTIVE_STATUSES, RUN_STATUSES, ConfigSnapshot, Output, Run, RunStage, table_of
from studio.store.records import storable

TERMINAL_STATUSES = tuple(s for s in RUN_STATUSES if s not in ACTIVE_STATUSES)
INTERRUPTED_ERROR = (
    "interrupted: the process recording this run stopped (crash, kill or power loss) before the run "
    "finished; marked when the run store was next opened"
)
_runs, _stages, _outputs = table_of(Run), table_of(RunStage), table_of(Output)
_snapshots = table_of(ConfigSnapshot)
COUNT_CAP = 10_000  # counts beyond this read "10,000+": counting every match would walk them all
# A prompt search whose index candidates (SQLite: counted in FTS; PostgreSQL: the planner's estimate)
# exceed this is common enough that reading newest first (through the other filters' indexes) finds a
# page sooner than fetching and sorting every candidate.
FTS_DRIVE_LIMIT = 30_000
_IN_CHUNK = 500  # ids per IN (...) list (bound-parameter limits of SQLite and PostgreSQL)
_MARK_RUNNING = (
    _runs.update()
    .where(_runs.c.id == bindparam("p_id"), _runs.c.status == "queued")
    .values(status="running", started_at=bindparam("p_at"))
)
_FINISH = (
    _runs.update()
    .where(_runs.c.id == bindparam("p_id"), _runs.c.status.in_((*ACTIVE_STATUSES, "interrupted")))
    .values(
        status=bindparam("p_status"),
        error=bindparam("p_error"),
        finished_at=bindparam("p_at"),
        text=func.coalesce(bindparam("p_text", type_=_runs.c.text.type), _runs.c.text),
        input_tokens=func.coalesce(bindparam("p_in", type_=_runs.c.input_tokens.type), _runs.c.input_tokens),
        output_tokens=func.coalesce(
            bindparam("p_out", type_=_runs.c.output_tokens.type), _runs.c.output_tokens
        ),
        ttfp_seconds=func.coalesce(
            bindparam("p_ttfp", type_=_runs.c.ttfp_seconds.type), _runs.c.ttfp_seconds
        ),
        audio_seconds=func.coalesce(
            bindparam("p_audio", type_=_runs.c.audio_seconds.type), _runs.c.audio_seconds
        ),
        realtime_factor=func.coalesce(
            bindparam("p_rtf", type_=_runs.c.realtime_factor.type), _runs.c.realtime_factor
        ),
    )
)

# Owners (store instances) open in this process; another instance with our pid but not in here is a
# previous process that had the same pid (containers restart as pid 1), so its runs are orphans.
_LIVE_OWNERS: set[str] = set()


def _storable_parameters(
    _connection: Connection,
    statement: ClauseElement,
    multiparams: list[dict[str, Any]],
    params: dict[str, Any],
    _options: Any,
) -> tuple[ClauseElement, list[dict[str, Any]], dict[str, Any]]:
    """The one place every value the store sends to the database passes: text SQL cannot hold is escaped.

    A lone surrogate (from JSON ``"\\ud800"``) cannot be encoded as UTF-8 and PostgreSQL refuses NUL; either
    would make the write fail and the run be lost. See :func:`studio.store.records.storable`.
    """
    return statement, [storable(p) for p in multiparams], storable(params)


def _kind_for_mime(mime: str) -> str:
    if mime.startswith("image/"):
        return "image"
    if mime.startswith("text/"):
        return "text"
    if mime.startswith("audio/"):
        return "audio"
    raise ValueError(f"unsupported output type {mime!r}: image/*, text/* or audio/*")


def _process_start_ticks(pid: int) -> int | None:
    """When ``pid`` started (Linux clock ticks since boot), to tell a live process from a reused pid."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # Field 22; the command name (field 2) may contain spaces, so split after its closing parenthesis.
    try:
        return int(stat.rsplit(")", 1)[1].split()[19])
    except (IndexError, ValueError):
        return None


def _new_owner() -> str:
    pid = os.getpid()
    return f"{socket.gethostname()[:80]}|{pid}|{_process_start_ticks(pid) or 0}|{uuid.uuid4().hex[:12]}"


def _advisory_key(owner: str) -> int:
    return int.from_bytes(hashlib.sha256(owner.encode()).digest()[:8], "big", signed=True)


class StoreBase:
    """The engine, the data dir and files, the owner id and the transactions of one run store."""

    def __init__(self, engine: Engine, data_dir: Path, files: OutputFiles | None = None) -> None:
        self.engine = engine
        if not event.contains(engine, "before_execute", _storable_parameters):
            event.listen(engine, "before_execute", _storable_parameters, retval=True)
        self.data_dir = Path(data_dir)
        # The output files' layout lives there; ``files`` may keep them in an object store (--outputs).
        self.files = files if files is not None else OutputFiles.in_data_dir(self.data_dir)
        self.outputs_dir = self.files.root
        self.dialect = engine.dialect.name
        self.owner = _new_owner()
        self.interrupted_at_open = 0
        self.replayed_at_open = 0
        self._write_engine = engine.execution_options(omni_write=True)
        # SQLite has one writer at a time anyway; queueing our own threads here is cheaper than having
        # them spin on the busy timeout.
        self._write_lock = threading.Lock() if self.dialect == "sqlite" else nullcontext()
        self._known_snapshots: set[str] = set()
        self._batch = threading.local()  # the connection of this thread's open batch(), if any
        self._owner_lock: Connection | None = None
        self._closed = False
        self._upsert_snapshot_statement = self._snapshot_insert()
        self.search_indexed = False  # whether the prompt search index exists (set at open)

    def _claim_owner(self) -> None:
        """Make this instance's liveness visible to other processes before it records any run."""
        _LIVE_OWNERS.add(self.owner)
        if self.dialect == "postgresql":
            # A session-level advisory lock lives exactly as long as this connection: if the process
            # dies, the server drops the connection and the lock, and the next opener sees the owner gone.
            self._owner_lock = self.engine.connect()
            self._owner_lock.exec_driver_sql(f"SELECT pg_advisory_lock({_advisory_key(self.owner)})")
            self._owner_lock.commit()

    def _check_search_index(self) -> None:
        with self.engine.connect() as connection:
            present = search.search_index_present(connection)
            connection.commit()
        if not present:  # built by the migration, unless FTS5/pg_trgm was missing or a rebuild dropped it
            with self._write() as connection:
                present = search.ensure_search_index(connection)
        self.search_indexed = present

    def close(self) -> None:
        """Release the owner claim and the connections. Runs still active stay as they are."""
        if self._closed:
            return
        self._closed = True
        _LIVE_OWNERS.discard(self.owner)
        if self._owner_lock is not None:
            with suppress(SQLAlchemyError):  # the server is gone; so is the lock
                self._owner_lock.close()
        self.engine.dispose()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def url(self) -> str:
        return self.engine.url.render_as_string(hide_password=True)

    # transactions ---------------------------------------------------------------------------------

    @contextmanager
    def _write(self) -> Iterator[Connection]:
        connection = getattr(self._batch, "connection", None)
        if connection is not None:  # part of this thread's batch: committed (or not) with it
            yield connection
            return
        with self._write_lock, self._write_engine.begin() as connection:
            yield connection

    @contextmanager
    def batch(self) -> Iterator[None]:
        """Make every write this thread does inside the block one transaction: all of them or none.

        The recorder's writer uses it to commit a burst of queued writes at once (a commit is much of a
        small write's cost). A write that raises leaves the transaction unusable on some databases, so a
        caller that catches an error inside the block must let the block fail and redo the writes singly.
        """
        if getattr(self._batch, "connection", None) is not None:
            yield
            return
        after_commit: list[Callable[[], None]] = []
        with self._write_lock, self._write_engine.begin() as connection:
            self._batch.connection, self._batch.after_commit = connection, after_commit
            try:
                yield
            finally:
                self._batch.connection = self._batch.after_commit = None
        for callback in after_commit:
            callback()

    def _after_commit(self, callback: Callable[[], None]) -> None:
        """Run ``callback`` once the current write is committed (at once when not in a batch)."""
        pending = getattr(self._batch, "after_commit", None)
        if pending is not None:
            pending.append(callback)
        else:
            callback()

    @contextmanager
    def _read(self) -> Iterator[Session]:
        with Session(self.engine) as session, session.begin():
            if self.dialect == "postgresql":
                # Plan reads with their values: psycopg prepares a statement once it has run a few
                # times, and the server may then switch to a generic plan that cannot see the search
                # pattern or the dates (the History query read the whole trigram index: 4x slower at
                # 1M runs). Writes keep their cached plans.
                session.execute(text("SET LOCAL plan_cache_mode = force_custom_plan"))
            yield session

    # files ---------------------------------------------------------------------------------------

    def file_path(self, sha256: str, mime: str) -> Path:
        """Where the file with this hash and type lives."""
        return self.files.path(sha256, mime)

    def write_file(self, data: bytes, mime: str, sha256: str | None = None) -> tuple[str, Path]:
        """Put ``data`` in the content-addressed tree (once per hash); returns its sha256 and path."""
        return self.files.write(data, mime, sha256)

    def _snapshot_insert(self) -> Any:
        # Concurrent processes may snapshot the same config; the first wins, the rest are no-ops.
        if self.dialect == "sqlite":
            from sqlalchemy.dialects import sqlite

            return sqlite.insert(_snapshots).on_conflict_do_nothing()
        if self.dialect == "postgresql":
            from sqlalchemy.dialects import postgresql

            return postgresql.insert(_snapshots).on_conflict_do_nothing()
        return None
