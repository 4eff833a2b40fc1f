"""initial catalog

Revision ID: 3f2c9a1e7b40
Revises:
Create Date: 2026-11-30 13:40:00+00:00

Every table of the first catalog schema. Written from the autogenerate output, then made
backend-neutral: server defaults use ``sa.func.now()`` and ``sa.false()`` instead of the SQLite
spelling autogenerate printed, and timestamps are plain ``sa.DateTime(timezone=True)`` (the
models' ``UTCDateTime`` is a Python-side decorator over exactly that type). The revision does not
import the models: it must keep describing this schema after the models move on.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "3f2c9a1e7b40"
down_revision: str | Sequence[str] | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_CHECKPOINT_STATES = ("PENDING", "COMMITTED", "DELETING", "DELETED", "FAILED")
_REPLICA_STATES = ("COPYING", "PRESENT", "DELETING", "DELETED", "DAMAGED")


def _ts(name: str, *, nullable: bool = False, now: bool = True) -> sa.Column[object]:
    return sa.Column(
        name,
        sa.DateTime(timezone=True),
        server_default=sa.func.now() if now else None,
        nullable=nullable,
    )


def _ckpt_fk(name: str, *, nullable: bool = False, pk: bool = False) -> sa.Column[object]:
    return sa.Column(name, sa.String(length=36), nullable=nullable, primary_key=pk)


def _state(name: str, values: Sequence[str]) -> sa.Enum:
    return sa.Enum(*values, name=name, native_enum=False, create_constraint=False, length=16)


def upgrade() -> None:
    """Create every catalog table."""
    op.create_table(
        "experiments",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(length=200), nullable=False),
        _ts("created_at"),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_experiments")),
        sa.UniqueConstraint("name", name=op.f("uq_experiments_name")),
    )
    op.create_table(
        "runs",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(length=200), nullable=False),
        sa.Column("experiment_id", sa.Integer(), nullable=True),
        sa.Column("config", sa.JSON(), nullable=True),
        sa.Column("code_version", sa.String(length=200), nullable=True),
        sa.Column("data_version", sa.String(length=200), nullable=True),
        sa.Column("host", sa.String(length=255), nullable=True),
        sa.Column("status", sa.String(length=32), server_default="active", nullable=False),
        _ts("created_at"),
        sa.ForeignKeyConstraint(
            ["experiment_id"],
            ["experiments.id"],
            name=op.f("fk_runs_experiment_id_experiments"),
            ondelete="SET NULL",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_runs")),
        sa.UniqueConstraint("name", name=op.f("uq_runs_name")),
    )
    op.create_index(op.f("ix_runs_experiment_id"), "runs", ["experiment_id"])

    op.create_table(
        "checkpoints",
        sa.Column("id", sa.String(length=36), nullable=False),
        sa.Column("run_id", sa.Integer(), nullable=False),
        sa.Column("step", sa.BigInteger(), nullable=False),
        sa.Column("version", sa.Integer(), nullable=False),
        sa.Column("state", _state("checkpoint_state", _CHECKPOINT_STATES), nullable=False),
        sa.Column("kind", sa.String(length=16), server_default="full", nullable=False),
        _ckpt_fk("base_id", nullable=True),
        _ckpt_fk("parent_id", nullable=True),
        sa.Column("metrics", sa.JSON(), nullable=True),
        sa.Column("tags", sa.JSON(), nullable=True),
        sa.Column("logical_bytes", sa.BigInteger(), server_default="0", nullable=False),
        sa.Column("stored_bytes", sa.BigInteger(), server_default="0", nullable=False),
        sa.Column("manifest_digest", sa.String(length=128), nullable=True),
        sa.Column("codec", sa.String(length=64), server_default="none", nullable=False),
        sa.Column("lossy", sa.Boolean(), server_default=sa.false(), nullable=False),
        sa.Column("error_bound", sa.Float(), nullable=True),
        sa.Column("pinned", sa.Boolean(), server_default=sa.false(), nullable=False),
        sa.Column("writer", sa.String(length=300), nullable=True),
        _ts("created_at"),
        _ts("committed_at", nullable=True, now=False),
        sa.ForeignKeyConstraint(
            ["base_id"], ["checkpoints.id"], name=op.f("fk_checkpoints_base_id_checkpoints")
        ),
        sa.ForeignKeyConstraint(
            ["parent_id"], ["checkpoints.id"], name=op.f("fk_checkpoints_parent_id_checkpoints")
        ),
        sa.ForeignKeyConstraint(
            ["run_id"], ["runs.id"], name=op.f("fk_checkpoints_run_id_runs"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_checkpoints")),
        sa.UniqueConstraint("run_id", "version", name=op.f("uq_checkpoints_run_id_version")),
    )
    op.create_index(op.f("ix_checkpoints_base_id"), "checkpoints", ["base_id"])
    op.create_index(op.f("ix_checkpoints_parent_id"), "checkpoints", ["parent_id"])
    op.create_index(op.f("ix_checkpoints_writer"), "checkpoints", ["writer"])
    op.create_index("ix_checkpoints_run_id_step", "checkpoints", ["run_id", "step"])
    op.create_index(
        "ix_checkpoints_run_id_state_version", "checkpoints", ["run_id", "state", "version"]
    )
    op.create_index("ix_checkpoints_state_created_at", "checkpoints", ["state", "created_at"])
    op.create_index(
        "ix_checkpoints_step_run_id_version", "checkpoints", ["step", "run_id", "version"]
    )

    op.create_table(
        "checkpoint_tags",
        _ckpt_fk("checkpoint_id"),
        sa.Column("tag", sa.String(length=200), nullable=False),
        # Copies of the checkpoint's (immutable) run, step and version: see the index below.
        sa.Column("run_id", sa.Integer(), nullable=False),
        sa.Column("step", sa.BigInteger(), nullable=False),
        sa.Column("version", sa.Integer(), nullable=False),
        sa.ForeignKeyConstraint(
            ["checkpoint_id"],
            ["checkpoints.id"],
            name=op.f("fk_checkpoint_tags_checkpoint_id_checkpoints"),
            ondelete="CASCADE",
        ),
        sa.ForeignKeyConstraint(
            ["run_id"],
            ["runs.id"],
            name=op.f("fk_checkpoint_tags_run_id_runs"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("checkpoint_id", "tag", name=op.f("pk_checkpoint_tags")),
    )
    # list(tag=...) in list order reads this index from the front and stops at the LIMIT.
    op.create_index(
        "ix_checkpoint_tags_tag_step_run_id_version",
        "checkpoint_tags",
        ["tag", "step", "run_id", "version"],
    )

    op.create_table(
        "checkpoint_metrics",
        _ckpt_fk("checkpoint_id"),
        sa.Column("name", sa.String(length=200), nullable=False),
        sa.Column("run_id", sa.Integer(), nullable=False),
        sa.Column("value", sa.Float(), nullable=False),
        sa.ForeignKeyConstraint(
            ["checkpoint_id"],
            ["checkpoints.id"],
            name=op.f("fk_checkpoint_metrics_checkpoint_id_checkpoints"),
            ondelete="CASCADE",
        ),
        sa.ForeignKeyConstraint(
            ["run_id"],
            ["runs.id"],
            name=op.f("fk_checkpoint_metrics_run_id_runs"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("checkpoint_id", "name", name=op.f("pk_checkpoint_metrics")),
    )
    op.create_index("ix_checkpoint_metrics_name_value", "checkpoint_metrics", ["name", "value"])
    op.create_index(
        "ix_checkpoint_metrics_run_id_name_value",
        "checkpoint_metrics",
        ["run_id", "name", "value"],
    )

    op.create_table(
        "replicas",
        _ckpt_fk("checkpoint_id"),
        sa.Column("tier", sa.String(length=64), nullable=False),
        sa.Column("uri", sa.Text(), server_default="", nullable=False),
        sa.Column("state", _state("replica_state", _REPLICA_STATES), nullable=False),
        sa.Column("bytes", sa.BigInteger(), server_default="0", nullable=False),
        _ts("verified_at", nullable=True, now=False),
        _ts("updated_at"),
        sa.ForeignKeyConstraint(
            ["checkpoint_id"],
            ["checkpoints.id"],
            name=op.f("fk_replicas_checkpoint_id_checkpoints"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("checkpoint_id", "tier", name=op.f("pk_replicas")),
    )

    op.create_table(
        "lineage_edges",
        _ckpt_fk("src_id"),
        _ckpt_fk("dst_id"),
        sa.Column("kind", sa.String(length=32), nullable=False),
        _ts("created_at"),
        sa.ForeignKeyConstraint(
            ["dst_id"],
            ["checkpoints.id"],
            name=op.f("fk_lineage_edges_dst_id_checkpoints"),
            ondelete="CASCADE",
        ),
        sa.ForeignKeyConstraint(
            ["src_id"],
            ["checkpoints.id"],
            name=op.f("fk_lineage_edges_src_id_checkpoints"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("src_id", "dst_id", "kind", name=op.f("pk_lineage_edges")),
    )
    op.create_index(op.f("ix_lineage_edges_dst_id"), "lineage_edges", ["dst_id"])

    op.create_table(
        "aliases",
        sa.Column("name", sa.String(length=200), nullable=False),
        _ckpt_fk("checkpoint_id"),
        _ts("created_at"),
        sa.ForeignKeyConstraint(
            ["checkpoint_id"],
            ["checkpoints.id"],
            name=op.f("fk_aliases_checkpoint_id_checkpoints"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("name", name=op.f("pk_aliases")),
    )
    op.create_index(op.f("ix_aliases_checkpoint_id"), "aliases", ["checkpoint_id"])

    op.create_table(
        "events",
        # BIGINT on PostgreSQL; SQLite only auto-increments a column declared INTEGER.
        sa.Column("id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), nullable=False),
        _ckpt_fk("checkpoint_id", nullable=True),
        sa.Column("run_id", sa.Integer(), nullable=True),
        sa.Column("kind", sa.String(length=64), nullable=False),
        sa.Column("actor", sa.String(length=300), nullable=True),
        sa.Column("detail", sa.JSON(), nullable=True),
        _ts("at"),
        sa.ForeignKeyConstraint(
            ["checkpoint_id"],
            ["checkpoints.id"],
            name=op.f("fk_events_checkpoint_id_checkpoints"),
            ondelete="SET NULL",
        ),
        sa.ForeignKeyConstraint(
            ["run_id"], ["runs.id"], name=op.f("fk_events_run_id_runs"), ondelete="SET NULL"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_events")),
    )
    op.create_index(op.f("ix_events_at"), "events", ["at"])
    op.create_index("ix_events_checkpoint_id_at", "events", ["checkpoint_id", "at"])
    op.create_index("ix_events_run_id_at", "events", ["run_id", "at"])

    op.create_table(
        "leases",
        _ckpt_fk("checkpoint_id"),
        sa.Column("purpose", sa.String(length=64), nullable=False),
        sa.Column("owner", sa.String(length=300), nullable=False),
        _ts("expires_at", now=False),
        sa.ForeignKeyConstraint(
            ["checkpoint_id"],
            ["checkpoints.id"],
            name=op.f("fk_leases_checkpoint_id_checkpoints"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("checkpoint_id", "purpose", name=op.f("pk_leases")),
    )


def downgrade() -> None:
    """Drop every catalog table (dependents first; indexes go with their tables)."""
    for table in (
        "leases",
        "events",
        "aliases",
        "lineage_edges",
        "replicas",
        "checkpoint_metrics",
        "checkpoint_tags",
        "checkpoints",
        "runs",
        "experiments",
    ):
        op.drop_table(table)
