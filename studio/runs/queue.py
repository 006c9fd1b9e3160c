"""The Queue panel's model: everything queued or running in this studio, and who may change what.

Rows come from two places: the job queue (``studio/jobs/service.py``: queued and running jobs, in queue order)
and the requests in the engine (``studio/runs/inflight.py``: single requests from the UI, the API and the
CLI, and the cells of running jobs), each with its source, owner, place and progress. A viewer may
cancel what they own, and move their jobs up or down; the admin login (``--auth``, or the login
``--share`` generates) may do so for everything (docs/jobs.md, "The Queue panel"). In a studio with
accounts (docs/team.md) a user's requests and jobs are ``user:NAME``'s wherever they came from (the UI, their
API keys), a user sees only their own rows, and an admin account sees and manages all. The UI tab
(``studio/ui/queue.py``) only renders this.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from studio.accounts.identity import Identity
from studio.jobs.service import JobFinished, JobNotFound, JobService
from studio.runs.inflight import InFlight, RequestBoard
from studio.store.models import ACTIVE_JOB_STATUSES

if TYPE_CHECKING:
    from studio.store.jobs import JobRecord

COLUMNS = ["kind", "id", "source", "owner", "status", "position", "progress", "output", "what"]


class QueueError(Exception):
    """An action the viewer may not take, or on something that is not (or no longer) in the queue."""


@dataclass(frozen=True)
class Viewer:
    """Who looks at the queue: the owner names that are theirs, and whether they are the admin."""

    owners: frozenset[str]
    admin: bool = False
    sees_all: bool = True  # False: a user of a studio with accounts, who sees only their own rows

    @classmethod
    def of_ui(
        cls,
        session: str | None,
        username: str | None,
        admin_user: str | None,
        identity: Identity | None = None,
    ) -> Viewer:
        """A UI visitor: their browser session, and their login when there is one (``identity``: who that
        login is in a studio with accounts)."""
        owners = {f"ui-session:{session}"} if session else set()
        if identity is not None and identity.accounts:
            if identity.owner:
                owners.add(identity.owner)
            return cls(frozenset(owners), admin=identity.admin, sees_all=identity.admin)
        if username:
            owners.add(f"ui:{username}")
        return cls(frozenset(owners), admin=bool(username) and username == admin_user)

    @property
    def job_owner(self) -> str | None:
        """The owner name a job this viewer submits gets (their account, login, else their session)."""
        logins = sorted(o for o in self.owners if o.startswith(("ui:", "user:")))
        sessions = sorted(o for o in self.owners if o.startswith("ui-session:"))
        found = logins or sessions
        return found[0] if found else None

    def may_change(self, owner: str | None) -> bool:
        return self.admin or (owner is not None and owner in self.owners)

    def sees(self, owner: str | None) -> bool:
        """Whether this viewer sees a row (a job, a request) of ``owner``."""
        return self.sees_all or (owner is not None and owner in self.owners)


def owner_label(owner: str | None) -> str:
    """A short, readable owner: ``UI session 3f2a9c``, ``API 127.0.0.1``, ``CLI me@host``, a login."""
    if not owner:
        return "-"
    kind, _, who = owner.partition(":")
    if kind == "ui-session":
        return f"UI session {who[:6]}"
    if kind in ("ui", "user"):
        return who
    if kind == "api":
        address, _, key = who.partition("|")
        return f"API {address}" + (f" (key {key[:4]})" if key and key != "-" else "")
    if kind == "cli":
        return f"CLI {who}"
    return owner


@dataclass(frozen=True)
class QueueRow:
    """One line of the panel."""

    kind: str  # job | request
    id: str
    source: str
    owner: str | None
    status: str
    position: str
    progress: str
    what: str
    yours: bool
    output: str = ""  # what it makes: "image 64x64", "audio · voices Chelsie, Ethan"

    def cells(self) -> list[str]:
        owner = owner_label(self.owner) + (" (you)" if self.yours else "")
        return [
            self.kind,
            self.id[:12],
            self.source,
            owner,
            self.status,
            self.position,
            self.progress,
            self.output,
            self.what,
        ]


def _job_progress(job: JobRecord, running: int) -> str:
    text = f"{job.done}/{job.total} cells"
    if running:
        text += f" · {running} running"
    if job.failed:
        text += f" · {job.failed} failed"
    return text


class QueueView:
    """What is queued and running in this process, for one viewer; cancel and move on their behalf."""

    def __init__(self, board: RequestBoard, jobs: JobService | None) -> None:
        self.board = board
        self.jobs = jobs

    def rows(self, viewer: Viewer) -> list[QueueRow]:
        rows: list[QueueRow] = []
        if self.jobs is not None:
            positions = self.jobs.positions()
            for job in self.jobs.list_jobs(ACTIVE_JOB_STATUSES, limit=200):
                if not viewer.sees(job.owner):
                    continue
                rows.append(
                    QueueRow(
                        "job",
                        job.id,
                        job.source,
                        job.owner,
                        job.status,
                        f"#{positions.get(job.id, '?')}",
                        _job_progress(job, self.jobs.running_cells(job.id)),
                        job.label,
                        viewer.may_change(job.owner),
                        self.jobs.output_of(job),
                    )
                )
        for entry in self.board.snapshot():
            if viewer.sees(entry.owner):
                rows.append(self._request_row(entry, viewer))
        return rows

    def _request_row(self, entry: InFlight, viewer: Viewer) -> QueueRow:
        ahead = entry.engine.position(entry.request_id) if entry.engine is not None else None
        status = "waiting" if ahead is not None else "running"
        position = (f"{ahead} ahead" if ahead else "next") if ahead is not None else "in the engine"
        what = entry.prompt if len(entry.prompt) <= 60 else entry.prompt[:57] + "..."
        cell = self.jobs.job_of_run(entry.request_id) if self.jobs is not None else None
        if cell is not None:
            what = f"job {cell[0][:8]} cell {cell[1]}: {what}"
        return QueueRow(
            "request",
            entry.request_id,
            entry.source,
            entry.owner,
            status,
            position,
            entry.progress(),
            what,
            viewer.may_change(entry.owner),
            entry.output,
        )

    def _find(self, viewer: Viewer, ident: str) -> QueueRow:
        ident = (ident or "").strip().lower()
        if not ident:
            raise QueueError("Pick a row first (click it), or paste its id.")
        matches = [row for row in self.rows(viewer) if row.id.startswith(ident)]
        if not matches:
            raise QueueError(
                f"Nothing with id {ident[:12]} is queued or running (it may have just finished)."
            )
        if len(matches) > 1:
            raise QueueError(f"{ident} matches several rows; give more of the id.")
        return matches[0]

    def cancel(self, viewer: Viewer, ident: str) -> str:
        """Cancel a job or a request the viewer owns (the admin: anything); returns what happened."""
        row = self._find(viewer, ident)
        if not viewer.may_change(row.owner):
            raise QueueError(
                f"This {row.kind} belongs to {owner_label(row.owner)}: only its owner or the admin login can "
                "cancel it."
            )
        if row.kind == "job":
            assert self.jobs is not None
            try:
                job = self.jobs.cancel(row.id)
            except (JobFinished, JobNotFound) as exc:
                raise QueueError(str(exc)) from exc
            return f"Cancelled job {job.label} ({job.done}/{job.total} cells had run)."
        entry = self.board.get(row.id)
        if entry is None or not entry.engine.cancel(row.id):
            raise QueueError(f"Request {row.id[:12]} has just finished.")
        return f"Cancelled request {row.id[:12]} (recorded as cancelled)."

    def move(self, viewer: Viewer, ident: str, steps: int) -> str:
        """Move the viewer's job ``steps`` places (negative: earlier) in the job queue."""
        row = self._find(viewer, ident)
        if row.kind != "job":
            raise QueueError("Only jobs can be moved; single requests run in the order they came.")
        if not viewer.may_change(row.owner):
            raise QueueError(
                f"This job belongs to {owner_label(row.owner)}: only its owner or the admin login can move it."
            )
        assert self.jobs is not None
        try:
            moved = self.jobs.move(row.id, steps)
        except (JobFinished, JobNotFound) as exc:
            raise QueueError(str(exc)) from exc
        if not moved:
            return f"Job {row.what} is already {'first' if steps < 0 else 'last'}."
        place = self.jobs.positions().get(row.id)
        return f"Job {row.what} is now #{place} in the queue."
