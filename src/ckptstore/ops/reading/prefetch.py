"""Prefetch: bring a checkpoint to this host's fast tier ahead of need, and keep it there.

:func:`prefetch_checkpoint` restores a checkpoint to the hot tier (from the fastest verified
copy: warm, cold, another host's part; a GLACIER-only copy is thawed first, see
``ops/tiering/thaw.py``) or further into the memory tier, verified like any restore, and takes a
catalog lease ``prefetch:<host>`` that expires after ``hold_s``: retention skips a leased
checkpoint (``ops/tiering/retention/plan.py``), so the copy is still there when the job starts.

The first load of that checkpoint on this host counts a prefetch *hit* and gives the lease
back (:func:`note_load`, called by ``ops/reading/load.py``); a load that had to fetch a copy first
counts a *miss*. Bytes moved ahead of need are the ``prefetch`` operation's transferred
bytes in the metrics recorder.

:func:`send_prefetch` asks another host to do it, on that host's Prefect work queue (served
by ``ckpt agent`` there, docs/MULTINODE.md), as archiving the parts of a checkpoint does.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, Literal

from ckptstore.core import StoreCore
from ckptstore.errors import ConfigError, InvalidNameError
from ckptstore.format import read_manifest
from ckptstore.identity import host
from ckptstore.ops.leases import acquire_lease, lease_owner
from ckptstore.ops.tiering.restore import hot_digest, restore_checkpoint
from ckptstore.records import Checkpoint, Event, ReplicaState

__all__ = [
    "DEFAULT_HOLD_S",
    "PREFETCH_EVENTS",
    "HostPrefetch",
    "PrefetchResult",
    "note_load",
    "prefetch_by_host",
    "prefetch_checkpoint",
    "prefetch_purpose",
    "send_prefetch",
]

logger = logging.getLogger(__name__)

#: Catalog event kinds of prefetching: a copy brought ahead of need, and a load that found
#: it there (hit) or had to fetch on demand (miss). Recorded in the catalog (not only in the
#: process's counters) so the UI and reports see every host's figures.
PREFETCH_EVENTS = ("prefetched", "prefetch_hit", "prefetch_miss")

#: How long a prefetched copy is protected from retention when nobody loads it.
DEFAULT_HOLD_S = 6 * 3600.0

Destination = Literal["hot", "memory"]


def prefetch_purpose(on_host: str | None = None) -> str:
    """The lease purpose of prefetches for ``on_host`` (default: this host).

    Per host: on node-local hot tiers each host prefetches into its own disk.
    """
    return f"prefetch:{on_host or host()}"


@dataclass(frozen=True)
class PrefetchResult:
    """What one prefetch did.

    Attributes:
        checkpoint_id: The checkpoint.
        ref: Its ``run@v<version>``.
        to: ``hot`` or ``memory``.
        host: The host whose fast tier now holds it.
        path: The hot directory (also for ``memory``: the memory copy is made from it).
        bytes_moved: Bytes copied ahead of need (0 when it was already there).
        lease_owner: Owner of the ``prefetch:<host>`` lease.
        lease_expires_at: When that lease lapses unless a load uses the copy first (UTC).
        seconds: Wall time.
    """

    checkpoint_id: str
    ref: str
    to: str
    host: str
    path: Path
    bytes_moved: int
    lease_owner: str
    lease_expires_at: datetime
    seconds: float

    def to_dict(self) -> dict[str, Any]:
        """JSON-able form (flow results, ``--json``)."""
        return {
            "checkpoint_id": self.checkpoint_id, "ref": self.ref, "to": self.to,
            "host": self.host, "path": str(self.path), "bytes_moved": self.bytes_moved,
            "lease_owner": self.lease_owner,
            "lease_expires_at": self.lease_expires_at.isoformat(), "seconds": self.seconds,
        }


def _check(to: str, hold_s: float) -> None:
    if to not in ("hot", "memory"):
        raise InvalidNameError(f"prefetch destination {to!r} is not 'hot' or 'memory'")
    if isinstance(hold_s, bool) or not isinstance(hold_s, int | float) \
            or not math.isfinite(hold_s) or hold_s <= 0:
        raise InvalidNameError(f"hold_s must be a positive number of seconds, not {hold_s!r}")


def _hot_present(ck: Checkpoint) -> bool:
    replica = ck.replica("hot")
    return replica is not None and replica.state == ReplicaState.PRESENT


def prefetch_checkpoint(
    core: StoreCore,
    ref: str,
    *,
    to: Destination = "hot",
    hold_s: float = DEFAULT_HOLD_S,
    owner: str | None = None,
) -> PrefetchResult:
    """Bring ``ref`` to this host's hot tier (and memory tier with ``to="memory"``), verified,
    under a ``prefetch:<host>`` lease that keeps retention away for ``hold_s`` seconds.

    Args:
        core: The open store.
        ref: Checkpoint reference.
        to: ``hot`` or ``memory`` (the memory tier must be configured).
        hold_s: Lifetime of the lease when no load uses the copy.
        owner: Lease owner (default: unique to this call).

    Returns:
        What was done.

    Raises:
        InvalidNameError: For a bad ``to`` or ``hold_s``.
        ConfigError: For ``to="memory"`` without a memory tier.
        CheckpointNotFoundError: If the reference does not resolve or no tier holds a copy.
        ThawPendingError: If the only copy is archival: its thaw was requested (the lease
            stays, so the copies are kept until the thaw is used).
        IntegrityError, StorageError: As :func:`~ckptstore.ops.tiering.restore.restore_checkpoint`.
    """
    _check(to, hold_s)
    memory = None
    if to == "memory":
        # Staging in memory reads the tensors; a prefetch to the hot tier copies files only,
        # without importing torch (a flow run on a worker: tests/cli/test_startup.py).
        from ckptstore.ops.writing.memory import memory_replica_here, memory_tier_for

        memory = memory_tier_for(core)
    if to == "memory" and memory is None:
        raise ConfigError(
            "prefetch --to memory needs the memory tier: set memory_tier_bytes "
            "(CKPT_MEMORY_TIER_BYTES) in the store's configuration"
        )
    ck = core.catalog.get(ref)
    actor = lease_owner(owner)
    purpose = prefetch_purpose()
    if not acquire_lease(core, ck.id, purpose, actor, hold_s):
        # Another prefetch for this host holds it; its lease protects the copy just as well.
        actor = core.catalog.lease_holder(ck.id, purpose) or actor
    expires = datetime.now(UTC) + timedelta(seconds=hold_s)
    started = time.perf_counter()
    moved = 0
    ok = False
    try:
        if memory is not None and memory_replica_here(ck):
            path = core.checkpoint_dir(ck.run, ck.id)
        else:
            if not _hot_present(ck):
                moved = ck.stored_bytes
            path = restore_checkpoint(core, ck.id)
            if memory is not None:
                current = core.catalog.get_any(ck.id)
                from ckptstore.format import read_checkpoint

                manifest = read_manifest(path, expected_digest=hot_digest(core, current))
                state = read_checkpoint(path, manifest, locate=core.locate,
                                        threads=core.settings.threads)
                memory.stage(current, state)
                moved += current.logical_bytes
        ok = True
    finally:
        seconds = time.perf_counter() - started
        core.metrics.observe("prefetch", seconds=seconds, bytes_transferred=moved,
                             run=ck.run, tier=to, step=ck.step, ok=ok)
    core.catalog.record_event(
        "prefetched", checkpoint_id=ck.id, actor=actor,
        detail={"to": to, "host": host(), "bytes": moved, "lease": purpose,
                "lease_expires_at": expires.isoformat()},
    )
    logger.info("prefetched %s (%s) to %s on %s: %d bytes moved", ck.ref, ck.id, to, host(),
                moved)
    return PrefetchResult(ck.id, ck.ref, to, host(), path, moved, actor, expires, seconds)


def note_load(core: StoreCore, ck: Checkpoint, *, ready: bool) -> None:
    """Count a load as a prefetch hit or miss and give a used prefetch lease back.

    Args:
        core: The open store.
        ck: The checkpoint being loaded.
        ready: Whether a copy on this host's fast tiers (hot or memory) existed before the
            load: a hit when a prefetch of this host put it there, a miss when not (the load
            fetches it on demand). A load of a checkpoint that was ready without a prefetch
            is neither.
    """
    leases = core.catalog.leases(checkpoint_ids=[ck.id], purpose=prefetch_purpose())
    if ready and not leases:
        return
    hit = ready and bool(leases)
    core.metrics.prefetch_outcome(hit=hit, run=ck.run)
    core.catalog.record_event("prefetch_hit" if hit else "prefetch_miss", checkpoint_id=ck.id,
                              detail={"host": host()})
    for lease in leases:
        # Used (or overtaken by the load): retention may treat it like any other copy now.
        core.catalog.release_lease(ck.id, lease.purpose, lease.owner)


@dataclass(frozen=True)
class HostPrefetch:
    """Prefetching on one host, from the catalog's events.

    Attributes:
        host: The host.
        prefetched: Copies brought to its fast tiers ahead of need.
        bytes_ahead: Bytes those prefetches moved.
        hits: Loads that found a prefetched copy there.
        misses: Loads that had to fetch on demand.
    """

    host: str
    prefetched: int
    bytes_ahead: int
    hits: int
    misses: int

    @property
    def hit_rate(self) -> float | None:
        """``hits / (hits + misses)``; None before any load counted."""
        loads = self.hits + self.misses
        return self.hits / loads if loads else None


def prefetch_by_host(events: list[Event]) -> list[HostPrefetch]:
    """Per host, what the prefetch events say (pure: the caller reads the events).

    Args:
        events: Events of the :data:`PREFETCH_EVENTS` kinds (others are ignored).

    Returns:
        One entry per host that has any, sorted by host.
    """
    counts: dict[str, dict[str, int]] = {}
    for event in events:
        if event.kind not in PREFETCH_EVENTS:
            continue
        name = str(event.detail.get("host") or "?")
        row = counts.setdefault(name, {"prefetched": 0, "bytes": 0, "hit": 0, "miss": 0})
        if event.kind == "prefetched":
            row["prefetched"] += 1
            moved = event.detail.get("bytes")
            row["bytes"] += moved if isinstance(moved, int) and moved > 0 else 0
        else:
            row[event.kind.removeprefix("prefetch_")] += 1
    return [HostPrefetch(name, c["prefetched"], c["bytes"], c["hit"], c["miss"])
            for name, c in sorted(counts.items())]


def send_prefetch(
    core: StoreCore,
    ref: str,
    on_host: str,
    *,
    to: Destination = "hot",
    hold_s: float = DEFAULT_HOLD_S,
) -> Checkpoint:
    """Ask ``on_host`` to prefetch ``ref``: a ``prefetch`` flow run on its work queue.

    Its ``ckpt agent`` runs it there (an embedded worker runs only its own host's work), so
    this needs a Prefect server, as archiving another host's part does.

    Returns:
        The resolved checkpoint.

    Raises:
        InvalidNameError: For a bad ``to``, ``hold_s`` or host name.
        CheckpointNotFoundError: If the reference does not resolve.
        ConfigError: If no flow launcher is installed.
    """
    _check(to, hold_s)
    if not on_host or any(c.isspace() for c in on_host) or len(on_host) > 255:
        raise InvalidNameError(f"host name {on_host!r} is not valid")
    ck = core.catalog.get(ref)
    config = str(core.settings.source) if core.settings.source else None
    core.launcher().launch(
        "prefetch", {"ref": ck.id, "to": to, "hold_s": hold_s},
        store_root=str(core.settings.root), config=config,
        idempotency_key=f"prefetch:{ck.id}:{on_host}:{to}", work_queue=on_host,
    )
    core.flows_launched = True
    core.catalog.record_event("prefetch_sent", checkpoint_id=ck.id,
                              detail={"host": on_host, "to": to})
    return ck
