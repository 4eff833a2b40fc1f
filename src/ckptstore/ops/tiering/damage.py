"""Bookkeeping of a copy found damaged by a read: mark it DAMAGED and say so in the audit log.

Reads (loads, exports, restores) find damage as they go; the scrub
(:mod:`ckptstore.ops.upkeep.verify`) finds it on schedule. Either way the copy becomes
DAMAGED, which takes it out of every read and restore plan until a repair (``ckpt verify``,
or a restore over it) makes it PRESENT again, and a ``damaged`` event records who found
what.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from ckptstore.core import StoreCore
from ckptstore.ops.tiering.replicas import store_tiers
from ckptstore.records import Checkpoint, Replica, ReplicaState

__all__ = ["mark_damaged", "other_copies"]

logger = logging.getLogger(__name__)

#: Problems recorded per event, and characters per problem.
_MAX_PROBLEMS = 20
_MAX_CHARS = 1000


def other_copies(core: StoreCore, ck: Checkpoint, tier: str) -> list[str]:
    """The tiers other than ``tier`` that hold a verified (PRESENT) copy this store can use,
    archival ones (GLACIER: readable after a thaw) included."""
    tiers = store_tiers(core)
    return [r.tier for r in ck.replicas
            if r.tier != tier and r.state == ReplicaState.PRESENT and r.tier in tiers]


def mark_damaged(core: StoreCore, ck: Checkpoint, tier: str, problems: Sequence[str], *,
                 found_by: str, seen: Replica | None = None) -> bool:
    """Mark the copy of ``ck`` on ``tier`` DAMAGED and record a ``damaged`` event.

    Args:
        core: The open store.
        ck: The checkpoint.
        tier: The tier of the damaged copy.
        problems: What was found (each names the file; the first few are recorded).
        found_by: What found it (``load``, ``export``, ``restore``, ...), for the audit log.
        seen: The replica as the reader saw it before reading. When the catalog's replica
            no longer matches it (retention took the copy away, or a restore already put a
            new one there), the damage found belongs to a copy that is gone: nothing is
            marked.

    Returns:
        True when the copy was marked (or already was DAMAGED).
    """
    now = core.catalog.get_any(ck.id).replica(tier)
    if now is None or now.state not in (ReplicaState.PRESENT, ReplicaState.DAMAGED):
        return False
    if seen is not None and now.state == ReplicaState.PRESENT and (
            seen.state != ReplicaState.PRESENT or seen.verified_at != now.verified_at):
        return False
    if now.state == ReplicaState.DAMAGED:
        return True  # another reader (or the scrub) found it first, and recorded it
    core.catalog.set_replica(ck.id, tier, state=ReplicaState.DAMAGED)
    core.catalog.record_event(
        "damaged", checkpoint_id=ck.id,
        detail={"tier": tier, "found_by": found_by,
                "problems": [p[:_MAX_CHARS] for p in problems[:_MAX_PROBLEMS]]},
    )
    logger.warning("the %s copy of %s is damaged (found by %s): %s", tier, ck.ref, found_by,
                   problems[0] if problems else "?")
    return True
