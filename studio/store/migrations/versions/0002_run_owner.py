"""runs.owner: which store instance records a run, so only runs of dead processes are interrupted.

Without it, opening the store (the studio starting, or just `omni-studio history ls`) would mark every
queued/running run interrupted, including those a live studio process is still generating. Existing rows
get no owner, which reads as "owner gone".

Revision ID: 0002
Revises: 0001
Create Date: 2025-12-02
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("runs") as batch:
        batch.add_column(sa.Column("owner", sa.String(160), nullable=True))
        batch.create_index("ix_runs_owner", ["owner"])


def downgrade() -> None:
    with op.batch_alter_table("runs") as batch:
        batch.drop_index("ix_runs_owner")
        batch.drop_column("owner")
