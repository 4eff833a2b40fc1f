"""store meta

Revision ID: 84503541b9b8
Revises: 5c8e0f3a2d17
Create Date: 2026-12-01 12:00:00+00:00

A ``store_meta`` key/value table. It records which store the catalog belongs to: the store id
(also written to the hot tier's ``.ckptstore.json``) and the hot tier it was last opened with,
so a store refuses a catalog that belongs to another store's hot tier. A catalog upgraded from
an earlier revision has no rows: the first open records them (it adopts its hot tier).
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "84503541b9b8"
down_revision: str | Sequence[str] | None = "5c8e0f3a2d17"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    """Create ``store_meta`` (empty: the next open of the store fills it)."""
    op.create_table(
        "store_meta",
        sa.Column("key", sa.String(length=64), nullable=False),
        sa.Column("value", sa.Text(), nullable=False),
        sa.Column(
            "updated_at", sa.DateTime(timezone=True), server_default=sa.func.now(),
            nullable=False,
        ),
        sa.PrimaryKeyConstraint("key", name=op.f("pk_store_meta")),
    )


def downgrade() -> None:
    """Drop ``store_meta`` (the hot tier's marker stays; the next open adopts it again)."""
    op.drop_table("store_meta")
