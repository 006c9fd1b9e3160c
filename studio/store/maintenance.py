"""Keeping the run store in shape: runs a dead process left running, deleting runs, pruning files,
the database's size, vacuum and index upkeep."""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Iterable, Sequence
from contextlib import suppress
from datetime import timedelta
from pathlib import Path

from sqlalchemy import ColumnElement, delete, select

from studio.store import search
from studio.store.base import (
    _IN_CHUNK,
    _LIVE_OWNERS,
    INTERRUPTED_ERROR,
    _advisory_key,
    _outputs,
    _process_start_ticks,
    _runs,
)
from studio.store.models import ACTIVE_STATUSES, Output, Run, utcnow
from studio.store.records import RunFilter
from studio.store.writes import RunWrites


class StoreMaintenance(RunWrites):
    """Orphans, deleting and upkeep (see :class:`studio.store.store.RunStore`)."""

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
