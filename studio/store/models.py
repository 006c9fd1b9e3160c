"""SQLAlchemy models of the run store: runs, their per-stage rows and outputs, pipeline-config snapshots.

The schema itself is created and evolved by the Alembic migrations in ``migrations/versions``; these
models must match the head revision (a test compares them).
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    String,
    Table,
    Text,
    UniqueConstraint,
)
from sqlalchemy.engine import Dialect
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, relationship
from sqlalchemy.types import TypeDecorator

RUN_SOURCES = ("ui", "api", "cli", "job")  # job: a cell of a batch job, or its grid (studio/jobs/service.py)
RUN_STATUSES = ("queued", "running", "succeeded", "failed", "cancelled", "interrupted")
ACTIVE_STATUSES = ("queued", "running")  # a run in one of these has a live process recording it
# source: the input image of an image-to-image run; audio: a spoken reply (WAV, docs/speech.md)
OUTPUT_KINDS = ("image", "text", "source", "audio")
JOB_SOURCES = ("ui", "api", "cli")  # where a batch job was submitted
JOB_STATUSES = ("queued", "running", "succeeded", "failed", "cancelled")
ACTIVE_JOB_STATUSES = ("queued", "running")


class UTCDateTime(TypeDecorator[datetime]):
    """Timestamps stored as naive UTC and returned timezone-aware.

    SQLite has no timezone-aware type and would hand back naive values; storing UTC everywhere keeps
    SQLite and PostgreSQL rows comparable (and bundles portable between them).
    """

    impl = DateTime
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is not None:
            value = value.astimezone(UTC).replace(tzinfo=None)
        return value

    def process_result_value(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        return None if value is None else value.replace(tzinfo=UTC)


def utcnow() -> datetime:
    return datetime.now(UTC)


class Base(DeclarativeBase):
    type_annotation_map = {datetime: UTCDateTime(), dict[str, Any]: JSON()}


class ConfigSnapshot(Base):
    """A resolved pipeline config (``PipelineConfig.to_dict()``), stored once per hash."""

    __tablename__ = "config_snapshots"

    hash: Mapped[str] = mapped_column(String(64), primary_key=True)
    body: Mapped[dict[str, Any]]
    family: Mapped[str] = mapped_column(String(64))
    model_name: Mapped[str] = mapped_column(String(255))
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class Run(Base):
    """One request from the UI, the API or the CLI, whatever its outcome."""

    __tablename__ = "runs"
    # The History list reads newest first, optionally narrowed by one of these columns; each index
    # gives the rows in that order (no sort) and continues from a keyset cursor (created_at, id).
    __table_args__ = (
        Index("ix_runs_created_at_id", "created_at", "id"),
        *(
            Index(f"ix_runs_{column}_created", column, "created_at", "id")
            for column in ("status", "model", "source", "fingerprint", "config_hash", "user_name")
        ),
    )

    id: Mapped[str] = mapped_column(String(32), primary_key=True)  # uuid4 hex, chosen by the caller
    source: Mapped[str] = mapped_column(String(8))
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    started_at: Mapped[datetime | None]
    finished_at: Mapped[datetime | None]
    status: Mapped[str] = mapped_column(String(16))
    prompt: Mapped[str] = mapped_column(Text)
    model: Mapped[str] = mapped_column(String(255))
    request: Mapped[dict[str, Any]]
    parameters: Mapped[dict[str, Any]]
    seed: Mapped[int | None] = mapped_column(BigInteger)
    config_hash: Mapped[str | None] = mapped_column(ForeignKey("config_snapshots.hash"))
    fingerprint: Mapped[str | None] = mapped_column(String(255))
    error: Mapped[str | None] = mapped_column(Text)
    text: Mapped[str | None] = mapped_column(Text)
    input_tokens: Mapped[int | None]
    output_tokens: Mapped[int | None]
    # The store instance (host, pid, start time, token) recording the run: a queued/running run whose
    # owner is gone was cut off by a crash and is marked interrupted; one whose owner lives is left alone.
    owner: Mapped[str | None] = mapped_column(String(160), index=True)
    # The run this one replays (``omni-studio replay``, History's replay action); NULL for a fresh run.
    replay_of: Mapped[str | None] = mapped_column(String(32), index=True)
    # Runs that speak (docs/speech.md "Runs, files and the CLI"); NULL for runs without audio.
    ttfp_seconds: Mapped[float | None] = mapped_column(Float)  # submitted -> first audio the caller got
    audio_seconds: Mapped[float | None] = mapped_column(Float)  # audio made, every variant
    realtime_factor: Mapped[float | None] = mapped_column(Float)  # generation seconds / audio seconds
    # The account the run belongs to (docs/team.md); NULL in a studio without accounts, and for the admin's
    # --api-key and the local CLI.
    user_name: Mapped[str | None] = mapped_column(String(64))

    stages: Mapped[list[RunStage]] = relationship(
        back_populates="run",
        cascade="all, delete-orphan",
        passive_deletes=True,
        order_by="(RunStage.variant_index, RunStage.stage_id)",
    )
    outputs: Mapped[list[Output]] = relationship(
        back_populates="run",
        cascade="all, delete-orphan",
        passive_deletes=True,
        order_by="(Output.kind, Output.index)",
    )
    config: Mapped[ConfigSnapshot | None] = relationship()


class RunStage(Base):
    """One stage of one of a run's ``n`` variants: timings, token counts, status."""

    __tablename__ = "run_stages"
    __table_args__ = (
        UniqueConstraint("run_id", "variant_index", "stage_id", name="uq_run_stages_variant_stage"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    run_id: Mapped[str] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), index=True)
    variant_index: Mapped[int] = mapped_column(default=0)
    stage_id: Mapped[int]
    kind: Mapped[str] = mapped_column(String(16))
    status: Mapped[str] = mapped_column(String(16))
    started_at: Mapped[datetime | None]
    finished_at: Mapped[datetime | None]
    queue_seconds: Mapped[float] = mapped_column(Float, default=0.0)
    input_tokens: Mapped[int] = mapped_column(default=0)
    output_tokens: Mapped[int] = mapped_column(default=0)
    batch_size: Mapped[int] = mapped_column(default=1)

    run: Mapped[Run] = relationship(back_populates="stages")


