"""Typed SQLAlchemy 2 models of the catalog schema.

The schema itself is created only by the Alembic revisions in ``ckptstore.migrations``; these
models describe it for queries and for the migration test that checks both agree
(``compare_metadata`` finds no difference). Change a model only together with a new revision.

Conventions:
    * every constraint and index gets a deterministic name from :data:`NAMING_CONVENTION`, so
      migrations can refer to them on every backend (SQLite needs names for batch mode);
    * timestamps are timezone-aware UTC (:class:`UTCDateTime`), also on SQLite, which stores
      them as naive text;
    * states are stored as plain strings (``Enum(native_enum=False)``) so that adding a state
      never needs a PostgreSQL ``ALTER TYPE``;
    * checkpoint ids are uuid strings, the same text users see in references and paths.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    DateTime,
    Dialect,
    Enum,
    Float,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    String,
    Text,
    TypeDecorator,
    UniqueConstraint,
    false,
    func,
)
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column
from sqlalchemy.types import TypeEngine

from ckptstore.records import CheckpointState, ReplicaState

__all__ = [
    "NAMING_CONVENTION",
    "AliasRow",
    "Base",
    "CheckpointManifestRow",
    "CheckpointMetricRow",
    "CheckpointRow",
    "CheckpointTagRow",
    "EventRow",
    "ExperimentRow",
    "HostRow",
    "LeaseRow",
    "LineageEdgeRow",
    "MetricHistoryRow",
    "ReplicaPartRow",
    "ContextBlobRow",
    "ReplicaRow",
    "RunContextRow",
    "RunRow",
    "SnapshotAreaRow",
    "StoreMetaRow",
    "ThawRow",
    "UTCDateTime",
    "parse_utc",
    "utcnow",
]

# %(column_0_N_name)s, not %(column_0_name)s: a two-column unique constraint must not be named
# after its first column only (that name would collide with a later one on the same column).
NAMING_CONVENTION: dict[str, str] = {
    "ix": "ix_%(table_name)s_%(column_0_N_name)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}

# Length of the string columns that hold names (run, tag, alias: names.MAX_NAME_BYTES is 200).
NAME_LEN = 200
ID_LEN = 36  # str(uuid.UUID(...))


def utcnow() -> datetime:
    """The current time, timezone-aware UTC (what every timestamp column stores)."""
    return datetime.now(UTC)


class UTCDateTime(TypeDecorator[datetime]):
    """``DateTime(timezone=True)`` that always hands back aware UTC datetimes.

    PostgreSQL stores ``timestamptz`` natively. SQLite has no time zone support: SQLAlchemy
    stores the wall-clock text and returns naive datetimes, so values are normalised to UTC
    before binding and tagged as UTC after loading. Naive datetimes are refused on the way in
    because their meaning depends on the host's zone.
    """

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError(f"naive datetime {value!r}: pass a timezone-aware datetime")
        value = value.astimezone(UTC)
        return value.replace(tzinfo=None) if dialect.name == "sqlite" else value

    def process_result_value(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            return value.replace(tzinfo=UTC)
        return value.astimezone(UTC)

    def result_processor(self, dialect: Dialect, coltype: object) -> Any:
        if dialect.name != "sqlite":
            return super().result_processor(dialect, coltype)

        # SQLAlchemy's SQLite DATETIME parses its text with a regular expression; loading a
        # 1,000-checkpoint lineage spent a third of its time there. fromisoformat (C) reads
        # the same "YYYY-MM-DD HH:MM:SS[.ffffff]" text an order of magnitude faster.
        def process(value: str | datetime | None) -> datetime | None:
            if value is None:
                return None
            if isinstance(value, str):
                return parse_utc(value)
            return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)

        return process


def parse_utc(text: str) -> datetime:
    """An ISO 8601 timestamp as an aware UTC datetime; text without a zone is UTC.

    Text without a zone (what SQLite stores, and its JSON carries) is parsed with ``+00:00``
    appended: one C call, about a sixth of the time of parsing it naive and then calling
    ``replace(tzinfo=UTC)``, whose keyword handling dominated building long lineages.
    """
    if len(text) > 10 and text[-6] not in "+-" and text[-1] != "Z":
        try:
            return datetime.fromisoformat(text + "+00:00")
        except ValueError:  # a zone in another spelling ("+05"): parsed below
            pass
    parsed = datetime.fromisoformat(text)
    return parsed.replace(tzinfo=UTC) if parsed.tzinfo is None else parsed.astimezone(UTC)


def _state_enum(enum_cls: type[CheckpointState] | type[ReplicaState], name: str) -> Enum:
    # native_enum=False: a VARCHAR, no CHECK constraint; values are validated in Python.
    return Enum(
        enum_cls,
        name=name,
        native_enum=False,
        create_constraint=False,
        length=16,
        values_callable=lambda members: [m.value for m in members],
    )


class Base(DeclarativeBase):
    """Declarative base of every catalog table."""

    metadata = MetaData(naming_convention=NAMING_CONVENTION)
    type_annotation_map = {dict[str, Any]: JSON, datetime: UTCDateTime}


class ExperimentRow(Base):
    """A named group of runs."""

    __tablename__ = "experiments"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(NAME_LEN), unique=True)
    created_at: Mapped[datetime] = mapped_column(default=utcnow, server_default=func.now())


def _escape_nul(value: Any, *, decode: bool) -> Any:
    """``value`` with every string (keys too) made safe for JSONB, or restored.

    JSONB cannot hold U+0000, which a user's config may (it is stored as given). Strings
    holding U+0000 or U+0001 are written as U+0001 followed by the string with U+0001 doubled
    and U+0000 as U+0001 "0"; no other string starts with U+0001, so reading it back is exact.
    """
    if isinstance(value, dict):
        return {_escape_nul(k, decode=decode): _escape_nul(v, decode=decode)
                for k, v in value.items()}
    if isinstance(value, list):
        return [_escape_nul(v, decode=decode) for v in value]
    if not isinstance(value, str):
        return value
    if decode:
        if not value.startswith("\x01"):
            return value
        out, i, body = [], 0, value[1:]
        while i < len(body):
            if body[i] == "\x01" and i + 1 < len(body):
                out.append("\x00" if body[i + 1] == "0" else "\x01")
                i += 2
            else:
                out.append(body[i])
                i += 1
        return "".join(out)
    if "\x00" not in value and "\x01" not in value:
        return value
    return "\x01" + value.replace("\x01", "\x01\x01").replace("\x00", "\x010")


class ConfigJSON(TypeDecorator[Any]):
    """A run's config: JSON, and JSONB on PostgreSQL (whose U+0000 is escaped, see
    :func:`_escape_nul`)."""

    impl = JSON
    cache_ok = True

    def load_dialect_impl(self, dialect: Dialect) -> TypeEngine[Any]:
        if dialect.name == "postgresql":
            return dialect.type_descriptor(JSONB())
        return dialect.type_descriptor(JSON())

    def process_bind_param(self, value: Any, dialect: Dialect) -> Any:
        if value is None or dialect.name != "postgresql":
            return value
        return _escape_nul(value, decode=False)

    def process_result_value(self, value: Any, dialect: Dialect) -> Any:
        if value is None or dialect.name != "postgresql":
            return value
        return _escape_nul(value, decode=True)


class RunRow(Base):
    """A training run and what is needed to reproduce it.

    ``config`` is JSONB on PostgreSQL with a GIN index (``jsonb_path_ops``) serving the
    equality filters of ``list(where="config.<key>==<value>")`` as containment (``@>``);
    on SQLite the index is a plain one (the runs table has one row per run).
    """

    __tablename__ = "runs"
    __table_args__ = (
        Index("ix_runs_config", "config", postgresql_using="gin",
              postgresql_ops={"config": "jsonb_path_ops"}),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(NAME_LEN), unique=True)
    experiment_id: Mapped[int | None] = mapped_column(
        ForeignKey("experiments.id", ondelete="SET NULL"), index=True
    )
    config: Mapped[dict[str, Any] | None] = mapped_column(ConfigJSON())
    code_version: Mapped[str | None] = mapped_column(String(200))
    data_version: Mapped[str | None] = mapped_column(String(200))
    host: Mapped[str | None] = mapped_column(String(255))
    status: Mapped[str] = mapped_column(String(32), default="active", server_default="active")
    created_at: Mapped[datetime] = mapped_column(default=utcnow, server_default=func.now())


class CheckpointRow(Base):
    """One version of one step of one run."""

    __tablename__ = "checkpoints"
    __table_args__ = (
        UniqueConstraint("run_id", "version"),
        Index("ix_checkpoints_run_id_step", "run_id", "step"),
        Index("ix_checkpoints_run_id_state_version", "run_id", "state", "version"),
        Index("ix_checkpoints_state_created_at", "state", "created_at"),
        # Serves list() across runs in its default order (step, run, version) with a LIMIT
        # without sorting every checkpoint.
        Index("ix_checkpoints_step_run_id_version", "step", "run_id", "version"),
    )

    id: Mapped[str] = mapped_column(String(ID_LEN), primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"))
    step: Mapped[int] = mapped_column(BigInteger)
    version: Mapped[int] = mapped_column(Integer)
    state: Mapped[CheckpointState] = mapped_column(_state_enum(CheckpointState, "checkpoint_state"))
    kind: Mapped[str] = mapped_column(String(16), default="full", server_default="full")
    base_id: Mapped[str | None] = mapped_column(ForeignKey("checkpoints.id"), index=True)
    parent_id: Mapped[str | None] = mapped_column(ForeignKey("checkpoints.id"), index=True)
    metrics: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    # Sorted copy of the checkpoint_tags rows (tags never change after begin): loading a
    # record then needs no per-checkpoint probe of checkpoint_tags, which serves filtering.
    tags: Mapped[list[str] | None] = mapped_column(JSON)
    logical_bytes: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")
    stored_bytes: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")
    manifest_digest: Mapped[str | None] = mapped_column(String(128))
    codec: Mapped[str] = mapped_column(String(64), default="none", server_default="none")
    lossy: Mapped[bool] = mapped_column(Boolean, default=False, server_default=false())
    error_bound: Mapped[float | None] = mapped_column(Float)
    # Key patterns of the tensors stored approximately (a lossy checkpoint's manifest scope).
    lossy_scope: Mapped[list[str] | None] = mapped_column(JSON)
    pinned: Mapped[bool] = mapped_column(Boolean, default=False, server_default=false())
    writer: Mapped[str | None] = mapped_column(String(300), index=True)
    created_at: Mapped[datetime] = mapped_column(default=utcnow, server_default=func.now())
    committed_at: Mapped[datetime | None] = mapped_column()
    # Sorted hosts whose ranks wrote a distributed checkpoint whose copies are tracked per
    # host part (replica_parts); NULL when one directory holds the whole hot copy.
    part_hosts: Mapped[list[str] | None] = mapped_column(JSON)


class CheckpointTagRow(Base):
    """One tag of one checkpoint (a separate table so tag filters use an index).

    ``run_id``, ``step`` and ``version`` are copied from the checkpoint (they never change):
    with the ``(tag, step, run_id, version)`` index, ``list(tag=..., limit=100)`` reads the
    first 100 entries of the tag in list order instead of joining and sorting every
    checkpoint carrying a common tag.
    """

    __tablename__ = "checkpoint_tags"
    __table_args__ = (
        Index("ix_checkpoint_tags_tag_step_run_id_version", "tag", "step", "run_id", "version"),
    )

    checkpoint_id: Mapped[str] = mapped_column(
        ForeignKey("checkpoints.id", ondelete="CASCADE"), primary_key=True
    )
    tag: Mapped[str] = mapped_column(String(NAME_LEN), primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"))
    step: Mapped[int] = mapped_column(BigInteger)
    version: Mapped[int] = mapped_column(Integer)


class CheckpointMetricRow(Base):
    """One metric value of one checkpoint, duplicated from ``checkpoints.metrics``.

    ``run_id`` is denormalised from the checkpoint so that ``best(run, metric)`` walks the
    ``(run_id, name, value)`` index in value order and stops at the first committed row,
    instead of sorting every value the run ever logged.
    """

    __tablename__ = "checkpoint_metrics"
    __table_args__ = (
        Index("ix_checkpoint_metrics_name_value", "name", "value"),
        Index("ix_checkpoint_metrics_run_id_name_value", "run_id", "name", "value"),
    )

    checkpoint_id: Mapped[str] = mapped_column(
        ForeignKey("checkpoints.id", ondelete="CASCADE"), primary_key=True
    )
    name: Mapped[str] = mapped_column(String(NAME_LEN), primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"))
    value: Mapped[float] = mapped_column(Float)


class ReplicaRow(Base):
    """One copy of a checkpoint on one tier."""

    __tablename__ = "replicas"
    # The primary key (checkpoint_id, tier) is the "one replica per tier" uniqueness rule.
    checkpoint_id: Mapped[str] = mapped_column(
        ForeignKey("checkpoints.id", ondelete="CASCADE"), primary_key=True
    )
    tier: Mapped[str] = mapped_column(String(64), primary_key=True)
    uri: Mapped[str] = mapped_column(Text, default="", server_default="")
    state: Mapped[ReplicaState] = mapped_column(_state_enum(ReplicaState, "replica_state"))
    bytes: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")
    verified_at: Mapped[datetime | None] = mapped_column()
    updated_at: Mapped[datetime] = mapped_column(default=utcnow, server_default=func.now())
    # NULL: the copy holds the checkpoint's own manifest (checkpoints.manifest_digest). Set
    # for a copy whose manifest differs, i.e. one re-encoded with the archive codec.
    manifest_digest: Mapped[str | None] = mapped_column(String(128))


class LineageEdgeRow(Base):
    """A derivation edge: ``dst`` was resumed / fine-tuned / converted / merged from ``src``."""

    __tablename__ = "lineage_edges"

    src_id: Mapped[str] = mapped_column(
        ForeignKey("checkpoints.id", ondelete="CASCADE"), primary_key=True
    )
    dst_id: Mapped[str] = mapped_column(
        ForeignKey("checkpoints.id", ondelete="CASCADE"), primary_key=True, index=True
    )
    kind: Mapped[str] = mapped_column(String(32), primary_key=True)
    created_at: Mapped[datetime] = mapped_column(default=utcnow, server_default=func.now())
    # A merged-from edge's share of the merge (normalised weights of one merge sum to 1) and
    # the input's place in it (0 = first: integer tensors and non-tensor values came from
    # it). NULL for every other kind of edge.
    weight: Mapped[float | None] = mapped_column(Float)
    position: Mapped[int | None] = mapped_column(Integer)


class AliasRow(Base):
    """A user label (``prod``, ``best``) that points at one checkpoint and protects it."""

    __tablename__ = "aliases"

    name: Mapped[str] = mapped_column(String(NAME_LEN), primary_key=True)
    checkpoint_id: Mapped[str] = mapped_column(
        ForeignKey("checkpoints.id", ondelete="CASCADE"), index=True
    )
    created_at: Mapped[datetime] = mapped_column(default=utcnow, server_default=func.now())


class EventRow(Base):
    """One audit-log entry."""

    __tablename__ = "events"
    __table_args__ = (
        Index("ix_events_checkpoint_id_at", "checkpoint_id", "at"),
        Index("ix_events_run_id_at", "run_id", "at"),
    )

    id: Mapped[int] = mapped_column(
        BigInteger().with_variant(Integer(), "sqlite"), primary_key=True
    )
    checkpoint_id: Mapped[str | None] = mapped_column(
        ForeignKey("checkpoints.id", ondelete="SET NULL")
    )
    run_id: Mapped[int | None] = mapped_column(ForeignKey("runs.id", ondelete="SET NULL"))
    kind: Mapped[str] = mapped_column(String(64))
    actor: Mapped[str | None] = mapped_column(String(300))
    detail: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    at: Mapped[datetime] = mapped_column(default=utcnow, server_default=func.now(), index=True)


class LeaseRow(Base):
    """A flow's time-limited claim on a checkpoint for one purpose (archive, prune, ...)."""

    __tablename__ = "leases"

    checkpoint_id: Mapped[str] = mapped_column(
        ForeignKey("checkpoints.id", ondelete="CASCADE"), primary_key=True
    )
    purpose: Mapped[str] = mapped_column(String(64), primary_key=True)
    owner: Mapped[str] = mapped_column(String(300))
    expires_at: Mapped[datetime] = mapped_column()


