"""snapshot areas

Revision ID: c5d2e8a1f3b7
Revises: e4f1a7c2b9d3
Create Date: 2026-12-05 08:00:00+00:00

A ``snapshot_areas`` table: where each process of a run keeps its snapshots in its host's
shared memory (one row per run, host and rank, written when the slots are created, never per
snapshot; docs/SNAPSHOTS.md). Downgrading drops the table; the snapshots themselves stay in
shared memory and are still found by a restart on their host.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "c5d2e8a1f3b7"
down_revision: str | Sequence[str] | None = "c5a9e2f7d1b4"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    """Create ``snapshot_areas`` (empty)."""
    op.create_table(
        "snapshot_areas",
        sa.Column("run_id", sa.Integer(), nullable=False),
        sa.Column("host", sa.String(length=255), nullable=False),
        sa.Column("rank", sa.Integer(), nullable=False),
        sa.Column("uri", sa.Text(), nullable=False),
        sa.Column("slots", sa.Integer(), nullable=False),
        sa.Column("slot_bytes", sa.BigInteger(), nullable=False),
        sa.Column(
            "updated_at", sa.DateTime(timezone=True), server_default=sa.func.now(),
            nullable=False,
        ),
        sa.ForeignKeyConstraint(
            ["run_id"], ["runs.id"], name=op.f("fk_snapshot_areas_run_id_runs"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("run_id", "host", "rank", name=op.f("pk_snapshot_areas")),
    )


def downgrade() -> None:
    """Drop ``snapshot_areas``."""
    op.drop_table("snapshot_areas")
