"""Loading a committed checkpoint: from this host's memory tier, else the hot tier.

The dispatch, in order: resolve the reference (only COMMITTED checkpoints) → with
``require_signature``, check the signature before any tensor is read → this host's
shared-memory copy if the catalog lists one → otherwise the hot copy, restored first from the
fastest tier holding a verified copy when the hot tier has none → the reader of the copy's
layout (the regular packed layout, or the one of a checkpoint saved through DCP).

Loads take no lease: retention may remove the hot copy (a verified copy stays on another
tier) while a load reads it. Retention marks the copy DELETING before it removes a file, so
a read that finds files missing asks the catalog: when the hot copy is no longer PRESENT the
load re-plans (restores it again from the copy that stays, then reads that), a bounded number
of times; a checkpoint pruned whole meanwhile is CheckpointNotFoundError. A hot copy still
PRESENT and unchanged is real damage: it is marked DAMAGED and restored from the next
verified copy, then read again (read repair, :mod:`ckptstore.ops.tiering.readrepair`); with
no other verified copy its error, naming checkpoint, tensor and chunk, is raised as it is.
"""

from __future__ import annotations

import builtins
import logging
import os
import time
from collections.abc import Sequence
from typing import Any

from ckptstore.core import StoreCore
from ckptstore.errors import (
    CheckpointNotFoundError,
    IncompleteCheckpointError,
    IntegrityError,
    StorageError,
    ThawPendingError,
)
from ckptstore.format import Manifest, read_checkpoint, read_manifest, verify_checkpoint
from ckptstore.format.dcp import is_dcp_manifest, verify_dcp
from ckptstore.identity import host
from ckptstore.ops.reading.prefetch import note_load
from ckptstore.ops.sharing.signing import verify_signature
from ckptstore.ops.tiering.parts import parted_manifest, verify_parts_here
from ckptstore.ops.tiering.readrepair import is_repairable, read_repair
from ckptstore.ops.tiering.replicas import manifest_of
from ckptstore.ops.tiering.restore import ensure_hot, hot_digest
from ckptstore.ops.writing.memory import load_from_memory, memory_replica_here
from ckptstore.ops.writing.snapshot import read_snapshot, snapshots_here
from ckptstore.records import Checkpoint, CheckpointState, ReplicaState, expected_digest

__all__ = [
    "load_checkpoint",
    "load_latest_snapshot",
    "resume_from_snapshot",
    "read_any_manifest",
    "restore_latest",
    "snapshot_rank",
    "verify_hot",
]

logger = logging.getLogger(__name__)

#: Reads of a hot copy that retention took away meanwhile, re-planned before giving up.
_REPLANS = 3
_LATEST = "@latest"


def snapshot_rank() -> int:
    """This process's rank for snapshots: ``$RANK`` (torchrun), else 0."""
    raw = os.environ.get("RANK", "")
    return int(raw) if raw.isdigit() else 0


def load_latest_snapshot(
    core: StoreCore,
    run: str,
    durable_step: int | None,
    *,
    keys: Sequence[str] | None = None,
    into: Any | None = None,
    run_token: str | None = None,
) -> tuple[int, Any] | None:
    """The newest complete snapshot of ``run`` in this host's memory, if worth loading.

    A snapshot is taken when its step is at least the newest durable checkpoint's (at the
    same step it holds the same bytes, already in memory; see docs/SNAPSHOTS.md). A torn,
    damaged, or other-incarnation snapshot is skipped (logged), never returned.

    Args:
        core: The open store.
        run: Run name.
        durable_step: Step of the run's newest committed checkpoint (None: there is none).
        keys: fnmatch patterns, as :meth:`StoreCore.load`.
        into: A live state to fill in place.
        run_token: The run's creation time (ISO format) when the caller knows it (the
            manager does): a restart then reads its snapshot without a catalog query.

    Returns:
        ``(step, state)``, or None when the caller should load the durable checkpoint.
    """
    candidates = [found for found in snapshots_here(core, run, snapshot_rank())
                  if durable_step is None or found.step >= durable_step]
    if not candidates:
        return None
    token = run_token
    if token is None:
        try:
            token = core.catalog.get_run(run).created_at.isoformat()
        except CheckpointNotFoundError:
            return None
    for found in candidates:  # newest first; a damaged one gives way to the one before
        started = time.perf_counter()
        try:
            state = read_snapshot(found, run_token=token, keys=keys, into=into)
        except IntegrityError as exc:
            logger.warning("not using the snapshot of %s at step %s: %s", run, found.step, exc)
            continue
        logger.info("loaded %s at step %s from its snapshot in shared memory in %.3fs",
                    run, found.step, time.perf_counter() - started)
        return found.step, state
    return None


