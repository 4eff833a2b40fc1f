"""Thawing a copy in an archival S3 storage class (GLACIER, DEEP_ARCHIVE).

Objects in those classes cannot be read until S3 has restored them (RestoreObject), which
takes minutes to hours. When a restore finds no readable copy but an archival one
(``ops/tiering/restore.py``), :func:`thawed_source` asks S3 to restore every object of that copy
(its own files and the chunks it reads from other checkpoints), records the thaw in the
catalog (``catalog/thaws.py``) and raises :class:`~ckptstore.errors.ThawPendingError` saying
when it should be ready. Once every object is readable the same call returns a readable view
of the tier, and the restore copies and verifies from it as from any other tier.
:func:`ckptstore.ops.tiering.thaw_poll.complete_thaw` polls until then and restores.

A sealed copy (an encrypted tier, ``[tiers] encrypt_to``) is thawed the same way: its
manifest is encrypted, but the objects to restore are known without a key, every object
under its ``.sealed/<copy id>/`` prefix (the envelope, which stays in the default class,
is readable already). Before anything is asked of S3, the key that will decrypt it
(``key``, ``$CKPT_DECRYPT_KEY``, ``decrypt_key``) is checked against the envelope
(:func:`~ckptstore.ops.tiering.sealed_tier.check_recipient`): a missing or wrong key is a
``DecryptionError`` now, not after hours of thawing. Once thawed, the restore decrypts and
checks the copy as it does any sealed copy.

Retention keeps every copy of a checkpoint whose thaw is PENDING
(``ops/tiering/retention/plan.py``, ``ops/tiering/retention/apply.py``).
"""

from __future__ import annotations

import logging
import os
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime, timedelta

from ckptstore.core import StoreCore
from ckptstore.errors import ThawPendingError
from ckptstore.ops.tiering.replicas import manifest_on, run_resolver, store_tiers
from ckptstore.ops.tiering.sealed_tier import check_recipient, sealed_prefix
from ckptstore.records import Checkpoint, ReplicaState, Thaw, ThawState
from ckptstore.storage import foreign_chunks
from ckptstore.storage.s3 import RestoreState, S3Tier

__all__ = [
    "EXPECTED_HOURS",
    "archival_copy",
    "request_thaw",
    "thaw_error",
    "thaw_keys",
    "thaw_status",
    "thawed_source",
]

logger = logging.getLogger(__name__)

#: Hours S3 documents as the longest wait per (storage class, retrieval tier); the
#: expected ready time is the request time plus this. DEEP_ARCHIVE has no Expedited tier:
#: such requests are sent as Standard.
EXPECTED_HOURS: dict[tuple[str, str], float] = {
    ("GLACIER", "Expedited"): 5 / 60,
    ("GLACIER", "Standard"): 5.0,
    ("GLACIER", "Bulk"): 12.0,
    ("DEEP_ARCHIVE", "Standard"): 12.0,
    ("DEEP_ARCHIVE", "Bulk"): 48.0,
}

# HEAD and RestoreObject requests are small and latency-bound: a few in flight at once.
_THREADS = 8


def archival_copy(core: StoreCore, ck: Checkpoint) -> S3Tier | None:
    """The configured archival tier holding a PRESENT copy of ``ck``, if any."""
    tiers = store_tiers(core)
    for replica in ck.replicas:
        tier = tiers.get(replica.tier)
        if (replica.state == ReplicaState.PRESENT and isinstance(tier, S3Tier)
                and not tier.readable):
            return tier
    return None


def thaw_keys(core: StoreCore, ck: Checkpoint, tier: S3Tier) -> list[str]:
    """Every object a restore of ``ck`` reads from ``tier``: its own files and the chunks it
    reads from other checkpoints (dedup, delta bases); for a sealed copy, every object under
    its prefix (self-contained: it reads nothing else, and its manifest is encrypted)."""
    replica = ck.replica(tier.name)
    if replica is not None and replica.sealed:
        return sorted(tier.list_prefix(sealed_prefix(replica.sealed)))
    # The manifest is always in the default class (storage/s3.py), so it can be read now.
    manifest = manifest_on(tier, ck)
    run_of = run_resolver(core, ck)
    keys = set(tier.list_prefix(tier.prefix_for(ck.run, ck.id)))
    for owner, refs in foreign_chunks(manifest).items():
        keys.update(tier.key_for(run_of(owner), owner, r.rel) for r in refs)
    return sorted(keys)


def thaw_status(core: StoreCore, ck: Checkpoint, tier: S3Tier) -> Counter[RestoreState]:
    """How many objects of the copy on ``tier`` are in each :class:`RestoreState`."""
    keys = thaw_keys(core, ck, tier)
    with ThreadPoolExecutor(max_workers=_THREADS, thread_name_prefix="ckpt-thaw") as pool:
        return Counter(pool.map(tier.restore_state, keys))


def _ready(status: Counter[RestoreState]) -> bool:
    return status[RestoreState.ARCHIVED] == 0 and status[RestoreState.ONGOING] == 0


