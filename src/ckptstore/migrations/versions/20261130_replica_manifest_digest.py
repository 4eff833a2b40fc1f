"""replica manifest digest

Revision ID: 7b1d4e2a9c63
Revises: 3f2c9a1e7b40
Create Date: 2026-11-30 17:00:00+00:00

A nullable ``replicas.manifest_digest``: the digest of the manifest a copy holds when it is
not the checkpoint's own (a copy re-encoded with the archive codec has its own manifest).
NULL, the value every existing row gets, means "the checkpoint's manifest", so upgrading
changes the meaning of no row.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "7b1d4e2a9c63"
down_revision: str | Sequence[str] | None = "3f2c9a1e7b40"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    """Add ``replicas.manifest_digest`` (nullable, no default)."""
    with op.batch_alter_table("replicas") as batch:
        batch.add_column(sa.Column("manifest_digest", sa.String(length=128), nullable=True))


def downgrade() -> None:
    """Drop ``replicas.manifest_digest`` (re-encoded copies then fail their digest check:
    delete them, or re-archive without re-encoding, before downgrading)."""
    with op.batch_alter_table("replicas") as batch:
        batch.drop_column("manifest_digest")
