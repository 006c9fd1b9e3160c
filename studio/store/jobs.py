"""Batch jobs in the run store: the persistent queue the job runner (``studio/jobs/runner.py``) works through.

A job row holds the normalized spec, its status and progress counters, its place in the queue and, once
done, its grid; an item row per cell holds the cell's axes values, the id of the run that makes it and
that run's outcome. The runner writes an item's ``run_id`` *before* the run starts: after a crash the next
studio reads which run each unfinished cell was on and re-runs only those whose runs did not succeed
(docs/jobs.md, "Restart"). Every method is one short transaction on the :class:`RunStore`'s database
(SQLite or PostgreSQL) and thread-safe.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import Connection, func, select

from studio.store.models import (
    ACTIVE_JOB_STATUSES,
    JOB_SOURCES,
    JOB_STATUSES,
    Job,
    JobItem,
    table_of,
    utcnow,
)
from studio.store.records import iso, jsonable
from studio.store.store import RunStore

_jobs, _items = table_of(Job), table_of(JobItem)
ITEM_STATUSES = ("queued", "running", "succeeded", "failed", "cancelled")
FINISHED_ITEM_STATUSES = ("succeeded", "failed", "cancelled")


class JobNotFound(LookupError):
    """No job has this id."""


@dataclass(frozen=True)
class JobItemRecord:
    """One cell of a job."""

    index: int
    axes: dict[str, Any]
    status: str
    run_id: str | None
    attempts: int
    error: str | None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class JobRecord:
    """A job as the store holds it (``items`` only when asked for)."""

    id: str
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    status: str
    source: str
    owner: str | None
    name: str | None
    spec: dict[str, Any]
    total: int
    succeeded: int
    failed: int
    cancelled: int
    position: int
    worker: str | None
    grid_sha256: str | None
    grid_run_id: str | None
    error: str | None
    items: tuple[JobItemRecord, ...] = ()

    @property
    def done(self) -> int:
        """Cells with an outcome (succeeded, failed or cancelled)."""
        return self.succeeded + self.failed + self.cancelled

    @property
    def active(self) -> bool:
        return self.status in ACTIVE_JOB_STATUSES

    @property
    def label(self) -> str:
        return self.name or f"job {self.id[:8]}"

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data.update(
            created_at=iso(self.created_at),
            started_at=iso(self.started_at),
            finished_at=iso(self.finished_at),
            items=[item.to_dict() for item in self.items],
        )
        return data


def _job(row: Any, items: Sequence[JobItemRecord] = ()) -> JobRecord:
    return JobRecord(
        id=row.id,
        created_at=row.created_at,
        started_at=row.started_at,
        finished_at=row.finished_at,
        status=row.status,
        source=row.source,
        owner=row.owner,
        name=row.name,
        spec=dict(row.spec or {}),
        total=row.total,
        succeeded=row.succeeded,
        failed=row.failed,
        cancelled=row.cancelled,
        position=row.position,
        worker=row.worker,
        grid_sha256=row.grid_sha256,
        grid_run_id=row.grid_run_id,
        error=row.error,
        items=tuple(items),
    )


def _item(row: Any) -> JobItemRecord:
    return JobItemRecord(
        index=row.index,
        axes=dict(row.axes or {}),
        status=row.status,
        run_id=row.run_id,
        attempts=row.attempts,
        error=row.error,
    )


class JobStore:
    """Jobs and their items in a :class:`RunStore`'s database."""

    def __init__(self, store: RunStore) -> None:
        self.store = store

    # reading --------------------------------------------------------------------------------------

    def _read(self) -> Any:
        return self.store.engine.connect()

    def get_job(self, job_id: str, items: bool = False) -> JobRecord:
        """One job (with its items when ``items``); raises :class:`JobNotFound`."""
        with self._read() as connection:
            row = connection.execute(select(_jobs).where(_jobs.c.id == job_id)).first()
            if row is None:
                raise JobNotFound(f"no job with id {job_id!r}")
            found = self._items_of(connection, job_id) if items else ()
            connection.commit()
        return _job(row, found)

    def items(self, job_id: str) -> list[JobItemRecord]:
        """The job's cells in index order."""
        with self._read() as connection:
            found = self._items_of(connection, job_id)
            connection.commit()
        return found

    @staticmethod
    def _items_of(connection: Connection, job_id: str) -> list[JobItemRecord]:
        rows = connection.execute(select(_items).where(_items.c.job_id == job_id).order_by(_items.c.index))
        return [_item(row) for row in rows]

    def list_jobs(
        self, statuses: Iterable[str] | None = None, limit: int = 50, worker: str | None = None
    ) -> list[JobRecord]:
        """Jobs with one of ``statuses`` (all when None): active ones in queue order, others newest first."""
        wanted = tuple(statuses) if statuses is not None else None
        for status in wanted or ():
            if status not in JOB_STATUSES:
                raise ValueError(f"unknown job status {status!r}; one of {', '.join(JOB_STATUSES)}")
        statement = select(_jobs)
        if wanted is not None:
            statement = statement.where(_jobs.c.status.in_(wanted))
        if worker is not None:
            statement = statement.where(_jobs.c.worker == worker)
        if wanted is not None and set(wanted) <= set(ACTIVE_JOB_STATUSES):
            statement = statement.order_by(_jobs.c.position, _jobs.c.created_at)
        else:
            statement = statement.order_by(_jobs.c.created_at.desc(), _jobs.c.id.desc())
        with self._read() as connection:
            rows = connection.execute(statement.limit(limit)).all()
            connection.commit()
        return [_job(row) for row in rows]

    def queue_positions(self) -> dict[str, int]:
        """Job id -> place in the queue (1: runs first) of every queued or running job."""
        with self._read() as connection:
            ids = connection.scalars(
                select(_jobs.c.id)
                .where(_jobs.c.status.in_(ACTIVE_JOB_STATUSES))
                .order_by(_jobs.c.position, _jobs.c.created_at)
            ).all()
            connection.commit()
        return {job_id: place for place, job_id in enumerate(ids, start=1)}

    # writing --------------------------------------------------------------------------------------

    def create_job(
        self,
        *,
        spec: Mapping[str, Any],
        items: Sequence[Mapping[str, Any]],
        source: str,
        owner: str | None,
        name: str | None = None,
        worker: str | None = None,
        job_id: str | None = None,
    ) -> JobRecord:
        """A new queued job at the end of the queue, with one queued item per entry of ``items`` (axes)."""
        if source not in JOB_SOURCES:
            raise ValueError(f"source must be one of {', '.join(JOB_SOURCES)}, got {source!r}")
        job_id = job_id or uuid.uuid4().hex
        with self.store.write_transaction() as connection:
            last = connection.scalar(select(func.max(_jobs.c.position)))
            connection.execute(
                _jobs.insert(),
                {
                    "id": job_id,
                    "created_at": utcnow(),
                    "status": "queued",
                    "source": source,
                    "owner": owner,
                    "name": name,
                    "spec": jsonable(dict(spec)),
                    "total": len(items),
                    "succeeded": 0,
                    "failed": 0,
                    "cancelled": 0,
                    "position": int(last or 0) + 1,
                    "worker": worker,
                },
            )
            if items:
                connection.execute(
                    _items.insert(),
                    [
                        {
                            "job_id": job_id,
                            "index": index,
                            "axes": jsonable(dict(axes)),
                            "status": "queued",
                            "attempts": 0,
                        }
                        for index, axes in enumerate(items)
                    ],
                )
        return self.get_job(job_id)

    def claim_orphans(self, worker: str, alive: Callable[[str | None], bool]) -> list[str]:
        """Take over the queued and running jobs whose worker process is gone; returns their ids."""
        with self._read() as connection:
            rows = connection.execute(
                select(_jobs.c.id, _jobs.c.worker).where(_jobs.c.status.in_(ACTIVE_JOB_STATUSES))
            ).all()
            connection.commit()
        return [
            row.id
            for row in rows
            if row.worker != worker and not alive(row.worker) and self._take(row.id, row.worker, worker)
        ]

    def claim(self, job_id: str, worker: str, alive: Callable[[str | None], bool]) -> bool:
        """Take over one queued or running job unless its worker process still runs it (``omni-studio
        batch --resume``); raises :class:`JobNotFound`."""
        job = self.get_job(job_id)
        if not job.active:
            return False
        if job.worker == worker:
            return True
        return not alive(job.worker) and self._take(job_id, job.worker, worker)

    def _take(self, job_id: str, previous: str | None, worker: str) -> bool:
        with self.store.write_transaction() as connection:
            condition = _jobs.c.worker.is_(None) if previous is None else _jobs.c.worker == previous
            result = connection.execute(
                _jobs.update()
                .where(_jobs.c.id == job_id, condition, _jobs.c.status.in_(ACTIVE_JOB_STATUSES))
                .values(worker=worker)
            )
        return bool(result.rowcount)  # another process may have taken it first

    def mark_running(self, job_id: str) -> bool:
        """queued -> running (its first cell is about to run)."""
        with self.store.write_transaction() as connection:
            result = connection.execute(
                _jobs.update()
                .where(_jobs.c.id == job_id, _jobs.c.status == "queued")
                .values(status="running", started_at=utcnow())
            )
        return bool(result.rowcount)

    def start_item(self, job_id: str, index: int, run_id: str) -> None:
        """The cell is about to run as ``run_id``: written (and committed) before the run starts."""
        with self.store.write_transaction() as connection:
            connection.execute(
                _items.update()
                .where(_items.c.job_id == job_id, _items.c.index == index)
                .values(status="running", run_id=run_id, attempts=_items.c.attempts + 1, error=None)
            )

    def finish_item(
        self, job_id: str, index: int, status: str, error: str | None = None, run_id: str | None = None
    ) -> None:
        """Record a cell's outcome (and the run that had it, when it is another than the started one)."""
        if status not in ITEM_STATUSES:
            raise ValueError(f"an item's status is one of {', '.join(ITEM_STATUSES)}, not {status!r}")
        values: dict[str, Any] = {"status": status, "error": error}
        if run_id is not None:
            values["run_id"] = run_id
        with self.store.write_transaction() as connection:
            connection.execute(
                _items.update().where(_items.c.job_id == job_id, _items.c.index == index).values(**values)
            )
            self._count(connection, job_id)

    @staticmethod
    def _count(connection: Connection, job_id: str) -> None:
        counts: dict[str, int] = dict(
            connection.execute(
                select(_items.c.status, func.count())
                .where(_items.c.job_id == job_id)
                .group_by(_items.c.status)
            ).all()
        )
        connection.execute(
            _jobs.update()
            .where(_jobs.c.id == job_id)
            .values(
                succeeded=counts.get("succeeded", 0),
                failed=counts.get("failed", 0),
                cancelled=counts.get("cancelled", 0),
            )
        )

    def finish_job(
        self,
        job_id: str,
        status: str,
        error: str | None = None,
        grid_sha256: str | None = None,
        grid_run_id: str | None = None,
    ) -> bool:
        """Record a job's outcome (the first one wins: False when it had finished already)."""
        if status not in JOB_STATUSES or status in ACTIVE_JOB_STATUSES:
            raise ValueError(f"a job finishes as succeeded, failed or cancelled, not {status!r}")
        with self.store.write_transaction() as connection:
            result = connection.execute(
                _jobs.update()
                .where(_jobs.c.id == job_id, _jobs.c.status.in_(ACTIVE_JOB_STATUSES))
                .values(
                    status=status,
                    error=error,
                    finished_at=utcnow(),
                    grid_sha256=grid_sha256,
                    grid_run_id=grid_run_id,
                )
            )
        return bool(result.rowcount)

    def cancel_job(self, job_id: str) -> bool:
        """Cancel a queued or running job: it and its cells that have not run are ``cancelled``.

        Cells running now are stopped by the runner (their runs are recorded cancelled). False when the job
        had already finished; raises :class:`JobNotFound`.
        """
        with self.store.write_transaction() as connection:
            if connection.scalar(select(_jobs.c.id).where(_jobs.c.id == job_id)) is None:
                raise JobNotFound(f"no job with id {job_id!r}")
            result = connection.execute(
                _jobs.update()
                .where(_jobs.c.id == job_id, _jobs.c.status.in_(ACTIVE_JOB_STATUSES))
                .values(status="cancelled", finished_at=utcnow(), error="cancelled")
            )
            if not result.rowcount:
                return False
            connection.execute(
                _items.update()
                .where(_items.c.job_id == job_id, _items.c.status == "queued")
                .values(status="cancelled")
            )
            self._count(connection, job_id)
        return True

    def move_job(self, job_id: str, steps: int) -> bool:
        """Move a queued or running job ``steps`` places (negative: towards the front) in the queue by
        swapping positions with its neighbours; False when it cannot move that way."""
        if steps == 0:
            return False
        with self.store.write_transaction() as connection:
            rows = connection.execute(
                select(_jobs.c.id, _jobs.c.position)
                .where(_jobs.c.status.in_(ACTIVE_JOB_STATUSES))
                .order_by(_jobs.c.position, _jobs.c.created_at)
            ).all()
            order = [row.id for row in rows]
            if job_id not in order:
                if connection.scalar(select(_jobs.c.id).where(_jobs.c.id == job_id)) is None:
                    raise JobNotFound(f"no job with id {job_id!r}")
                return False
            at = order.index(job_id)
            target = max(0, min(len(order) - 1, at + steps))
            if target == at:
                return False
            order.insert(target, order.pop(at))
            # Renumber the active jobs in their new order over the positions they held, made strictly
            # increasing (two processes may have given jobs the same one); new jobs still go last.
            slots = sorted(row.position for row in rows)
            for place in range(1, len(slots)):
                slots[place] = max(slots[place], slots[place - 1] + 1)
            held = {row.id: row.position for row in rows}
            for place, moved in enumerate(order):
                if held[moved] != slots[place]:
                    connection.execute(
                        _jobs.update().where(_jobs.c.id == moved).values(position=slots[place])
                    )
        return True

    def requeue_item(self, job_id: str, index: int) -> None:
        """Put a cell back in the queue (its run was cut off by a stop or a crash: it runs again)."""
        with self.store.write_transaction() as connection:
            connection.execute(
                _items.update()
                .where(_items.c.job_id == job_id, _items.c.index == index)
                .values(status="queued")
            )
