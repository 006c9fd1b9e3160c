"""Batch jobs: ``jobs`` (one row per job: spec, status, progress, queue position, grid) and ``job_items``
(one row per cell: its axes values and the run that made it).

A job is prompts x seeds x up to two parameter axes (docs/jobs.md). Its cells run through the engine
like any request and are recorded as runs (source ``job``); an item's ``run_id`` is written before its
run starts, so a studio that restarts after a crash knows which runs to look at and re-runs only the cells
whose runs never finished. ``(job_id, index)`` is unique: a cell exists once.

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-04
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "jobs",
        sa.Column("id", sa.String(32), primary_key=True),
        sa.Column("created_at", sa.DateTime(), nullable=False),
        sa.Column("started_at", sa.DateTime(), nullable=True),
        sa.Column("finished_at", sa.DateTime(), nullable=True),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("source", sa.String(8), nullable=False),
        sa.Column("owner", sa.String(200), nullable=True),
        sa.Column("name", sa.String(255), nullable=True),
        sa.Column("spec", sa.JSON(), nullable=False),
        sa.Column("total", sa.Integer(), nullable=False),
        sa.Column("succeeded", sa.Integer(), nullable=False),
        sa.Column("failed", sa.Integer(), nullable=False),
        sa.Column("cancelled", sa.Integer(), nullable=False),
        sa.Column("position", sa.BigInteger(), nullable=False),
        sa.Column("worker", sa.String(160), nullable=True),
        sa.Column("grid_sha256", sa.String(64), nullable=True),
        sa.Column("grid_run_id", sa.String(32), nullable=True),
        sa.Column("error", sa.Text(), nullable=True),
    )
    op.create_index("ix_jobs_status_position", "jobs", ["status", "position"])
    op.create_index("ix_jobs_owner", "jobs", ["owner"])
    op.create_index("ix_jobs_worker", "jobs", ["worker"])
    op.create_table(
        "job_items",
        sa.Column("id", sa.Integer(), primary_key=True, autoincrement=True),
        sa.Column("job_id", sa.String(32), sa.ForeignKey("jobs.id", ondelete="CASCADE"), nullable=False),
        sa.Column("index", sa.Integer(), nullable=False),
        sa.Column("axes", sa.JSON(), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("run_id", sa.String(32), nullable=True),
        sa.Column("attempts", sa.Integer(), nullable=False),
        sa.Column("error", sa.Text(), nullable=True),
        sa.UniqueConstraint("job_id", "index", name="uq_job_items_job_index"),
    )
    op.create_index("ix_job_items_job_id", "job_items", ["job_id"])
    op.create_index("ix_job_items_run_id", "job_items", ["run_id"])


def downgrade() -> None:
    op.drop_index("ix_job_items_run_id", table_name="job_items")
    op.drop_index("ix_job_items_job_id", table_name="job_items")
    op.drop_table("job_items")
    op.drop_index("ix_jobs_worker", table_name="jobs")
    op.drop_index("ix_jobs_owner", table_name="jobs")
    op.drop_index("ix_jobs_status_position", table_name="jobs")
    op.drop_table("jobs")