def resume_from_snapshot(
    core: StoreCore, run: str, run_token: str
) -> tuple[int, Any, Checkpoint | None] | None:
    """The run's newest snapshot on this host, when it is at least as new as the run's newest
    checkpoint: what an integration resumes "``<run>@latest``" from.

    Args:
        core: The open store.
        run: Run name.
        run_token: The run's creation time (ISO format): another incarnation's snapshot is
            never taken.

    Returns:
        ``(step, state, newest checkpoint or None)``: the checkpoint is what the next save
        continues (its parent), or None when no snapshot is worth loading.
    """
    try:
        durable: Checkpoint | None = core.catalog.latest(run)
    except CheckpointNotFoundError:
        durable = None
    # A torn, damaged or other-incarnation snapshot is skipped there, never returned.
    hit = load_latest_snapshot(core, run, durable.step if durable is not None else None,
                               run_token=run_token)
    if hit is None:
        return None
    return hit[0], hit[1], durable


def load_checkpoint(
    core: StoreCore,
    ref: str,
    *,
    keys: Sequence[str] | None = None,
    into: Any | None = None,
    require_signature: str | os.PathLike[str] | None = None,
) -> Any:
    """Load a committed checkpoint; see :meth:`ckptstore.store.CheckpointStore.load`.

    Raises:
        CheckpointNotFoundError: If the reference does not resolve.
        IncompleteCheckpointError: If it names a checkpoint that was never committed.
        IntegrityError: If any chunk or the manifest is damaged or missing and no other
            verified copy can be read instead, or the signature that ``require_signature``
            asks for is missing or wrong.
    """
    if ref.endswith(_LATEST) and require_signature is None:
        # A snapshot in this host's memory newer than the newest durable checkpoint wins
        # (ops/writing/snapshot.py); a signed load needs a catalogued checkpoint.
        run = ref[: -len(_LATEST)]
        try:
            newest: Checkpoint | None = core.catalog.get(ref)
        except CheckpointNotFoundError:
            newest = None
        snap = load_latest_snapshot(core, run, newest.step if newest is not None else None,
                                    keys=keys, into=into)
        if snap is not None:
            return snap[1]
        ck = newest if newest is not None else core.catalog.get(ref)  # raises the not-found
    else:
        ck = core.catalog.get(ref)
    if ck.parted:
        # Saved across hosts: each part is read from its best copy, none is restored whole.
        if require_signature is not None:
            verify_signature(core, ck.id, require_signature)
        with core.metrics.timed("load", run=ck.run, tier="hot", step=ck.step,
                                blocking=True) as timer:
            from ckptstore.ops.dcp import load_parted  # here: see load_dcp's import below

            state = load_parted(core, ck, keys=keys, into=into)
            timer.add(bytes_logical=ck.logical_bytes, bytes_stored=ck.stored_bytes)
        return state
    if require_signature is not None:
        # Before any tensor is read: nothing unvouched reaches the caller. A checkpoint only
        # an archive tier holds is restored first, so the copy that will be read (possibly
        # re-encoded, with a digest the catalog alone vouches for) is the one checked
        # against the signed digest.
        if not memory_replica_here(ck):
            ensure_hot(core, ck)
        verify_signature(core, ck.id, require_signature)
    in_memory = memory_replica_here(ck)
    hot = ck.replica("hot")
    # Prefetch hit / miss accounting, and a used prefetch lease goes back (ops/reading/prefetch.py).
    note_load(core, ck, ready=in_memory or (hot is not None
                                            and hot.state == ReplicaState.PRESENT))
    with core.metrics.timed("load", run=ck.run, tier="memory" if in_memory else "hot",
                            step=ck.step, blocking=True) as timer:
        if in_memory:
            # This host's shared-memory copy (a restart after a crash): no disk reads. A
            # vanished or damaged copy is marked so, and the hot tier is used.
            hit, state = load_from_memory(core, ck, keys=keys, into=into)
            if hit:
                timer.add(bytes_logical=ck.logical_bytes, bytes_stored=ck.logical_bytes)
                return state
        repaired = False
        for attempt in range(_REPLANS + 1):
            try:
                state, manifest = _load_hot(core, ck, keys=keys, into=into)
                break
            except ThawPendingError:
                raise  # the only copy is thawing: nothing to re-plan until it is readable
            except (CheckpointNotFoundError, IncompleteCheckpointError, IntegrityError,
                    StorageError) as exc:
                if attempt == _REPLANS:
                    raise
                if _hot_copy_changed(core, ck, exc):
                    logger.info("loading %s: its hot copy was pruned meanwhile (%s); loading "
                                "from the copy that stays", ck.ref, exc)
                elif repaired or not is_repairable(exc):
                    raise
                else:
                    # The hot copy is damaged: read it again once restored from the next
                    # verified copy over it (ops/tiering/readrepair.py); ``into`` is filled
                    # again whole.
                    read_repair(core, ck, exc, found_by="load")
                    repaired = True
                ck = core.catalog.get_any(ck.id)  # the hot copy as it is now
        timer.add(bytes_logical=manifest.logical_bytes, bytes_stored=manifest.stored_bytes)
    return state