def request_thaw(core: StoreCore, ck: Checkpoint, tier: S3Tier) -> Thaw:
    """Ask S3 to restore every archived object of the copy on ``tier``; record the thaw.

    Objects already readable or being restored are not asked again.

    Returns:
        The recorded (PENDING) thaw.

    Raises:
        StorageError: If S3 refuses a request.
    """
    settings = core.settings
    storage_class = tier.storage_class or "GLACIER"
    retrieval = settings.cold_restore_tier
    if storage_class == "DEEP_ARCHIVE" and retrieval == "Expedited":
        retrieval = "Standard"
    keys = thaw_keys(core, ck, tier)
    with ThreadPoolExecutor(max_workers=_THREADS, thread_name_prefix="ckpt-thaw") as pool:
        states = list(pool.map(tier.restore_state, keys))
        wanted = [k for k, st in zip(keys, states, strict=True) if st == RestoreState.ARCHIVED]
        list(pool.map(lambda k: tier.request_restore(k, days=settings.cold_restore_days,
                                                     retrieval=retrieval), wanted))
    hours = EXPECTED_HOURS.get((storage_class, retrieval), 12.0)
    thaw = core.catalog.record_thaw(
        ck.id, tier.name, retrieval=retrieval, objects=len(wanted),
        expected_ready_at=datetime.now(UTC) + timedelta(hours=hours),
    )
    core.catalog.record_event(
        "thaw_requested", checkpoint_id=ck.id,
        detail={"tier": tier.name, "retrieval": retrieval, "objects": len(wanted),
                "expected_ready_at": thaw.expected_ready_at.isoformat()},
    )
    logger.info("asked S3 to restore %d object(s) of %s (%s) on %s (%s); expected ready by %s",
                len(wanted), ck.ref, ck.id, tier.name, retrieval, thaw.expected_ready_at)
    return thaw


def thaw_error(ck: Checkpoint, thaw: Thaw) -> ThawPendingError:
    """The error a load, restore or prefetch of a thawing checkpoint raises."""
    left = max((thaw.expected_ready_at - datetime.now(UTC)).total_seconds(), 0.0)
    hours = left / 3600
    when = f"~{hours:.0f} h" if hours >= 1 else f"~{max(left / 60, 1):.0f} min"
    return ThawPendingError(
        f"{ck.ref} ({ck.id}) is thawing, expected ready in {when}: its only copy is in an "
        f"archival storage class on the {thaw.tier} tier and S3 is restoring its "
        f"{thaw.objects} object(s) ({thaw.retrieval} retrieval, requested "
        f"{thaw.requested_at:%Y-%m-%d %H:%M} UTC); retry then, or run "
        f"`ckpt thaw {ck.id} --wait` to restore it as soon as it is readable",
        checkpoint_id=ck.id, tier=thaw.tier, ready_in_s=left,
    )


def thawed_source(core: StoreCore, ck: Checkpoint, *, check: bool = False,
                  key: str | os.PathLike[str] | None = None) -> S3Tier | None:
    """A readable view of ``ck``'s archival copy once it has thawed; None without one.

    The first call asks S3 to restore the copy and raises. Later calls before the expected
    ready time raise again without asking S3 anything (unless ``check``); after it, they
    look at every object and return the view once all are readable. A sealed copy is first
    checked to open with ``key`` (default ``$CKPT_DECRYPT_KEY``, else ``decrypt_key``).

    Args:
        core: The open store.
        ck: The checkpoint.
        check: Look at the objects even before the expected ready time (the poll does).
        key: Private key that will decrypt a sealed copy.

    Raises:
        ThawPendingError: While the objects are not all readable.
        DecryptionError: If the copy is sealed and no key, or a key it was not encrypted
            to, was given (nothing is asked of S3).
        ConfigError: If that key file is not an X25519 private key.
        StorageError: If S3 fails.
    """
    tier = archival_copy(core, ck)
    if tier is None:
        return None
    replica = ck.replica(tier.name)
    if replica is not None and replica.sealed:
        check_recipient(core, ck, tier, key)
    thaw = core.catalog.get_thaw(ck.id, tier.name)
    now = datetime.now(UTC)
    if thaw is not None and thaw.state == ThawState.PENDING and not check \
            and now < thaw.expected_ready_at:
        raise thaw_error(ck, thaw)
    status = thaw_status(core, ck, tier)
    if _ready(status):
        if thaw is not None and thaw.state == ThawState.PENDING and now < thaw.expected_ready_at:
            # Earlier than S3 promised: say so, or the next restore would wait for the time.
            core.catalog.thaw_ready(ck.id, tier.name)
        return tier.thawed()
    if thaw is None or thaw.state != ThawState.PENDING or status[RestoreState.ARCHIVED]:
        # Never asked, asked for an earlier restore that has since been copied, or restored
        # copies that S3 archived again (they expire after cold_restore_days): ask now.
        thaw = request_thaw(core, ck, tier)
    raise thaw_error(ck, thaw)
