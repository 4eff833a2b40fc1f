"""metric history

Revision ID: c18bb4f8a103
Revises: 84503541b9b8
Create Date: 2026-12-01 16:00:00+00:00

A new table ``metric_history``: the training-metric series of each run (the loss curve
between checkpoints), downsampled into a bounded number of buckets per series
(``catalog/metric_history.py``). Only a new table, so upgrading changes no existing row;
downgrading drops the series (checkpoints keep their own metrics).
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "c18bb4f8a103"
down_revision: str | Sequence[str] | None = "84503541b9b8"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    """Create ``metric_history`` (one row per bucket of one series of one run)."""
    op.create_table(
        "metric_history",
        sa.Column("run_id", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(length=200), nullable=False),
        sa.Column("bucket_start", sa.BigInteger(), nullable=False),
        sa.Column("width", sa.BigInteger(), nullable=False),
        sa.Column("step_first", sa.BigInteger(), nullable=False),
        sa.Column("step_last", sa.BigInteger(), nullable=False),
        sa.Column("count", sa.BigInteger(), nullable=False),
        sa.Column("total", sa.Float(), nullable=False),
        sa.Column("vmin", sa.Float(), nullable=False),
        sa.Column("vmax", sa.Float(), nullable=False),
        sa.Column("last", sa.Float(), nullable=False),
        sa.ForeignKeyConstraint(
            ["run_id"],
            ["runs.id"],
            name=op.f("fk_metric_history_run_id_runs"),
            ondelete="CASCADE",
        ),
        # The primary key's (run_id, name, bucket_start) order serves every query: one
        # series of one run, in step order.
        sa.PrimaryKeyConstraint("run_id", "name", "bucket_start", name=op.f("pk_metric_history")),
    )


def downgrade() -> None:
    """Drop ``metric_history``."""
    op.drop_table("metric_history")