def _load_hot(core: StoreCore, ck: Checkpoint, *, keys: Sequence[str] | None,
              into: Any | None) -> tuple[Any, Manifest]:
    """Read ``ck`` from the hot tier, restoring it there first when it is not."""
    # A checkpoint that only S3 holds is restored to the hot tier first (verified).
    directory = ensure_hot(core, ck)
    # The hot copy may be a re-encoded one (restored from the archive codec's copy).
    manifest = read_manifest(directory, expected_digest=hot_digest(core, ck))
    if manifest.delta is not None and manifest.delta.lossy:
        logger.warning(
            "loading %s: values of %s are approximate (lossy delta, max abs error %g, "
            "mean %g); compact it or save in full where exact values matter",
            ck.ref, list(manifest.delta.scope), manifest.delta.max_abs_error,
            manifest.delta.mean_abs_error,
        )
    if is_dcp_manifest(manifest):
        # Imported here: ops.dcp pulls in torch.distributed.checkpoint (most of a second
        # to import), which processes that never load a DCP checkpoint should not pay.
        from ckptstore.ops.dcp import load_dcp

        state = load_dcp(directory, manifest, keys=keys, into=into,
                         threads=core.settings.threads)
    else:
        state = read_checkpoint(
            directory, manifest, keys=keys, into=into, locate=core.locate,
            threads=core.settings.threads,
        )
    return state, manifest


def _hot_copy_changed(core: StoreCore, ck: Checkpoint, exc: Exception) -> bool:
    """Whether a failed hot read failed because the copy it read changed meanwhile: retention
    took it away (it is not PRESENT any more), or took it away and a restore brought it back
    (verified again since ``ck`` was read). Then the load re-plans. A copy unchanged and
    PRESENT is damaged: not a race.

    Raises:
        CheckpointNotFoundError: If the checkpoint itself was pruned meanwhile.
    """
    try:
        now = core.catalog.get_any(ck.id)
    except CheckpointNotFoundError:
        now = None
    if now is None or now.state != CheckpointState.COMMITTED:
        raise CheckpointNotFoundError(
            f"checkpoint {ck.ref} ({ck.id}) was pruned while it was being loaded; "
            f"`ckpt events {ck.id}` shows its history"
        ) from exc
    hot, before = now.replica("hot"), ck.replica("hot")
    return (hot is None or hot.state != ReplicaState.PRESENT or before is None
            or before.state != ReplicaState.PRESENT or hot.verified_at != before.verified_at)


def read_any_manifest(core: StoreCore, ref: str) -> Manifest:
    """Read and verify the manifest of a committed checkpoint (no tensor data).

    From the fastest copy that holds it: no need to restore tensors to read the index.
    """
    ck = core.catalog.get(ref)
    if ck.parted:
        return parted_manifest(core, ck)[0]
    return manifest_of(core, ck)


def restore_latest(core: StoreCore, run: str, *, into: Any | None = None) -> Any | None:
    """Load the newest committed checkpoint of ``run``, or None if it has none."""
    try:
        ck = core.catalog.latest(run)
    except CheckpointNotFoundError:
        return None
    return load_checkpoint(core, ck.id, into=into)


def verify_hot(core: StoreCore, ref: str, *, deep: bool = True) -> builtins.list[str]:
    """Re-hash a checkpoint's hot copy; return the problems found (``[]`` when intact).

    The result is recorded as a ``verified`` event.
    """
    ck = core.catalog.get(ref)
    if ck.parted:
        problems = verify_parts_here(core, ck, deep=deep)
        core.catalog.record_event(
            "verified",
            checkpoint_id=ck.id,
            detail={"tier": "hot", "host": host(), "ok": not problems,
                    "problems": problems[:20]},
        )
        return problems
    directory = core.hot_dir_of(ck)
    manifest = read_manifest(directory, expected_digest=expected_digest(ck, "hot"))
    if is_dcp_manifest(manifest):
        problems = verify_dcp(directory, manifest, deep=deep)
    else:
        problems = verify_checkpoint(directory, manifest, locate=core.locate, deep=deep)
    if directory.is_symlink():  # reads would silently come from the link's target
        problems.insert(0, f"{directory}: the checkpoint directory is a symlink")
    core.catalog.record_event(
        "verified",
        checkpoint_id=ck.id,
        detail={"tier": "hot", "ok": not problems, "problems": problems[:20]},
    )
    return problems