class StoreMetaRow(Base):
    """One fact about the store this catalog belongs to (``store_id``, ``hot_tier``)."""

    __tablename__ = "store_meta"

    key: Mapped[str] = mapped_column(String(64), primary_key=True)
    value: Mapped[str] = mapped_column(Text)
    updated_at: Mapped[datetime] = mapped_column(default=utcnow, server_default=func.now())


class SnapshotAreaRow(Base):
    """Where one process of a run keeps its snapshots: one row per (run, host, rank).

    Written when the process creates its snapshot slots, never per snapshot: the slots'
    headers say which one is newest (``ops/writing/snapshot.py``, docs/SNAPSHOTS.md).
    """

    __tablename__ = "snapshot_areas"

    run_id: Mapped[int] = mapped_column(
        ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True
    )
    host: Mapped[str] = mapped_column(String(255), primary_key=True)
    rank: Mapped[int] = mapped_column(Integer, primary_key=True)
    uri: Mapped[str] = mapped_column(Text)
    slots: Mapped[int] = mapped_column(Integer)
    slot_bytes: Mapped[int] = mapped_column(BigInteger)
    updated_at: Mapped[datetime] = mapped_column(default=utcnow, server_default=func.now())


class RemoteRow(Base):
    """Another store this one pushes to and pulls from, named by its config file."""

    __tablename__ = "remotes"

    name: Mapped[str] = mapped_column(String(NAME_LEN), primary_key=True)
    config: Mapped[str] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(default=utcnow, server_default=func.now())


