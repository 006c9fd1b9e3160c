"""Team accounts: ``users`` (a name, an argon2id password hash, the admin flag), ``api_keys`` (one row per
key: its short visible id, the sha256 of its secret, its label, when it was revoked) and
``runs.user_name``, the account a run belongs to (nullable, indexed newest first).

A studio with accounts shows each user only their own runs (docs/team.md); the admin sees all. Runs
recorded before this revision, and every run of a studio without accounts, have no account (NULL). A
job's account is in its existing ``owner`` column (``user:NAME``). Removing a user removes their keys
(``ON DELETE CASCADE``) and keeps their runs.

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-05
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


# Plain ALTER TABLE on ``runs`` (no batch mode), as 0004 and 0006: a batch "move and copy" would recreate
# ``runs`` on SQLite and drop the prompt-search triggers that 0003 installed on it.
def upgrade() -> None:
    op.create_table(
        "users",
        sa.Column("id", sa.Integer(), primary_key=True, autoincrement=True),
        sa.Column("name", sa.String(64), nullable=False),
        sa.Column("password_hash", sa.String(255), nullable=False),
        sa.Column("admin", sa.Boolean(), nullable=False),
        sa.Column("created_at", sa.DateTime(), nullable=False),
        sa.UniqueConstraint("name", name="uq_users_name"),
    )
    op.create_table(
        "api_keys",
        sa.Column("id", sa.String(16), primary_key=True),
        sa.Column("user_id", sa.Integer(), sa.ForeignKey("users.id", ondelete="CASCADE"), nullable=False),
        sa.Column("name", sa.String(100), nullable=True),
        sa.Column("secret_sha256", sa.String(64), nullable=False),
        sa.Column("created_at", sa.DateTime(), nullable=False),
        sa.Column("revoked_at", sa.DateTime(), nullable=True),
    )
    op.create_index("ix_api_keys_user_id", "api_keys", ["user_id"])
    op.add_column("runs", sa.Column("user_name", sa.String(64), nullable=True))
    op.create_index("ix_runs_user_name_created", "runs", ["user_name", "created_at", "id"])


def downgrade() -> None:
    op.drop_index("ix_runs_user_name_created", table_name="runs")
    op.drop_column("runs", "user_name")
    op.drop_index("ix_api_keys_user_id", table_name="api_keys")
    op.drop_table("api_keys")
    op.drop_table("users")
