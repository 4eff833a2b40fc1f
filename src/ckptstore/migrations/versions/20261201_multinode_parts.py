"""multi-node parts, hosts and catalogued manifests

Revision ID: 9d4a6b1c2e80
Revises: c18bb4f8a103
Create Date: 2026-12-01 09:00:00+00:00

What a distributed save across hosts without a shared filesystem needs the catalog to know:

* ``checkpoints.part_hosts`` (nullable JSON list): the hosts whose ranks wrote a checkpoint
  whose copies are tracked per host part. NULL (every existing row) means one directory
  holds the whole hot copy, as before.
* ``replica_parts``: one row per (checkpoint, tier, part host, stored-on host): which host's
  part lives on which tier and on whose disk (``""`` for a tier every host reaches), its
  state, size and verification time. A few rows per host and save, never one per chunk.
* ``hosts``: the hosts the catalog has heard from, with the last heartbeat.
* ``checkpoint_manifests``: a parted checkpoint's manifest bytes (and which ranks make up
  each part), so any host can materialise its part's manifest and commit marker.

Downgrading drops them: parted checkpoints then look like ordinary ones whose hot copy is
incomplete on every host; archive their warm copies completely before downgrading.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "9d4a6b1c2e80"
down_revision: str | Sequence[str] | None = "c18bb4f8a103"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_REPLICA_STATES = ("COPYING", "PRESENT", "DELETING", "DELETED", "DAMAGED")


def _ts(name: str, *, nullable: bool = False, now: bool = True) -> sa.Column[object]:
    return sa.Column(
        name,
        sa.DateTime(timezone=True),
        server_default=sa.func.now() if now else None,
        nullable=nullable,
    )


def _ckpt_fk(table: str) -> sa.ForeignKeyConstraint:
    return sa.ForeignKeyConstraint(
        ["checkpoint_id"],
        ["checkpoints.id"],
        name=op.f(f"fk_{table}_checkpoint_id_checkpoints"),
        ondelete="CASCADE",
    )


def upgrade() -> None:
    """Add ``checkpoints.part_hosts`` and the ``replica_parts``, ``hosts`` and
    ``checkpoint_manifests`` tables."""
    # Plain ALTER TABLE, not batch mode: on SQLite batch mode rebuilds the table, and
    # dropping the old ``checkpoints`` would cascade-delete every row that references it
    # (see 20261130_checkpoint_lossy_scope.py).
    op.add_column("checkpoints", sa.Column("part_hosts", sa.JSON(), nullable=True))
    op.create_table(
        "replica_parts",
        sa.Column("checkpoint_id", sa.String(length=36), nullable=False),
        sa.Column("tier", sa.String(length=64), nullable=False),
        sa.Column("part_host", sa.String(length=255), nullable=False),
        sa.Column("stored_on", sa.String(length=255), nullable=False),
        sa.Column(
            "state",
            sa.Enum(*_REPLICA_STATES, name="replica_state", native_enum=False,
                    create_constraint=False, length=16),
            nullable=False,
        ),
        sa.Column("bytes", sa.BigInteger(), server_default="0", nullable=False),
        sa.Column("files", sa.Integer(), server_default="0", nullable=False),
        _ts("verified_at", nullable=True, now=False),
        _ts("updated_at"),
        _ckpt_fk("replica_parts"),
        sa.PrimaryKeyConstraint(
            "checkpoint_id", "tier", "part_host", "stored_on", name=op.f("pk_replica_parts")
        ),
    )
    op.create_index(
        "ix_replica_parts_stored_on_tier_state", "replica_parts", ["stored_on", "tier", "state"]
    )
    op.create_table(
        "hosts",
        sa.Column("name", sa.String(length=255), nullable=False),
        _ts("first_seen"),
        _ts("last_seen"),
        sa.Column("role", sa.String(length=32), server_default="", nullable=False),
        sa.PrimaryKeyConstraint("name", name=op.f("pk_hosts")),
    )
    op.create_table(
        "checkpoint_manifests",
        sa.Column("checkpoint_id", sa.String(length=36), nullable=False),
        sa.Column("digest", sa.String(length=128), nullable=False),
        sa.Column("data", sa.LargeBinary(), nullable=False),
        sa.Column("parts", sa.JSON(), nullable=False),
        _ckpt_fk("checkpoint_manifests"),
        sa.PrimaryKeyConstraint("checkpoint_id", name=op.f("pk_checkpoint_manifests")),
    )


def downgrade() -> None:
    """Drop the tables and the column (see the module docstring for what that loses)."""
    op.drop_table("checkpoint_manifests")
    op.drop_table("hosts")
    op.drop_index("ix_replica_parts_stored_on_tier_state", table_name="replica_parts")
    op.drop_table("replica_parts")
    op.drop_column("checkpoints", "part_hosts")