class MetricHistoryRow(Base):
    """One bucket of a run's training-metric series (the loss curve between checkpoints).

    A series keeps at most a bounded number of rows: every row of a series covers the steps
    ``[bucket_start, bucket_start + width)`` for the same power-of-two ``width``, and when a
    series would grow past its bound the width doubles and neighbouring buckets merge
    (``catalog/metric_history.py``). A bucket aggregates what was logged in it: count, sum, min, max
    and the last value, so a curve can be drawn as the mean with a min-max band and a spike
    never disappears in the downsampling.
    """

    __tablename__ = "metric_history"

    run_id: Mapped[int] = mapped_column(
        ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True
    )
    name: Mapped[str] = mapped_column(String(NAME_LEN), primary_key=True)
    bucket_start: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    width: Mapped[int] = mapped_column(BigInteger)
    step_first: Mapped[int] = mapped_column(BigInteger)
    step_last: Mapped[int] = mapped_column(BigInteger)
    count: Mapped[int] = mapped_column(BigInteger)
    total: Mapped[float] = mapped_column(Float)
    vmin: Mapped[float] = mapped_column(Float)
    vmax: Mapped[float] = mapped_column(Float)
    last: Mapped[float] = mapped_column(Float)


class ReplicaPartRow(Base):
    """One host's part of a parted checkpoint on one tier (``stored_on``: whose disk holds
    it; ``""`` on a tier every host reaches, such as S3: a primary-key column cannot be NULL).

    A save across hosts writes a few rows per host, never one per chunk, so the catalog work
    of a save grows with the hosts, not with the checkpoint's size.
    """

    __tablename__ = "replica_parts"
    __table_args__ = (
        # What a host's agent asks: the parts its own disk holds.
        Index("ix_replica_parts_stored_on_tier_state", "stored_on", "tier", "state"),
    )

    checkpoint_id: Mapped[str] = mapped_column(
        ForeignKey("checkpoints.id", ondelete="CASCADE"), primary_key=True
    )
    tier: Mapped[str] = mapped_column(String(64), primary_key=True)
    part_host: Mapped[str] = mapped_column(String(255), primary_key=True)
    stored_on: Mapped[str] = mapped_column(String(255), primary_key=True)
    state: Mapped[ReplicaState] = mapped_column(_state_enum(ReplicaState, "replica_state"))
    bytes: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")
    files: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    verified_at: Mapped[datetime | None] = mapped_column()
    updated_at: Mapped[datetime] = mapped_column(default=utcnow, server_default=func.now())


