"""lineage edge weights

Revision ID: e4f1a7c2b9d3
Revises: b7c3d9e1f5a2
Create Date: 2026-12-05 10:00:00+00:00

Two nullable columns on ``lineage_edges`` for merged checkpoints, which have several parents
(one ``merged-from`` edge from each input): ``weight``, the input's normalised share of the
merge, and ``position``, its place among the inputs (0: the first, which also supplied the
integer tensors and non-tensor values). Every existing edge gets NULL in both, which is what
an edge of any other kind records, so upgrading changes the meaning of no row.

Downgrading drops both columns: the edges stay, their weights and order are lost (the
``merged`` events in the audit log still list them).
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "e4f1a7c2b9d3"
down_revision: str | Sequence[str] | None = "b7c3d9e1f5a2"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    """Add ``lineage_edges.weight`` and ``lineage_edges.position`` (nullable)."""
    with op.batch_alter_table("lineage_edges") as batch:
        batch.add_column(sa.Column("weight", sa.Float(), nullable=True))
        batch.add_column(sa.Column("position", sa.Integer(), nullable=True))


def downgrade() -> None:
    """Drop both columns (see the module docstring for what that loses)."""
    with op.batch_alter_table("lineage_edges") as batch:
        batch.drop_column("position")
        batch.drop_column("weight")
