"""remotes

Revision ID: a1e5c0d2f4b6
Revises: 9d4a6b1c2e80
Create Date: 2026-12-01 21:00:00+00:00

A ``remotes`` table: the other stores this one pushes checkpoints to and pulls them from
(``ckpt remote add NAME --config FILE``), each named by the config file that opens it. Kept in
the catalog rather than in a config file so every host sharing a PostgreSQL catalog sees the
same remotes. Downgrading drops the table; checkpoints already pushed or pulled stay.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "a1e5c0d2f4b6"
down_revision: str | Sequence[str] | None = "9d4a6b1c2e80"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    """Create ``remotes`` (empty)."""
    op.create_table(
        "remotes",
        sa.Column("name", sa.String(length=200), nullable=False),
        sa.Column("config", sa.Text(), nullable=False),
        sa.Column(
            "created_at", sa.DateTime(timezone=True), server_default=sa.func.now(),
            nullable=False,
        ),
        sa.PrimaryKeyConstraint("name", name=op.f("pk_remotes")),
    )


def downgrade() -> None:
    """Drop ``remotes``."""
    op.drop_table("remotes")
