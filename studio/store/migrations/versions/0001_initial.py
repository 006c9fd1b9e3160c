"""Runs, per-stage rows, outputs and pipeline-config snapshots.

Revision ID: 0001
Revises:
Create Date: 2025-12-02
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "config_snapshots",
        sa.Column("hash", sa.String(64), primary_key=True),
        sa.Column("body", sa.JSON(), nullable=False),
        sa.Column("family", sa.String(64), nullable=False),
        sa.Column("model_name", sa.String(255), nullable=False),
        sa.Column("created_at", sa.DateTime(), nullable=False),
    )
    op.create_table(
        "runs",
        sa.Column("id", sa.String(32), primary_key=True),
        sa.Column("source", sa.String(8), nullable=False),
        sa.Column("created_at", sa.DateTime(), nullable=False),
        sa.Column("started_at", sa.DateTime(), nullable=True),
        sa.Column("finished_at", sa.DateTime(), nullable=True),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("prompt", sa.Text(), nullable=False),
        sa.Column("model", sa.String(255), nullable=False),
        sa.Column("request", sa.JSON(), nullable=False),
        sa.Column("parameters", sa.JSON(), nullable=False),
        sa.Column("seed", sa.BigInteger(), nullable=True),
        sa.Column("config_hash", sa.String(64), sa.ForeignKey("config_snapshots.hash"), nullable=True),
        sa.Column("fingerprint", sa.String(255), nullable=True),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("text", sa.Text(), nullable=True),
        sa.Column("input_tokens", sa.Integer(), nullable=True),
        sa.Column("output_tokens", sa.Integer(), nullable=True),
    )
    # What the history filters and the newest-first listing use.
    for column in ("source", "created_at", "status", "model", "config_hash", "fingerprint"):
        op.create_index(f"ix_runs_{column}", "runs", [column])

    op.create_table(
        "run_stages",
        sa.Column("id", sa.Integer(), primary_key=True, autoincrement=True),
        sa.Column("run_id", sa.String(32), sa.ForeignKey("runs.id", ondelete="CASCADE"), nullable=False),
        sa.Column("variant_index", sa.Integer(), nullable=False),
        sa.Column("stage_id", sa.Integer(), nullable=False),
        sa.Column("kind", sa.String(16), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("started_at", sa.DateTime(), nullable=True),
        sa.Column("finished_at", sa.DateTime(), nullable=True),
        sa.Column("queue_seconds", sa.Float(), nullable=False),
        sa.Column("input_tokens", sa.Integer(), nullable=False),
        sa.Column("output_tokens", sa.Integer(), nullable=False),
        sa.Column("batch_size", sa.Integer(), nullable=False),
        sa.UniqueConstraint("run_id", "variant_index", "stage_id", name="uq_run_stages_variant_stage"),
    )
    op.create_index("ix_run_stages_run_id", "run_stages", ["run_id"])

    op.create_table(
        "outputs",
        sa.Column("id", sa.Integer(), primary_key=True, autoincrement=True),
        sa.Column("run_id", sa.String(32), sa.ForeignKey("runs.id", ondelete="CASCADE"), nullable=False),
        sa.Column("index", sa.Integer(), nullable=False),
        sa.Column("kind", sa.String(16), nullable=False),
        sa.Column("sha256", sa.String(64), nullable=False),
        sa.Column("mime", sa.String(64), nullable=False),
        sa.Column("width", sa.Integer(), nullable=True),
        sa.Column("height", sa.Integer(), nullable=True),
        sa.Column("size_bytes", sa.BigInteger(), nullable=False),
        sa.UniqueConstraint("run_id", "kind", "index", name="uq_outputs_run_kind_index"),
    )
    op.create_index("ix_outputs_run_id", "outputs", ["run_id"])
    # Retention asks "is this file still used by any run?" per hash.
    op.create_index("ix_outputs_sha256", "outputs", ["sha256"])


def downgrade() -> None:
    op.drop_table("outputs")
    op.drop_table("run_stages")
    op.drop_table("runs")
    op.drop_table("config_snapshots")
