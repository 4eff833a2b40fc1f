"""thaws of archival copies

Revision ID: b7c3d9e1f5a2
Revises: a1e5c0d2f4b6
Create Date: 2026-12-01 21:00:00+00:00

``thaws``: one row per (checkpoint, tier) whose copy in an archival S3 storage class
(GLACIER, DEEP_ARCHIVE) was asked to be restored (S3 RestoreObject): the retrieval tier, how
many objects, when the requests went out, when S3 is expected to have them readable, and
whether the copy has since been brought back to the hot tier (PENDING → DONE). Retention
keeps every copy of a checkpoint whose thaw is PENDING.

Downgrading drops the table: pending thaws are forgotten (S3 still completes the requests;
the next load asks again, which S3 answers at no cost while the restore is in progress).
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "b7c3d9e1f5a2"
down_revision: str | Sequence[str] | None = "a1e5c0d2f4b6"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    """Create the ``thaws`` table."""
    op.create_table(
        "thaws",
        sa.Column("checkpoint_id", sa.String(length=36), nullable=False),
        sa.Column("tier", sa.String(length=64), nullable=False),
        sa.Column("state", sa.String(length=16), nullable=False),
        sa.Column("retrieval", sa.String(length=16), nullable=False),
        sa.Column("objects", sa.Integer(), server_default="0", nullable=False),
        sa.Column("requested_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("expected_ready_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), server_default=sa.func.now(),
                  nullable=False),
        sa.ForeignKeyConstraint(
            ["checkpoint_id"], ["checkpoints.id"],
            name=op.f("fk_thaws_checkpoint_id_checkpoints"), ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("checkpoint_id", "tier", name=op.f("pk_thaws")),
    )


def downgrade() -> None:
    """Drop the ``thaws`` table (see the module docstring for what that loses)."""
    op.drop_table("thaws")
