"""Audio runs: ``runs.ttfp_seconds``, ``runs.audio_seconds``, ``runs.realtime_factor`` and the length of an
audio output, ``outputs.duration_seconds`` and ``outputs.sample_rate`` (all nullable).

A run of a model that speaks (the qwen-omni family, docs/speech.md) records the time from its submission
to the first audio its caller received (TTFP), the seconds of audio it made and its real-time factor
(generation seconds per second of audio); its WAV outputs record their length and rate, so the history
lists them without reading the files. Runs and outputs recorded before this revision have NULL there, as
do runs and outputs without audio. Output kinds gain ``audio`` (a value of the existing ``kind`` column).

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-05
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None

RUN_COLUMNS = ("ttfp_seconds", "audio_seconds", "realtime_factor")


# Plain ALTER TABLE (no batch mode), as 0004: on SQLite a batch "move and copy" would recreate ``runs``
# and drop the prompt-search triggers that 0003 installed on it. SQLite (3.35+) drops a column in place.
def upgrade() -> None:
    for name in RUN_COLUMNS:
        op.add_column("runs", sa.Column(name, sa.Float(), nullable=True))
    op.add_column("outputs", sa.Column("duration_seconds", sa.Float(), nullable=True))
    op.add_column("outputs", sa.Column("sample_rate", sa.Integer(), nullable=True))


def downgrade() -> None:
    op.drop_column("outputs", "sample_rate")
    op.drop_column("outputs", "duration_seconds")
    for name in reversed(RUN_COLUMNS):
        op.drop_column("runs", name)
