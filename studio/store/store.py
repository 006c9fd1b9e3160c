"""The run store: every run from the UI, the API and the CLI, with its stages, outputs and config snapshot.

One :class:`RunStore` per process wraps a SQLAlchemy engine (SQLite in the data dir by default, or any
URL such as PostgreSQL shared by several studio processes) and a content-addressed file tree
(:class:`studio.store.files.OutputFiles`). Every method is synchronous and thread-safe: each call is
one short transaction (or part of the calling thread's :meth:`RunStore.batch`). Callers on an event loop
go through :class:`studio.store.recorder.RunRecorder`, which makes these calls on a writer thread.

Writes use prebuilt Core statements with bound parameters (compiled once, cached by SQLAlchemy); the
ORM is used for reading, where relationships pay off.
"""

from __future__ import annotations

import hashlib
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager, nullcontext, suppress
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

from sqlalchemy import (
    ClauseElement,
    ColumnElement,
    Connection,
    Engine,
    bindparam,
    delete,
    event,
    func,
    literal_column,
    select,
    text,
    tuple_,
)
from sqlalchemy.engine import make_url
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session, joinedload, selectinload

from studio.store import search
from studio.store.errors import AmbiguousRunId, RunNotFound, StoreError
from studio.store.files import OutputFiles
from studio.store.models import (
    ACTIVE_STATUSES,
    OUTPUT_KINDS,
    RUN_SOURCES,
    RUN_STATUSES,
    ConfigSnapshot,
    Output,
    Run,
    RunStage,
    table_of,
    utcnow,
)
from studio.store.records import (
    OutputRecord,
    RunCount,
    RunDetail,
    RunFilter,
    RunPage,
    RunSummary,
    StageRecord,
    as_datetime,
    config_hash_of,
    diff_mappings,
    flatten,
    jsonable,
    storable,
)
from studio.store.schema import create_store_engine, default_url, upgrade_schema

log = logging.getLogger(__name__)

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
    raise ValueError(f"unsupported output type {mime!r}: image/* or text/*")


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


