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

import logging
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from sqlalchemy import Connection, select
from sqlalchemy.engine import make_url
from sqlalchemy.exc import SQLAlchemyError

from studio.store.errors import StoreError
from studio.store.files import OutputFiles
from studio.store.maintenance import StoreMaintenance
from studio.store.models import Run
from studio.store.schema import create_store_engine, default_url, upgrade_schema

log = logging.getLogger(__name__)


class RunStore(StoreMaintenance):
    """Runs, stages, outputs and config snapshots in a SQL database plus content-addressed files.

    Open with :func:`open_store`. Thread-safe.
    """

    # opening ---------------------------------------------------------------------------------------

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
