"""Replays link to their originals: ``runs.replay_of`` (nullable, indexed).

A replay (``omni-studio replay``, the History replay action) re-runs a recorded run with its exact
parameters and records a new run whose ``replay_of`` is the original's id; the index answers "every replay
of this run" without a scan. Runs recorded before this revision have no link (NULL).

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-03
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


# Plain ALTER TABLE (no batch mode): on SQLite a batch "move and copy" would recreate ``runs`` and drop
# the prompt-search triggers that 0003 installed on it.
def upgrade() -> None:
    op.add_column("runs", sa.Column("replay_of", sa.String(length=32), nullable=True))
    op.create_index("ix_runs_replay_of", "runs", ["replay_of"])


def downgrade() -> None:
    op.drop_index("ix_runs_replay_of", table_name="runs")
    op.drop_column("runs", "replay_of")
