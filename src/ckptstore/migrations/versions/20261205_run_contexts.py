"""run contexts

Revision ID: c5a9e2f7d1b4
Revises: e4f1a7c2b9d3
Create Date: 2026-12-05 08:00:00+00:00

Two new tables for reproducing runs: ``run_contexts`` (what made a run's checkpoints from a
version on: the git commit and uncommitted change, the command, the environment, the
config, as one JSON document per distinct context) and ``context_blobs`` (the blobs those
documents name by blake3 digest: the recorded change, the lock of installed
distributions, each stored once). Existing runs get no context: they were saved before it
was recorded, and ``ckpt show`` says so.

``runs.config`` becomes JSONB on PostgreSQL (``USING config::jsonb``: every stored config
is valid JSON) with a GIN index (``jsonb_path_ops``) for the config filters of listings
(``list(where="config.optim==adam")`` as ``config @> '{"optim": "adam"}'``); SQLite gets a
plain index of the same name.

Downgrading drops both tables and with them every recorded context, the index, and turns
``runs.config`` back into JSON on PostgreSQL (no value is lost: JSONB only normalises key
order and whitespace).
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "c5a9e2f7d1b4"
down_revision: str | Sequence[str] | None = "e4f1a7c2b9d3"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    """Create ``run_contexts`` and ``context_blobs``; index ``runs.config`` (JSONB on PG)."""
    if op.get_bind().dialect.name == "postgresql":
        op.alter_column("runs", "config", type_=postgresql.JSONB(), existing_type=sa.JSON(),
                        postgresql_using="config::jsonb")
    op.create_index("ix_runs_config", "runs", ["config"], postgresql_using="gin",
                    postgresql_ops={"config": "jsonb_path_ops"})
    op.create_table(
        "run_contexts",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("run_id", sa.Integer(), nullable=False),
        sa.Column("from_version", sa.Integer(), nullable=False),
        sa.Column("digest", sa.String(length=128), nullable=False),
        sa.Column("document", sa.JSON(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), server_default=sa.func.now(),
                  nullable=False),
        sa.ForeignKeyConstraint(["run_id"], ["runs.id"], ondelete="CASCADE",
                                name=op.f("fk_run_contexts_run_id_runs")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_run_contexts")),
    )
    op.create_index("ix_run_contexts_run_id_from_version", "run_contexts",
                    ["run_id", "from_version"])
    op.create_table(
        "context_blobs",
        sa.Column("digest", sa.String(length=128), nullable=False),
        sa.Column("size", sa.BigInteger(), nullable=False),
        sa.Column("data", sa.LargeBinary(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), server_default=sa.func.now(),
                  nullable=False),
        sa.PrimaryKeyConstraint("digest", name=op.f("pk_context_blobs")),
    )


def downgrade() -> None:
    """Drop both tables and the index (see the module docstring for what that loses)."""
    op.drop_index("ix_runs_config", table_name="runs")
    if op.get_bind().dialect.name == "postgresql":
        op.alter_column("runs", "config", type_=sa.JSON(), existing_type=postgresql.JSONB(),
                        postgresql_using="config::json")
    op.drop_table("context_blobs")
    op.drop_index("ix_run_contexts_run_id_from_version", table_name="run_contexts")
    op.drop_table("run_contexts")