class HostRow(Base):
    """A host the catalog has heard from: agents' heartbeats and savers (``ckpt doctor``
    reports parts held by hosts silent for longer than ``host_timeout_s``)."""

    __tablename__ = "hosts"

    name: Mapped[str] = mapped_column(String(255), primary_key=True)
    first_seen: Mapped[datetime] = mapped_column(default=utcnow, server_default=func.now())
    last_seen: Mapped[datetime] = mapped_column(default=utcnow, server_default=func.now())
    role: Mapped[str] = mapped_column(String(32), default="", server_default="")


class CheckpointManifestRow(Base):
    """The manifest bytes of a parted checkpoint, and which ranks wrote each host's part.

    No disk every host reaches holds the manifest, so any host reads it from here (checked
    against ``digest``, the checkpoint's manifest digest) to materialise its part's
    ``manifest.json`` and commit marker, or to load.
    """

    __tablename__ = "checkpoint_manifests"

    checkpoint_id: Mapped[str] = mapped_column(
        ForeignKey("checkpoints.id", ondelete="CASCADE"), primary_key=True
    )
    digest: Mapped[str] = mapped_column(String(128))
    data: Mapped[bytes] = mapped_column(LargeBinary)
    # {part host: [ranks]}: the ranks whose files make up each part.
    parts: Mapped[dict[str, Any]] = mapped_column(JSON)


