"""Plain records that the catalog returns and the public API hands to users.

They are frozen dataclasses with no database session attached, so they can be passed between
threads, pickled by Prefect for task results, and printed by the CLI.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

__all__ = [
    "SEALED_DIR",
    "TIER_ORDER",
    "sealed_copy_id",
    "Checkpoint",
    "CheckpointState",
    "Event",
    "HostInfo",
    "Lease",
    "MetricPoint",
    "PartSpec",
    "Replica",
    "ReplicaPart",
    "ReplicaState",
    "RunContext",
    "RunInfo",
    "Thaw",
    "ThawState",
    "UsageRow",
    "checkpoint_dict",
    "expected_digest",
]


#: The standard tiers from fastest to slowest. A copy moves down this list (archive, demote,
#: retention) and restore reads from the first tier holding a good copy.
TIER_ORDER: tuple[str, ...] = ("hot", "warm", "cold")


class CheckpointState(enum.StrEnum):
    """Life cycle of a checkpoint row: PENDING → COMMITTED → DELETING → DELETED, or FAILED."""

    PENDING = "PENDING"
    COMMITTED = "COMMITTED"
    DELETING = "DELETING"
    DELETED = "DELETED"
    FAILED = "FAILED"


class ReplicaState(enum.StrEnum):
    """Life cycle of one copy of a checkpoint on one tier."""

    COPYING = "COPYING"
    PRESENT = "PRESENT"
    DELETING = "DELETING"
    DELETED = "DELETED"
    DAMAGED = "DAMAGED"


#: Tier prefix of sealed (encrypted) copies: never a run name (run names do not start with a
#: dot), so layouts, doctor and gc that walk runs never take it for one.
SEALED_DIR = ".sealed"
_SEALED_ID_LEN = 32


def sealed_copy_id(uri: str) -> str | None:
    """The copy id of a replica URI that names a sealed copy (``.../.sealed/<32 hex>``)."""
    head, sep, copy_id = uri.rstrip("/").rpartition("/")
    if not sep or (not head.endswith("/" + SEALED_DIR) and head != SEALED_DIR):
        return None
    if len(copy_id) != _SEALED_ID_LEN or not all(c in "0123456789abcdef" for c in copy_id):
        return None
    return copy_id


@dataclass(frozen=True)
class Replica:
    """One copy of a checkpoint on one storage tier.

    Attributes:
        tier: Tier name.
        uri: Where the copy lives.
        state: Its life-cycle state.
        bytes: Bytes the copy occupies.
        verified_at: When it was last checked intact.
        manifest_digest: Digest of the manifest this copy holds when it differs from the
            checkpoint's own (a copy re-encoded with the archive codec, see
            :mod:`ckptstore.ops.tiering.reencode`); None when the copy holds the checkpoint's own
            manifest. Use :func:`expected_digest` rather than reading this directly.
    """

    tier: str
    uri: str
    state: ReplicaState
    bytes: int = 0
    verified_at: datetime | None = None
    manifest_digest: str | None = None

    @property
    def sealed(self) -> str | None:
        """The copy id when this copy is sealed (encrypted, ``[tiers] encrypt_to``), else
        None: its files are then ciphertext objects under ``.sealed/<copy id>/`` on the
        tier, not a checkpoint directory (:mod:`ckptstore.ops.tiering.sealed_tier`)."""
        return sealed_copy_id(self.uri)


@dataclass(frozen=True)
class ReplicaPart:
    """One host's part of a parted checkpoint (see :attr:`Checkpoint.hosts`) on one tier.

    A distributed save across hosts writes every rank's shards to the hot tier of the rank's
    own host: the checkpoint's hot copy is then one part per host, each on its own disk. The
    warm copy is assembled part by part (each host uploads its own) and is complete only when
    every part is in; the aggregate :class:`Replica` of the tier says so.

    Attributes:
        tier: Tier name.
        part: The host whose ranks wrote the files of this part.
        stored_on: The host whose disk holds this copy (the part's own host, or a peer that
            keeps a replica of it); None on a tier every host reaches (S3).
        state: Its life-cycle state.
        bytes: Bytes of its files.
        files: Number of its files.
        verified_at: When it was last checked intact.
    """

    tier: str
    part: str
    stored_on: str | None
    state: ReplicaState
    bytes: int = 0
    files: int = 0
    verified_at: datetime | None = None


@dataclass(frozen=True)
class PartSpec:
    """What one host's ranks wrote in a parted save, recorded at its commit.

    Attributes:
        host: The host.
        ranks: Its ranks in the save's process group.
        files: Files of its part.
        bytes: Bytes of its part.
    """

    host: str
    ranks: tuple[int, ...]
    files: int
    bytes: int


@dataclass(frozen=True)
class HostInfo:
    """A host the catalog has heard from (agents' heartbeats, savers).

    Attributes:
        name: Host name (``CKPT_HOST`` or the hostname).
        first_seen: First heartbeat.
        last_seen: Latest heartbeat.
        role: What last reported it (``agent``, ``saver``, ...).
    """

    name: str
    first_seen: datetime
    last_seen: datetime
    role: str = ""


@dataclass(frozen=True)
class Checkpoint:
    """A catalogued checkpoint (one version of one step of one run)."""

    id: str
    run: str
    step: int
    version: int
    state: CheckpointState
    created_at: datetime
    kind: str = "full"
    base_id: str | None = None
    parent_id: str | None = None
    experiment: str | None = None
    committed_at: datetime | None = None
    metrics: dict[str, float] = field(default_factory=dict)
    tags: tuple[str, ...] = ()
    logical_bytes: int = 0
    stored_bytes: int = 0
    codec: str = "none"
    manifest_digest: str | None = None
    lossy: bool = False
    error_bound: float | None = None
    lossy_scope: tuple[str, ...] = ()  # key patterns of the approximately stored tensors
    pinned: bool = False
    aliases: tuple[str, ...] = ()
    replicas: tuple[Replica, ...] = ()
    writer: str | None = None  # "host:pid" of the saving process; gc uses it to spot dead saves
    # Hosts whose ranks wrote a distributed checkpoint, sorted, when its hot copy is split in
    # parts (one per host: a save across hosts, or straight to object storage); () when one
    # directory holds it all. See ReplicaPart.
    hosts: tuple[str, ...] = ()

    @property
    def parted(self) -> bool:
        """Whether the checkpoint's copies are tracked per host part (:class:`ReplicaPart`)."""
        return bool(self.hosts)

    @property
    def ref(self) -> str:
        """A human reference that resolves to exactly this checkpoint (``run@v<version>``)."""
        return f"{self.run}@v{self.version}"

    @property
    def tiers(self) -> tuple[str, ...]:
        """Tiers holding a PRESENT replica, in the order the catalog returned them."""
        return tuple(r.tier for r in self.replicas if r.state == ReplicaState.PRESENT)

    def replica(self, tier: str) -> Replica | None:
        """The replica on ``tier``, or None."""
        for r in self.replicas:
            if r.tier == tier:
                return r
        return None


def expected_digest(ck: Checkpoint, tier: str) -> str | None:
    """The manifest digest the copy of ``ck`` on ``tier`` must have.

    The replica's own digest when it holds another manifest (a re-encoded copy), else the
    checkpoint's. Every read of a manifest from a tier is checked against this value; None
    only for a checkpoint that was never committed.
    """
    replica = ck.replica(tier)
    if replica is not None and replica.manifest_digest is not None:
        return replica.manifest_digest
    return ck.manifest_digest


@dataclass(frozen=True)
class RunInfo:
    """A training run and what is needed to reproduce it."""

    name: str
    created_at: datetime
    experiment: str | None = None
    config: dict[str, Any] = field(default_factory=dict)
    code_version: str | None = None
    data_version: str | None = None
    host: str | None = None
    status: str = "active"
    checkpoints: int = 0


@dataclass(frozen=True)
class Event:
    """One audit-log entry: saved, archived, pruned, restored, converted, verified, ..."""

    kind: str
    at: datetime
    checkpoint_id: str | None = None
    actor: str | None = None
    detail: dict[str, Any] = field(default_factory=dict)
    run: str | None = None


@dataclass(frozen=True)
class MetricPoint:
    """One point of a run's metric history: what was logged in a span of steps.

    A stored series is downsampled (see ``catalog/metric_history.py``), so a point may stand for
    many logged values; ``count == 1`` is a single logged value.

    Attributes:
        step_first: First step logged in the span.
        step_last: Last step logged in the span.
        count: How many values were logged in it.
        mean: Their mean.
        min: The smallest of them (a dip never disappears in the downsampling).
        max: The largest of them (nor does a spike).
        last: The value logged at ``step_last``.
    """

    step_first: int
    step_last: int
    count: int
    mean: float
    min: float
    max: float
    last: float


@dataclass(frozen=True)
class Lease:
    """A flow's time-limited claim on a checkpoint for one purpose.

    Attributes:
        checkpoint_id: The leased checkpoint.
        purpose: What the lease is for (``retention``, ``archive:warm``, ``restore:hot``...).
        owner: Who holds it (``host:pid:...`` of the holding process, or a flow run id).
        expires_at: When it lapses unless its owner renews it (UTC).
    """

    checkpoint_id: str
    purpose: str
    owner: str
    expires_at: datetime


class ThawState(enum.StrEnum):
    """Life cycle of the thaw of one archival (S3 GLACIER) copy: PENDING → DONE."""

    PENDING = "PENDING"
    """Restore requests went out; the objects are not all readable yet, or not yet copied."""
    DONE = "DONE"
    """The thawed objects were copied to the hot tier and verified (a checkpoint saved
    across hosts: they are readable and its parts are read from them in place)."""


@dataclass(frozen=True)
class Thaw:
    """The restore request (S3 RestoreObject) of every object of one archival copy.

    Attributes:
        checkpoint_id: The checkpoint whose copy is thawed.
        tier: The archival tier holding the copy (``cold``).
        state: PENDING until the copy has been restored to the hot tier.
        retrieval: The S3 retrieval tier asked for (``Expedited``, ``Standard``, ``Bulk``).
        objects: How many objects were asked to be restored.
        requested_at: When the requests went out (UTC).
        expected_ready_at: When S3 is expected to have the objects readable (UTC).
        updated_at: Last change of the row (UTC).
    """

    checkpoint_id: str
    tier: str
    state: ThawState
    retrieval: str
    objects: int
    requested_at: datetime
    expected_ready_at: datetime
    updated_at: datetime


@dataclass(frozen=True)
class UsageRow:
    """Storage accounting for one run on one tier."""

    run: str
    tier: str
    checkpoints: int
    bytes: int


@dataclass(frozen=True)
class RunContext:
    """What made a run's checkpoints from ``from_version`` on (:mod:`ckptstore.capture`).

    ``document`` holds ``code`` (commit, branch, remote, dirty, the change's digest),
    ``command``, ``environment`` (with the lock's digest), ``config``, ``data_version``,
    ``seeds``, ``world_size`` and ``notes`` (what could not be read, and why).
    """

    run: str
    from_version: int
    digest: str
    document: dict[str, Any]
    created_at: datetime


def checkpoint_dict(ck: Checkpoint) -> dict[str, Any]:
    """A checkpoint's catalog record as a JSON-able dict (replicas included)."""
    return {
        "id": ck.id,
        "ref": ck.ref,
        "run": ck.run,
        "step": ck.step,
        "version": ck.version,
        "state": str(ck.state),
        "kind": ck.kind,
        "base_id": ck.base_id,
        "parent_id": ck.parent_id,
        "created_at": ck.created_at.isoformat(),
        "metrics": dict(ck.metrics),
        "tags": list(ck.tags),
        "logical_bytes": ck.logical_bytes,
        "stored_bytes": ck.stored_bytes,
        "codec": ck.codec,
        "manifest_digest": ck.manifest_digest,
        "lossy": ck.lossy,
        "error_bound": ck.error_bound,
        "lossy_scope": list(ck.lossy_scope),
        "pinned": ck.pinned,
        "aliases": list(ck.aliases),
        "hosts": list(ck.hosts),
        "replicas": [
            {
                "tier": r.tier,
                "state": str(r.state),
                "bytes": r.bytes,
                "verified_at": r.verified_at.isoformat() if r.verified_at else None,
                "manifest_digest": r.manifest_digest,
            }
            for r in ck.replicas
        ],
    }