class Output(Base):
    """A file a run produced (or took as input), stored once per content hash under ``outputs/``."""

    __tablename__ = "outputs"
    __table_args__ = (
        UniqueConstraint("run_id", "kind", "index", name="uq_outputs_run_kind_index"),
        Index("ix_outputs_sha256", "sha256"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    run_id: Mapped[str] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), index=True)
    index: Mapped[int]  # position among the run's outputs of this kind (image 0, 1, ...; text 0, 1, ...)
    kind: Mapped[str] = mapped_column(String(16))
    sha256: Mapped[str] = mapped_column(String(64))
    mime: Mapped[str] = mapped_column(String(64))
    width: Mapped[int | None]
    height: Mapped[int | None]
    size_bytes: Mapped[int] = mapped_column(BigInteger)
    duration_seconds: Mapped[float | None] = mapped_column(Float)  # audio outputs only
    sample_rate: Mapped[int | None]  # audio outputs only (Hz)

    run: Mapped[Run] = relationship(back_populates="outputs")


class Job(Base):
    """A batch job: prompts x seeds x up to two parameter axes, run cell by cell (``studio/jobs/runner.py``).

    ``spec`` is the normalized job (seeds and model pinned at submission, so a resumed job runs what was
    asked); ``position`` orders the queue (lower runs first; the Queue panel swaps it to move a job);
    ``worker`` is the store instance (``runs.owner`` format) whose process runs the job, so a job whose
    process died is taken over by the next studio that starts.
    """

    __tablename__ = "jobs"
    __table_args__ = (Index("ix_jobs_status_position", "status", "position"),)

    id: Mapped[str] = mapped_column(String(32), primary_key=True)  # uuid4 hex
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    started_at: Mapped[datetime | None]
    finished_at: Mapped[datetime | None]
    status: Mapped[str] = mapped_column(String(16))
    source: Mapped[str] = mapped_column(String(8))
    owner: Mapped[str | None] = mapped_column(String(200), index=True)  # who submitted it (may cancel it)
    name: Mapped[str | None] = mapped_column(String(255))
    spec: Mapped[dict[str, Any]]
    total: Mapped[int] = mapped_column(default=0)  # cells
    succeeded: Mapped[int] = mapped_column(default=0)
    failed: Mapped[int] = mapped_column(default=0)
    cancelled: Mapped[int] = mapped_column(default=0)
    position: Mapped[int] = mapped_column(BigInteger, default=0)
    worker: Mapped[str | None] = mapped_column(String(160), index=True)
    grid_sha256: Mapped[str | None] = mapped_column(String(64))
    grid_run_id: Mapped[str | None] = mapped_column(String(32))
    error: Mapped[str | None] = mapped_column(Text)

    items: Mapped[list[JobItem]] = relationship(
        back_populates="job", cascade="all, delete-orphan", passive_deletes=True, order_by="JobItem.index"
    )


class JobItem(Base):
    """One cell of a job: its axes values and the run that made it (written before the run starts)."""

    __tablename__ = "job_items"
    __table_args__ = (UniqueConstraint("job_id", "index", name="uq_job_items_job_index"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), index=True)
    index: Mapped[int]
    axes: Mapped[dict[str, Any]]
    status: Mapped[str] = mapped_column(String(16))
    run_id: Mapped[str | None] = mapped_column(String(32), index=True)  # no FK: the run is written later
    attempts: Mapped[int] = mapped_column(default=0)
    error: Mapped[str | None] = mapped_column(Text)

    job: Mapped[Job] = relationship(back_populates="items")


class User(Base):
    """A team account (docs/team.md): its name, its password's argon2id hash, whether it is an admin."""

    __tablename__ = "users"
    __table_args__ = (UniqueConstraint("name", name="uq_users_name"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    name: Mapped[str] = mapped_column(String(64))
    password_hash: Mapped[str] = mapped_column(String(255))  # argon2id, never the password
    admin: Mapped[bool] = mapped_column(Boolean, default=False)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class ApiKey(Base):
    """One API key of a user: its short visible id, the sha256 of its secret (never the key), a label."""

    __tablename__ = "api_keys"

    id: Mapped[str] = mapped_column(String(16), primary_key=True)  # shown in lists; part of the key itself
    user_id: Mapped[int] = mapped_column(ForeignKey("users.id", ondelete="CASCADE"), index=True)
    name: Mapped[str | None] = mapped_column(String(100))
    secret_sha256: Mapped[str] = mapped_column(String(64))
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    revoked_at: Mapped[datetime | None]


def table_of(model: type[Base]) -> Table:
    """The Core table of a mapped class (the stubs type ``__table__`` as a generic ``FromClause``)."""
    table = model.__table__
    if not isinstance(table, Table):
        raise TypeError(f"{model.__name__} is not mapped to a table")
    return table