class ThawRow(Base):
    """The thaw of one archival copy (S3 GLACIER): requested when, ready when, done or not.

    Written by ``ops/tiering/thaw.py``; retention keeps every copy of a checkpoint whose thaw is
    PENDING (``ops/tiering/retention/plan.py``).
    """

    __tablename__ = "thaws"

    checkpoint_id: Mapped[str] = mapped_column(
        ForeignKey("checkpoints.id", ondelete="CASCADE"), primary_key=True
    )
    tier: Mapped[str] = mapped_column(String(64), primary_key=True)
    state: Mapped[str] = mapped_column(String(16))
    retrieval: Mapped[str] = mapped_column(String(16))
    objects: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    requested_at: Mapped[datetime] = mapped_column()
    expected_ready_at: Mapped[datetime] = mapped_column()
    updated_at: Mapped[datetime] = mapped_column(default=utcnow, server_default=func.now())


class RunContextRow(Base):
    """What made a run's checkpoints from ``from_version`` on: code, command, environment.

    One row per distinct context (``digest``) a run was saved under: the first save of the
    run records one, and a save whose context differs from the run's newest (a new process
    resuming it with another commit, config or environment) records the next. The context
    of a checkpoint is the run's row with the highest ``from_version`` not above its version
    (:mod:`ckptstore.catalog.contexts`).
    """

    __tablename__ = "run_contexts"
    __table_args__ = (Index("ix_run_contexts_run_id_from_version", "run_id", "from_version"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"))
    from_version: Mapped[int] = mapped_column(Integer)
    digest: Mapped[str] = mapped_column(String(128))
    document: Mapped[dict[str, Any]] = mapped_column(JSON)
    created_at: Mapped[datetime] = mapped_column(default=utcnow, server_default=func.now())


class ContextBlobRow(Base):
    """A content-addressed blob a context names: the uncommitted change, a package lock.

    Stored once per distinct content (``digest`` = ``b3:<blake3 hex>`` of ``data``) and
    checked against the digest on every read, like a chunk.
    """

    __tablename__ = "context_blobs"

    digest: Mapped[str] = mapped_column(String(128), primary_key=True)
    size: Mapped[int] = mapped_column(BigInteger)
    data: Mapped[bytes] = mapped_column(LargeBinary)
    created_at: Mapped[datetime] = mapped_column(default=utcnow, server_default=func.now())
