"""History at scale: the prompt search index and composite indexes for the History filters.

* SQLite: ``runs_fts``, an FTS5 trigram index over ``runs.prompt`` kept in sync by triggers, built here for
  the runs already recorded. PostgreSQL: ``pg_trgm`` and a GIN trigram index on ``runs.prompt`` (skipped
  with a warning when the extension cannot be created; see ``studio.store.search``).
* Each filter column's single index becomes ``(column, created_at, id)``: a filtered History page is read
  newest first straight from the index (no sort), and the keyset cursor ``(created_at, id)`` continues
  it. ``created_at`` alone becomes ``(created_at, id)``.

Revision ID: 0003
Revises: 0002
Create Date: 2025-12-03
"""

from __future__ import annotations

from alembic import op

from studio.store.search import drop_pg_search, drop_sqlite_search, install_pg_search, install_sqlite_search

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None

FILTER_COLUMNS = ("status", "model", "source", "fingerprint", "config_hash")


def upgrade() -> None:
    op.drop_index("ix_runs_created_at", table_name="runs")
    op.create_index("ix_runs_created_at_id", "runs", ["created_at", "id"])
    for column in FILTER_COLUMNS:
        op.drop_index(f"ix_runs_{column}", table_name="runs")
        op.create_index(f"ix_runs_{column}_created", "runs", [column, "created_at", "id"])
    connection = op.get_bind()
    if connection.dialect.name == "sqlite":
        install_sqlite_search(connection)
    elif connection.dialect.name == "postgresql":
        install_pg_search(connection)


def downgrade() -> None:
    connection = op.get_bind()
    if connection.dialect.name == "sqlite":
        drop_sqlite_search(connection)
    elif connection.dialect.name == "postgresql":
        drop_pg_search(connection)
    for column in FILTER_COLUMNS:
        op.drop_index(f"ix_runs_{column}_created", table_name="runs")
        op.create_index(f"ix_runs_{column}", "runs", [column])
    op.drop_index("ix_runs_created_at_id", table_name="runs")
    op.create_index("ix_runs_created_at", "runs", ["created_at"])
