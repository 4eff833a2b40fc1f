"""checkpoint lossy scope

Revision ID: 5c8e0f3a2d17
Revises: 7b1d4e2a9c63
Create Date: 2026-11-30 23:50:00+00:00

A nullable ``checkpoints.lossy_scope`` (JSON list of key patterns): which tensors a lossy
checkpoint stores approximately, next to ``lossy`` and ``error_bound``, so queries and
``ckpt show`` need not open the manifest. NULL (every existing row) reads as "none recorded".
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "5c8e0f3a2d17"
down_revision: str | Sequence[str] | None = "7b1d4e2a9c63"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


# Plain ALTER TABLE, not batch mode: on SQLite batch mode rebuilds the table, and dropping
# the old ``checkpoints`` would cascade-delete every replica, lease and event row that
# references it. SQLite (>= 3.35) adds and drops a plain column in place.


def upgrade() -> None:
    """Add ``checkpoints.lossy_scope`` (nullable JSON, no default)."""
    op.add_column("checkpoints", sa.Column("lossy_scope", sa.JSON(), nullable=True))


def downgrade() -> None:
    """Drop ``checkpoints.lossy_scope`` (the manifests keep the scope)."""
    op.drop_column("checkpoints", "lossy_scope")