class RunStore:
    """Runs, stages, outputs and config snapshots in a SQL database plus content-addressed files.

    Open with :func:`open_store`. Thread-safe.
    """

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

    # opening and closing ---------------------------------------------------------------------------

    @classmethod
    def open(
        cls,
        url: str | None,
        data_dir: Path,
        files: OutputFiles | None = None,
        before_serving: Callable[[RunStore], None] | None = None,
    ) -> RunStore:
        """Connect, migrate to the newest schema, claim an owner id, interrupt orphaned runs.

        ``before_serving`` runs on the open store just before orphans are interrupted: the journal
        replay of :func:`studio.store.opening.open_store`, built on top of the store.
        """
        data_dir = Path(data_dir).expanduser()
        data_dir.mkdir(parents=True, exist_ok=True)
        url = url or default_url(data_dir)
        try:
            engine = create_store_engine(url)
        except (SQLAlchemyError, ValueError, ImportError) as exc:
            raise StoreError(f"cannot use run database {url!r}: {exc}") from exc
        store = cls(engine, data_dir, files)
        try:
            upgrade_schema(engine)
            store._check_search_index()
            store._claim_owner()
            # Writes an earlier process could not make (database down) are made now, before serving;
            # runs they leave unfinished are then interrupted like any other orphan.
            if before_serving is not None:
                before_serving(store)
            store.interrupted_at_open = store.interrupt_orphaned_runs()
        except SQLAlchemyError as exc:
            store.close()
            safe_url = make_url(url).render_as_string(hide_password=True)
            raise StoreError(f"cannot open run database {safe_url}: {exc.__class__.__name__}: {exc}") from exc
        except BaseException:
            store.close()
            raise
        if store.interrupted_at_open:
            log.warning(
                "run store: %d run(s) left running by a stopped process marked interrupted",
                store.interrupted_at_open,
            )
        return store

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

    def __enter__(self) -> RunStore:
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

    # orphaned runs --------------------------------------------------------------------------------

    def owner_alive(self, owner: str | None) -> bool:
        """Whether the store instance ``owner`` may still be recording (and finishing) its runs."""
        if owner is None:
            return False
        if owner == self.owner or owner in _LIVE_OWNERS:
            return True
        if self.dialect == "postgresql":
            key = _advisory_key(owner)
            with self.engine.connect() as connection:
                acquired = bool(connection.exec_driver_sql(f"SELECT pg_try_advisory_lock({key})").scalar())
                if acquired:
                    connection.exec_driver_sql(f"SELECT pg_advisory_unlock({key})")
                connection.commit()
            return not acquired
        try:
            host, pid_text, ticks_text, _token = owner.split("|")
            pid, ticks = int(pid_text), int(ticks_text)
        except ValueError:
            return False
        if host != socket.gethostname()[:80] or pid == os.getpid():
            # Another host cannot share a SQLite file safely; our own pid with an unknown token is a
            # previous process that had this pid.
            return False
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:  # exists, owned by someone else
            pass
        current = _process_start_ticks(pid)
        return not (ticks and current is not None and current != ticks)

    def interrupt_orphaned_runs(self) -> int:
        """Mark queued/running runs whose recording process is gone as ``interrupted``; returns how many."""
        with self._read() as session:
            owners = set(session.scalars(select(Run.owner).where(Run.status.in_(ACTIVE_STATUSES)).distinct()))
        dead = [o for o in owners if not self.owner_alive(o)]
        if not dead:
            return 0
        condition: ColumnElement[bool] = _runs.c.owner.in_([o for o in dead if o is not None])
        if None in dead:
            condition = condition | _runs.c.owner.is_(None)
        with self._write() as connection:
            result = connection.execute(
                _runs.update()
                .where(_runs.c.status.in_(ACTIVE_STATUSES), condition)
                .values(status="interrupted", error=INTERRUPTED_ERROR, finished_at=utcnow())
            )
            return result.rowcount or 0

    # recording ------------------------------------------------------------------------------------

    def _snapshot_insert(self) -> Any:
        # Concurrent processes may snapshot the same config; the first wins, the rest are no-ops.
        if self.dialect == "sqlite":
            from sqlalchemy.dialects import sqlite

            return sqlite.insert(_snapshots).on_conflict_do_nothing()
        if self.dialect == "postgresql":
            from sqlalchemy.dialects import postgresql

            return postgresql.insert(_snapshots).on_conflict_do_nothing()
        return None

    def upsert_snapshot(
        self,
        connection: Connection,
        config_hash: str,
        body: Mapping[str, Any],
        created_at: datetime | None = None,
    ) -> None:
        """Add a config snapshot unless one with this hash exists (inside ``connection``'s transaction)."""
        if config_hash in self._known_snapshots:
            return
        found = body.get("model")
        model: Mapping[str, Any] = found if isinstance(found, Mapping) else {}
        values = {
            "hash": config_hash,
            "body": jsonable(dict(body)),
            "family": str(body.get("family") or ""),
            "model_name": str(model.get("name") or ""),
            "created_at": created_at or utcnow(),
        }
        if self._upsert_snapshot_statement is not None:
            connection.execute(self._upsert_snapshot_statement, values)
        elif connection.scalar(select(ConfigSnapshot.hash).where(ConfigSnapshot.hash == config_hash)) is None:
            connection.execute(_snapshots.insert(), values)

    def create_run(
        self,
        *,
        source: str,
        prompt: str,
        model: str,
        request: Mapping[str, Any],
        parameters: Mapping[str, Any],
        seed: int | None = None,
        config: Mapping[str, Any] | None = None,
        config_hash: str | None = None,
        fingerprint: str | None = None,
        run_id: str | None = None,
        status: str = "queued",
        created_at: datetime | float | None = None,
        owner: str | None = None,
        replay_of: str | None = None,
    ) -> str:
        """Record a new run and return its id (``run_id`` when given, else a fresh uuid hex).

        ``config`` is the pipeline config's ``to_dict()``; it is snapshotted once per hash. ``owner`` is the
        store instance recording the run (this one by default; a journal replay passes the journal's).
        ``replay_of`` is the id of the run this one replays (``omni-studio replay``, docs/replay.md).
        """
        if source not in RUN_SOURCES:
            raise ValueError(f"source must be one of {', '.join(RUN_SOURCES)}, got {source!r}")
        if status not in RUN_STATUSES:
            raise ValueError(f"status must be one of {', '.join(RUN_STATUSES)}, got {status!r}")
        run_id = run_id or uuid.uuid4().hex
        if config is not None and config_hash is None:
            config_hash = config_hash_of(config)
        row = {
            "id": run_id,
            "source": source,
            "created_at": as_datetime(created_at) or utcnow(),
            "status": status,
            "prompt": prompt,
            "model": model,
            "request": jsonable(dict(request)),
            "parameters": jsonable(dict(parameters)),
            "seed": seed,
            "config_hash": config_hash,
            "fingerprint": fingerprint,
            "owner": owner or self.owner,
            "replay_of": replay_of,
        }
        with self._write() as connection:
            if config is not None and config_hash is not None:  # the hash is computed above
                self.upsert_snapshot(connection, config_hash, config)
            connection.execute(_runs.insert(), row)
        if config_hash is not None and config is not None:
            # Only once committed: a batch rolled back would otherwise leave us skipping a missing snapshot.
            self._after_commit(lambda: self._known_snapshots.add(config_hash))
        return run_id

    def mark_running(self, run_id: str, at: datetime | float | None = None) -> bool:
        """queued -> running (the first stage started). False when the run is not queued."""
        with self._write() as connection:
            result = connection.execute(_MARK_RUNNING, {"p_id": run_id, "p_at": as_datetime(at) or utcnow()})
            return bool(result.rowcount)

    def add_stage(
        self,
        run_id: str,
        *,
        stage_id: int,
        kind: str,
        status: str,
        started_at: datetime | float | None,
        finished_at: datetime | float | None,
        queue_seconds: float = 0.0,
        input_tokens: int = 0,
        output_tokens: int = 0,
        batch_size: int = 1,
        variant_index: int = 0,
    ) -> None:
        """Record one finished stage of one variant (timings are datetimes or ``time.time()`` stamps)."""
        row = {
            "run_id": run_id,
            "variant_index": variant_index,
            "stage_id": stage_id,
            "kind": kind,
            "status": status,
            "started_at": as_datetime(started_at),
            "finished_at": as_datetime(finished_at),
            "queue_seconds": float(queue_seconds),
            "input_tokens": int(input_tokens),
            "output_tokens": int(output_tokens),
            "batch_size": int(batch_size),
        }
        with self._write() as connection:
            connection.execute(_stages.insert(), row)

    def file_path(self, sha256: str, mime: str) -> Path:
        """Where the file with this hash and type lives."""
        return self.files.path(sha256, mime)

    def write_file(self, data: bytes, mime: str, sha256: str | None = None) -> tuple[str, Path]:
        """Put ``data`` in the content-addressed tree (once per hash); returns its sha256 and path."""
        return self.files.write(data, mime, sha256)

    def add_output(
        self,
        run_id: str,
        index: int,
        data: bytes,
        mime: str,
        width: int | None = None,
        height: int | None = None,
        kind: str | None = None,
    ) -> str:
        """Store a run's output file (once per content hash) and its row; returns the sha256.

        ``kind`` defaults from ``mime`` (image/* -> image, text/* -> text); ``source`` records the input
        image of an image-to-image run. ``index`` counts within the kind.
        """
        kind = kind or _kind_for_mime(mime)
        if kind not in OUTPUT_KINDS:
            raise ValueError(f"kind must be one of {', '.join(OUTPUT_KINDS)}, got {kind!r}")
        sha256, _path = self.write_file(data, mime)
        return self.add_output_file(run_id, index, sha256, mime, width, height, kind, len(data), data)

    def add_output_file(
        self,
        run_id: str,
        index: int,
        sha256: str,
        mime: str,
        width: int | None = None,
        height: int | None = None,
        kind: str | None = None,
        size_bytes: int = 0,
        data: bytes | None = None,
    ) -> str:
        """Record an output whose file is already in the tree (:meth:`write_file`); returns its sha256.

        ``data`` (the file's bytes, when still at hand) rewrites the file if retention in another process
        removed it between the file write and this row.
        """
        kind = kind or _kind_for_mime(mime)
        if kind not in OUTPUT_KINDS:
            raise ValueError(f"kind must be one of {', '.join(OUTPUT_KINDS)}, got {kind!r}")
        row = {
            "run_id": run_id,
            "index": index,
            "kind": kind,
            "sha256": sha256,
            "mime": mime,
            "width": width,
            "height": height,
            "size_bytes": size_bytes,
        }
        with self._write() as connection:
            connection.execute(_outputs.insert(), row)
        if data is not None and not self.file_path(sha256, mime).exists():
            self.write_file(data, mime, sha256)
        return sha256

    def finish_run(
        self,
        run_id: str,
        status: str,
        error: str | None = None,
        text: str | None = None,
        usage: Mapping[str, int] | None = None,
        at: datetime | float | None = None,
    ) -> bool:
        """Record a run's outcome. The first outcome wins: False when the run had already finished.

        ``usage`` holds ``input_tokens`` and ``output_tokens``. A run marked interrupted by mistake (its
        owner looked dead) still takes the real outcome.
        """
        if status not in TERMINAL_STATUSES:
            raise ValueError(f"a run finishes as one of {', '.join(TERMINAL_STATUSES)}, not {status!r}")
        usage = usage or {}
        params = {
            "p_id": run_id,
            "p_status": status,
            "p_error": error,
            "p_at": as_datetime(at) or utcnow(),
            "p_text": text,
            "p_in": usage.get("input_tokens"),
            "p_out": usage.get("output_tokens"),
        }
        with self._write() as connection:
            return bool(connection.execute(_FINISH, params).rowcount)

    def apply_journaled(self, op: str, args: Mapping[str, Any], owner: str | None = None) -> None:
        """Make one journaled write (:mod:`studio.store.journal`), skipping what is already recorded.

        Idempotent, so a journal replayed twice (a crash between its commit and its removal) records
        nothing twice: an existing run, stage (variant, stage id) or output (kind, index) is left as is,
        and a run's first outcome wins anyway.
        """
        args = dict(args)
        with self._write() as connection:
            if op == "create_run":
                if connection.scalar(select(_runs.c.id).where(_runs.c.id == args["run_id"])) is None:
                    self.create_run(**args, owner=owner)
            elif op == "add_stage":
                found = connection.scalar(
                    select(_stages.c.id).where(
                        _stages.c.run_id == args["run_id"],
                        _stages.c.variant_index == args.get("variant_index", 0),
                        _stages.c.stage_id == args["stage_id"],
                    )
                )
                if found is None:
                    self.add_stage(**args)
            elif op == "add_output_file":
                kind = args.get("kind") or _kind_for_mime(args["mime"])
                found = connection.scalar(
                    select(_outputs.c.id).where(
                        _outputs.c.run_id == args["run_id"],
                        _outputs.c.kind == kind,
                        _outputs.c.index == args["index"],
                    )
                )
                if found is None:
                    self.add_output_file(**args)
            elif op == "mark_running":
                self.mark_running(**args)
            elif op == "finish_run":
                self.finish_run(**args)
            else:
                raise ValueError(f"unknown journaled write {op!r}")

    # reading --------------------------------------------------------------------------------------

    def _detail(self, run: Run) -> RunDetail:
        return RunDetail(
            id=run.id,
            source=run.source,
            status=run.status,
            created_at=run.created_at,
            started_at=run.started_at,
            finished_at=run.finished_at,
            prompt=run.prompt,
            model=run.model,
            request=run.request,
            parameters=run.parameters,
            seed=run.seed,
            config_hash=run.config_hash,
            fingerprint=run.fingerprint,
            error=run.error,
            text=run.text,
            input_tokens=run.input_tokens,
            output_tokens=run.output_tokens,
            stages=[
                StageRecord(
                    s.variant_index,
                    s.stage_id,
                    s.kind,
                    s.status,
                    s.started_at,
                    s.finished_at,
                    s.queue_seconds,
                    s.input_tokens,
                    s.output_tokens,
                    s.batch_size,
                )
                for s in run.stages
            ],
            outputs=[
                OutputRecord(
                    o.index,
                    o.kind,
                    o.sha256,
                    o.mime,
                    o.width,
                    o.height,
                    o.size_bytes,
                    self.file_path(o.sha256, o.mime),
                )
                for o in run.outputs
            ],
            config=run.config.body if run.config is not None else None,
            replay_of=run.replay_of,
        )

    @staticmethod
    def _load_runs(session: Session, ids: Sequence[str]) -> list[Run]:
        runs = (
            session.scalars(
                select(Run)
                .where(Run.id.in_(ids))
                .options(selectinload(Run.stages), selectinload(Run.outputs), joinedload(Run.config))
            )
            .unique()
            .all()
        )
        order = {run_id: i for i, run_id in enumerate(ids)}
        return sorted(runs, key=lambda r: order[r.id])

    def get_run(self, run_id: str) -> RunDetail:
        """Everything about one run (``run_id`` exact); raises :class:`RunNotFound`."""
        with self._read() as session:
            runs = self._load_runs(session, [run_id])
            if not runs:
                raise RunNotFound(f"no run with id {run_id!r}")
            return self._detail(runs[0])

    def iter_runs(self, filter: RunFilter | None = None, chunk: int = 500) -> Iterator[Run]:
        """Every matching run, oldest first, loaded with stages, outputs and snapshot (for export)."""
        with self._read() as session:
            ids = list(
                session.scalars(
                    self._filtered(select(Run.id), filter, session).order_by(Run.created_at, Run.id)
                )
            )
        for start in range(0, len(ids), chunk):
            with self._read() as session:
                yield from self._load_runs(session, ids[start : start + chunk])

    def resolve_run_id(self, prefix: str) -> str:
        """The full id of the one run whose id starts with ``prefix`` (ids are shown shortened)."""
        prefix = prefix.strip().lower()
        if not prefix:
            raise RunNotFound("no run id given")
        with self._read() as session:
            if session.get(Run, prefix) is not None:
                return prefix
            ids = session.scalars(
                select(Run.id).where(Run.id.startswith(prefix, autoescape=True)).order_by(Run.id).limit(3)
            ).all()
        if not ids:
            raise RunNotFound(f"no run id starts with {prefix!r}")
        if len(ids) > 1:
            raise AmbiguousRunId(
                f"{prefix!r} matches several runs ({', '.join(ids[:2])}, ...); give more digits"
            )
        return ids[0]

    def _search_condition(self, connection: Connection | Session, term: str) -> list[ColumnElement[bool]]:
        """The prompt-search conditions: the plain substring test, plus the index as a candidate filter.

        The substring test alone decides (the index only narrows which rows it sees), so an indexed search
        answers exactly what a scan answers. On SQLite the FTS candidates drive the query only when there
        are few of them: a common term is found sooner newest first, through the other filters' indexes.
        """
        # Stored text has unstorable characters escaped (records.storable); so has the search term.
        term = storable(term)
        if len(term) < search.MIN_INDEXED_TERM:
            # Below a trigram: the index could only be read whole. `prompt || ''` keeps the PostgreSQL
            # planner off it; filters' indexes (or a newest-first scan stopping at the page) serve instead.
            return [(Run.prompt + "").icontains(term, autoescape=True)]
        conditions: list[ColumnElement[bool]] = [Run.prompt.icontains(term, autoescape=True)]
        if not self.search_indexed:
            return conditions
        if self.dialect == "postgresql":
            # The trigram index serves the ILIKE itself. For a term in many prompts the planner still
            # ANDs the index in (reading every match from it) where the other filters' indexes alone
            # are cheaper; its own row estimate says which case this is.
            pattern = "%" + term.replace("/", "//").replace("%", "/%").replace("_", "/_") + "%"
            plan = connection.execute(
                text("EXPLAIN (FORMAT JSON) SELECT 1 FROM runs WHERE prompt ILIKE :pattern ESCAPE '/'"),
                {"pattern": pattern},
            ).scalar()
            estimate = plan[0]["Plan"]["Plan Rows"] if isinstance(plan, list) and plan else 0
            if estimate > FTS_DRIVE_LIMIT:
                return [(Run.prompt + "").icontains(term, autoescape=True)]
            return conditions
        if self.dialect != "sqlite":
            return conditions
        phrase = '"' + term.replace('"', '""') + '"'
        candidates = connection.execute(
            text(
                f"SELECT count(*) FROM (SELECT 1 FROM {search.FTS_TABLE} "
                f"WHERE {search.FTS_TABLE} MATCH :phrase LIMIT :cap)"
            ),
            {"phrase": phrase, "cap": FTS_DRIVE_LIMIT + 1},
        ).scalar()
        if (candidates or 0) <= FTS_DRIVE_LIMIT:
            conditions.append(
                literal_column("runs.rowid").in_(
                    text(
                        f"SELECT rowid FROM {search.FTS_TABLE} WHERE {search.FTS_TABLE} MATCH :phrase"
                    ).bindparams(phrase=phrase)
                )
            )
        return conditions

    def _filtered(self, statement: Any, flt: RunFilter | None, connection: Connection | Session) -> Any:
        if flt is None:
            return statement
        conditions: list[ColumnElement[bool]] = []
        # SQLite plans without value statistics, and a status is a poor narrower (most runs succeed): with
        # a model, fingerprint or config filter, `status || ''` leaves that filter's index to drive.
        narrower = bool(flt.model or flt.fingerprint or flt.config_hash)
        for column, value, allowed in (
            (Run.status, flt.status, RUN_STATUSES),
            (Run.source, flt.source, RUN_SOURCES),
        ):
            if value is None:
                continue
            values = [value] if isinstance(value, str) else list(value)
            unknown = [v for v in values if v not in allowed]
            if unknown:
                raise ValueError(f"unknown {column.key} {unknown[0]!r}; one of: {', '.join(allowed)}")
            if column is Run.status and narrower and self.dialect == "sqlite":
                conditions.append((Run.status + "").in_(values))
            else:
                conditions.append(column.in_(values))
        if flt.model:
            conditions.append(Run.model == storable(flt.model))
        if flt.fingerprint:
            conditions.append(Run.fingerprint == storable(flt.fingerprint))
        if flt.config_hash:
            # Every config_hash of a run is a snapshot's hash (foreign key): finding the few full hashes
            # with this prefix among the snapshots lets the (config_hash, created_at) index serve.
            prefix = Run.config_hash.in_(
                select(ConfigSnapshot.hash).where(
                    ConfigSnapshot.hash.startswith(flt.config_hash.lower(), autoescape=True)
                )
            )
            conditions.append(prefix)
        if flt.replay_of:
            conditions.append(Run.replay_of == flt.replay_of)
        if flt.replays is not None:
            conditions.append(Run.replay_of.is_not(None) if flt.replays else Run.replay_of.is_(None))
        if flt.since is not None:
            conditions.append(Run.created_at >= as_datetime(flt.since))
        if flt.until is not None:
            conditions.append(Run.created_at <= as_datetime(flt.until))
        if flt.search:  # last: the substring test is the costliest per row
            conditions.extend(self._search_condition(connection, flt.search))
        return statement.where(*conditions) if conditions else statement

    @staticmethod
    def _cursor_of(run: RunSummary) -> str:
        return f"{run.created_at.isoformat()}|{run.id}"

    @staticmethod
    def _parse_cursor(cursor: str) -> tuple[datetime, str]:
        stamp, sep, run_id = cursor.rpartition("|")
        parsed = as_datetime(datetime.fromisoformat(stamp)) if sep else None
        if parsed is None or not run_id:
            raise ValueError(f"not a history cursor: {cursor!r}")
        return parsed, run_id

    def list_runs(
        self,
        filter: RunFilter | None = None,
        limit: int = 50,
        offset: int = 0,
        after: str | None = None,
    ) -> list[RunSummary]:
        """Runs matching ``filter``, newest first: ``limit`` of them after the cursor ``after`` (see
        :meth:`list_page`) or, for small histories, from ``offset``."""
        columns = (
            Run.id,
            Run.source,
            Run.status,
            Run.created_at,
            Run.started_at,
            Run.finished_at,
            Run.prompt,
            Run.model,
            Run.seed,
            Run.fingerprint,
            Run.config_hash,
            Run.error,
            Run.replay_of,
        )
        with self._read() as session:
            statement = self._filtered(select(*columns), filter, session)
            if after:
                created, run_id = self._parse_cursor(after)
                # Keyset pagination: continue strictly after the last row shown, in the index's order.
                statement = statement.where(tuple_(Run.created_at, Run.id) < tuple_(created, run_id))
            statement = statement.order_by(Run.created_at.desc(), Run.id.desc()).limit(max(0, limit))
            if offset:
                statement = statement.offset(max(0, offset))
            rows = session.execute(statement).all()
            ids = [row.id for row in rows]
            counts: dict[str, int] = {}
            thumbs: dict[str, str] = {}
            if ids:
                images = session.execute(
                    select(Output.run_id, Output.index, Output.sha256).where(
                        Output.run_id.in_(ids), Output.kind == "image"
                    )
                ).all()
                for run_id, index, sha in images:
                    counts[run_id] = counts.get(run_id, 0) + 1
                    if index == 0:
                        thumbs[run_id] = sha
        return [
            RunSummary(
                **row._asdict(), image_count=counts.get(row.id, 0), thumbnail_sha256=thumbs.get(row.id)
            )
            for row in rows
        ]

    def list_page(
        self, filter: RunFilter | None = None, limit: int = 50, cursor: str | None = None
    ) -> RunPage:
        """One page of the history, newest first, and the cursor of the next (``None`` after the last).

        Keyset pagination: each page costs the same however deep it is (OFFSET would read every row
        before it). Runs recorded meanwhile do not shift later pages.
        """
        runs = self.list_runs(filter, limit=limit + 1, after=cursor)
        more = len(runs) > limit
        runs = runs[:limit]
        return RunPage(runs, self._cursor_of(runs[-1]) if more and runs else None)

    def count_runs(self, filter: RunFilter | None = None) -> int:
        """How many runs match ``filter``, exactly (walks every match; the History tab uses
        :meth:`count_matching`)."""
        with self._read() as session:
            return int(session.scalar(self._filtered(select(func.count(Run.id)), filter, session)) or 0)

    def count_matching(self, filter: RunFilter | None = None, cap: int = COUNT_CAP) -> RunCount:
        """How many runs match ``filter``: exact up to ``cap``; beyond it ``RunCount(cap, exact=False)``."""
        with self._read() as session:
            matches = self._filtered(select(Run.id), filter, session).limit(cap + 1).subquery()
            found = int(session.scalar(select(func.count()).select_from(matches)) or 0)
        return RunCount(cap, False) if found > cap else RunCount(found, True)

    def diff_runs(self, a: str, b: str) -> dict[str, dict[str, tuple[Any, Any]]]:
        """What differs between two runs: ``{"run": ..., "parameters": ..., "config": ...}``.

        Each part maps a key to ``(value in a, value in b)``; config keys are flattened
        (``stages.1.default_sampling_params.num_inference_steps``). A key missing on one side shows None.
        """
        run_a, run_b = self.get_run(a), self.get_run(b)
        fields_a = {
            k: getattr(run_a, k)
            for k in ("prompt", "model", "source", "status", "fingerprint", "config_hash")
        }
        fields_b = {k: getattr(run_b, k) for k in fields_a}
        return {
            "run": diff_mappings(fields_a, fields_b),
            "parameters": diff_mappings(run_a.parameters, run_b.parameters),
            "config": diff_mappings(flatten(run_a.config or {}), flatten(run_b.config or {})),
        }

    def output_file(self, sha256: str) -> Path:
        """The path of the stored file with this hash; raises ``FileNotFoundError``."""
        with self._read() as session:
            mime = session.scalar(select(Output.mime).where(Output.sha256 == sha256).limit(1))
        if mime is not None:
            path = self.file_path(sha256, mime)
            if path.exists():
                return path
        found = self.files.find(sha256)
        if found is not None:
            return found
        raise FileNotFoundError(f"no stored output with sha256 {sha256}")

    def runs_with_output(self, sha256: str, kind: str = "image") -> list[str]:
        """Ids of the runs with an output (of ``kind``) whose file has this sha256, newest first.

        Outputs are content-addressed, so a file that came out of the studio unchanged is found here:
        ``omni-studio history show --png`` (studio/recipes/runs.py).
        """
        made = select(Output.run_id).where(Output.sha256 == sha256, Output.kind == kind)
        with self._read() as session:
            query = select(Run.id).where(Run.id.in_(made)).order_by(Run.created_at.desc(), Run.id.desc())
            return list(session.scalars(query))

    # deleting -------------------------------------------------------------------------------------

    def _delete_ids(self, ids: Sequence[str]) -> int:
        deleted = 0
        shas: set[str] = set()
        for start in range(0, len(ids), _IN_CHUNK):
            chunk = ids[start : start + _IN_CHUNK]
            with self._write() as connection:
                shas.update(connection.scalars(select(_outputs.c.sha256).where(_outputs.c.run_id.in_(chunk))))
                # Stages and outputs go with their run (ON DELETE CASCADE).
                deleted += connection.execute(delete(_runs).where(_runs.c.id.in_(chunk))).rowcount or 0
        self._remove_unreferenced(shas)
        return deleted

    def _remove_unreferenced(self, shas: Iterable[str]) -> None:
        shas = list(shas)
        used: set[str] = set()
        with self._read() as session:
            for start in range(0, len(shas), _IN_CHUNK):
                chunk = shas[start : start + _IN_CHUNK]
                used.update(session.scalars(select(Output.sha256).where(Output.sha256.in_(chunk)).distinct()))
        for sha in shas:
            if sha in used:
                continue
            self.files.remove(sha)

    def delete_run(self, run_id: str) -> bool:
        """Delete one run with its stages, outputs and files no other run uses."""
        return self._delete_ids([run_id]) > 0

    def delete_runs_older_than(self, days: float) -> int:
        """Retention: delete finished runs created more than ``days`` ago; returns how many.

        Runs still queued or running are kept whatever their age. Config snapshots are kept: they are
        small, and a live process may be about to reference one it already wrote.
        """
        cutoff = utcnow() - timedelta(days=days)
        with self._read() as session:
            ids = list(
                session.scalars(
                    select(Run.id).where(Run.created_at < cutoff, Run.status.not_in(ACTIVE_STATUSES))
                )
            )
        return self._delete_ids(ids)

    def delete_runs(
        self, filter: RunFilter | None = None, older_than_days: float | None = None, dry_run: bool = False
    ) -> int:
        """Delete the finished runs matching ``filter`` (and created more than ``older_than_days`` ago),
        with their stages, outputs and the files no remaining run uses; returns how many.

        Runs still queued or running are never deleted. ``filter`` None (or empty) with no age matches
        every finished run. ``dry_run``: only count them.
        """
        with self._read() as session:
            statement = self._filtered(select(Run.id), filter, session).where(
                Run.status.not_in(ACTIVE_STATUSES)
            )
            if older_than_days is not None:
                statement = statement.where(Run.created_at < utcnow() - timedelta(days=older_than_days))
            ids = list(session.scalars(statement))
        return len(ids) if dry_run else self._delete_ids(ids)

    def prune_files(self, min_age_seconds: float = 3600.0) -> tuple[int, int]:
        """Remove output files that no run references (left by a crash or an interrupted delete), in the
        data folder or in an object store (``--outputs s3://...``).

        Only files older than ``min_age_seconds`` go: a file is written just before its run's output row
        (possibly by another process), so a new file without a row yet is not an orphan. Returns
        ``(files removed, bytes freed)``.
        """
        candidates = self.files.stored(time.time() - min_age_seconds)
        shas = list(candidates)
        used: set[str] = set()
        with self._read() as session:
            for start in range(0, len(shas), _IN_CHUNK):
                chunk = shas[start : start + _IN_CHUNK]
                used.update(session.scalars(select(Output.sha256).where(Output.sha256.in_(chunk)).distinct()))
        removed = freed = 0
        for sha, size in candidates.items():
            if sha in used:
                continue
            with suppress(OSError):
                self.files.remove(sha)
                removed, freed = removed + 1, freed + size
        return removed, freed

    def database_bytes(self) -> int | None:
        """The size of the database (SQLite file with its WAL; PostgreSQL: the store's tables and indexes)."""
        if self.dialect == "sqlite":
            path = self.engine.url.database
            if not path or path == ":memory:":
                return None
            return sum(
                Path(f"{path}{suffix}").stat().st_size
                for suffix in ("", "-wal")
                if Path(f"{path}{suffix}").exists()
            )
        if self.dialect == "postgresql":
            with self.engine.connect() as connection:
                total = connection.exec_driver_sql(
                    "SELECT sum(pg_total_relation_size(to_regclass(t))) FROM unnest(ARRAY['runs', "
                    "'run_stages', 'outputs', 'config_snapshots']) AS t"
                ).scalar()
            return int(total or 0)
        return None

    def maintain(self, vacuum: bool = False) -> None:
        """Refresh the planner's statistics and tidy the search index; with ``vacuum``, also give the
        space of deleted rows back to the file system (SQLite rewrites the whole file: minutes at a
        million runs, and it needs that much free disk; PostgreSQL's VACUUM FULL locks the tables).

        SQLite: ``ANALYZE`` (PRAGMA optimize) and an FTS ``optimize`` (merges its segments), then
        ``VACUUM``. PostgreSQL: ``VACUUM (ANALYZE)`` of the store's tables, ``VACUUM FULL`` with ``vacuum``.
        """
        if self.dialect == "sqlite":
            with self._write() as connection:
                connection.exec_driver_sql("ANALYZE")
                if self.search_indexed:
                    connection.exec_driver_sql(
                        f"INSERT INTO {search.FTS_TABLE}({search.FTS_TABLE}) VALUES ('optimize')"
                    )
            if vacuum:
                with self._write_lock, self.engine.connect() as connection:
                    driver = connection.connection.driver_connection
                    assert driver is not None
                    driver.execute("VACUUM")  # outside a transaction: on the DBAPI connection itself
            with self.engine.connect() as connection:
                # Fold the write-ahead log back into the file (it grows with a big transaction).
                connection.exec_driver_sql("PRAGMA wal_checkpoint(TRUNCATE)")
                connection.commit()
            return
        if self.dialect == "postgresql":
            with self.engine.connect().execution_options(isolation_level="AUTOCOMMIT") as connection:
                for table in ("runs", "run_stages", "outputs", "config_snapshots"):
                    connection.exec_driver_sql(f"VACUUM ({'FULL, ' if vacuum else ''}ANALYZE) {table}")

    # bulk work for the layers above (bundle import: studio.store.bundle) -----------------------------

    def existing_ids(self, ids: Sequence[str]) -> set[str]:
        """Which of ``ids`` are runs here."""
        found: set[str] = set()
        with self._read() as session:
            for start in range(0, len(ids), 500):
                found.update(session.scalars(select(Run.id).where(Run.id.in_(ids[start : start + 500]))))
        return found

    @contextmanager
    def write_transaction(self) -> Iterator[Connection]:
        """A write transaction for bulk work inside the store package (bundle import)."""
        with self._write() as connection:
            yield connection
