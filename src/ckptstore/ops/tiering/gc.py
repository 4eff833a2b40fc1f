"""Hot-tier gc: remove what dead saves and killed restores left behind.

(And, on encrypted tiers, the sealed copies killed archives and deletes left unfinished:
:func:`~ckptstore.ops.tiering.sealed_tier.gc_sealed`.)

What a hot directory is, and whether its writer is dead, is decided in one place for gc and
doctor (:func:`classify_hot_dir`, :func:`writer_is_dead`): a PENDING row is dead when its
writer process on this host is gone, when this process abandoned it, or when it is older than
a grace period (writers on other hosts). gc removes the unfinished kinds; doctor reports every
kind and repairs what is safe (:mod:`ckptstore.ops.upkeep.doctor`). Committed data is never touched,
and neither is a directory that holds another store's marker (a store rooted inside this hot
tier, or one whose tier this run directory is): it is :attr:`HotDir.FOREIGN_STORE`.

A checkpoint saved across hosts has a part on each host's disk, and only that host can remove
it: :func:`prune_parts` (part of every gc run, so of every host's agent) removes this host's
parts of checkpoints whose hot copy is being deleted or that were pruned. A failed save's
partial files on this host are removed like any failed save's directory.
"""

from __future__ import annotations

import enum
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from ckptstore.core import StoreCore
from ckptstore.format.constants import COMMIT_NAME
from ckptstore.identity import host, owner_is_dead, unique_owner
from ckptstore.numeric import is_decimal
from ckptstore.ops.leases import acquire_lease
from ckptstore.ops.tiering.parts import remove_local_parts
from ckptstore.ops.tiering.sealed_tier import gc_sealed
from ckptstore.records import Checkpoint, CheckpointState, ReplicaState
from ckptstore.storage.marker import foreign_marker

__all__ = [
    "DEFAULT_PENDING_GRACE_S",
    "GcReport",
    "HotDir",
    "classify_hot_dir",
    "gc_hot",
    "hot_checkpoint_dirs",
    "prune_parts",
    "writer_is_dead",
]

#: Age after which a PENDING row of another host's writer counts as dead.
DEFAULT_PENDING_GRACE_S = 24 * 3600.0


@dataclass
class GcReport:
    """What ``gc`` removed (or would remove with ``dry_run``)."""

    removed_dirs: list[str] = field(default_factory=list)
    failed_rows: list[str] = field(default_factory=list)
    dry_run: bool = False
    pruned_parts: list[str] = field(default_factory=list)
    #: Unfinished sealed copies removed from encrypted tiers (``<tier>:.sealed/<copy id>``).
    sealed_removed: list[str] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        """True when there was nothing to clean."""
        return (not self.removed_dirs and not self.failed_rows and not self.pruned_parts
                and not self.sealed_removed)


def writer_is_dead(core: StoreCore, ck: Checkpoint, *, older_than_s: float) -> bool:
    """Whether the save that made PENDING row ``ck`` can no longer finish.

    Args:
        core: The open store.
        ck: A PENDING checkpoint.
        older_than_s: Age after which a row whose writer is on another host counts as dead.
    """
    if ck.id in core.abandoned:
        return True
    writer = ck.writer or ""
    w_host, _, w_pid = writer.rpartition(":")
    if w_host == host() and is_decimal(w_pid):
        return owner_is_dead(writer)
    return time.time() - ck.created_at.timestamp() > older_than_s


class HotDir(enum.Enum):
    """What a checkpoint directory on the hot tier is, judged against its catalog row."""

    #: The catalog row is PENDING: a save in progress (or a dead one, see writer_is_dead).
    SAVING = "saving"
    #: The hot copy the catalog records (PRESENT, DAMAGED, DELETING or COPYING).
    RECORDED = "recorded"
    #: No catalog row, no commit marker: an unfinished write nothing will finish.
    ORPHAN_UNFINISHED = "orphan-unfinished"
    #: No catalog row but a commit marker: committed in another catalog (import it).
    ORPHAN_COMMITTED = "orphan-committed"
    #: The row is FAILED or DELETED: leftovers of a failed save or an interrupted delete.
    LEFTOVER = "leftover"
    #: COMMITTED (or DELETING) without a recorded hot copy and without a marker: a killed
    #: restore's partial copy, or an interrupted prune's remains.
    PARTIAL = "partial"
    #: COMMITTED without a recorded hot copy but with a marker: a restore killed after its
    #: last file (doctor adopts it if it verifies).
    UNRECORDED = "unrecorded"
    #: It (or its run directory) holds another store's marker: that store's files, which
    #: nothing of this store removes, whatever its catalog says about the name.
    FOREIGN_STORE = "foreign-store"


def classify_hot_dir(ck_dir: Path, ck: Checkpoint | None) -> HotDir:
    """Classify one hot checkpoint directory (a ``stat`` of the commit marker; a directory
    about to be judged removable is also searched for another store's marker).

    Args:
        ck_dir: ``<hot>/<run>/<checkpoint id>``.
        ck: The catalog row with that id in any state, or None.
    """
    kind = _classify(ck_dir, ck)
    if kind not in (HotDir.SAVING, HotDir.RECORDED) and foreign_marker(
            ck_dir, ck_dir.parent.parent) is not None:
        return HotDir.FOREIGN_STORE
    return kind


def _classify(ck_dir: Path, ck: Checkpoint | None) -> HotDir:
    marked = (ck_dir / COMMIT_NAME).is_file()
    if ck is None:
        return HotDir.ORPHAN_COMMITTED if marked else HotDir.ORPHAN_UNFINISHED
    if ck.state == CheckpointState.PENDING:
        return HotDir.SAVING
    if ck.state in (CheckpointState.FAILED, CheckpointState.DELETED):
        return HotDir.LEFTOVER
    replica = ck.replica("hot")
    if replica is not None and replica.state in (
        ReplicaState.PRESENT, ReplicaState.DAMAGED, ReplicaState.DELETING, ReplicaState.COPYING,
    ):
        return HotDir.RECORDED
    if marked and ck.state == CheckpointState.COMMITTED:
        return HotDir.UNRECORDED
    return HotDir.PARTIAL


def hot_checkpoint_dirs(core: StoreCore) -> Iterator[Path]:
    """Every ``<hot>/<run>/<id>`` directory (no links, no hidden run directories)."""
    if not core.hot.is_dir():
        return
    for run_dir in sorted(core.hot.iterdir()):
        if run_dir.name.startswith(".") or not run_dir.is_dir() or run_dir.is_symlink():
            continue
        for ck_dir in sorted(run_dir.iterdir()):
            if ck_dir.is_dir() and not ck_dir.is_symlink():
                yield ck_dir


def gc_hot(
    core: StoreCore, *, dry_run: bool = False, older_than_s: float = DEFAULT_PENDING_GRACE_S
) -> GcReport:
    """Remove what dead saves left behind on the hot tier.

    Dead PENDING rows (:func:`writer_is_dead`) are marked FAILED and their directories
    deleted; directories of FAILED rows and unfinished orphans (:func:`classify_hot_dir`) are
    deleted; a killed restore's partial copy is deleted under the restore lease, so a running
    restore is never disturbed.

    Args:
        core: The open store.
        dry_run: Only report what would be removed.
        older_than_s: Age after which a PENDING row of another host counts as dead.

    Returns:
        A :class:`GcReport`.
    """
    report = GcReport(dry_run=dry_run)
    report.pruned_parts = prune_parts(core, dry_run=dry_run)
    report.sealed_removed = gc_sealed(core, dry_run=dry_run)
    rows = {ck.id: ck for ck in core.catalog.list(state=None)}
    for ck in rows.values():
        if ck.state == CheckpointState.PENDING and writer_is_dead(
            core, ck, older_than_s=older_than_s
        ):
            report.failed_rows.append(ck.id)
            directory = core.checkpoint_dir(ck.run, ck.id)
            foreign = directory.exists() and foreign_marker(directory, core.hot) is not None
            if directory.exists() and not foreign:
                report.removed_dirs.append(str(directory))
            if not dry_run:
                core.catalog.fail_checkpoint(ck.id, "abandoned save removed by gc")
                if not foreign:
                    shutil.rmtree(directory, ignore_errors=True)
    for ck_dir in hot_checkpoint_dirs(core):
        if str(ck_dir) in report.removed_dirs:
            continue
        row = rows.get(ck_dir.name)
        kind = classify_hot_dir(ck_dir, row)
        if kind in (HotDir.ORPHAN_UNFINISHED, HotDir.LEFTOVER) and (
            row is None or row.state == CheckpointState.FAILED
        ):
            report.removed_dirs.append(str(ck_dir))
            if not dry_run:
                shutil.rmtree(ck_dir, ignore_errors=True)
        elif kind is HotDir.PARTIAL and row is not None and row.state == CheckpointState.COMMITTED:
            # A killed restore's partial copy. Taken under the restore lease, so a running
            # restore is never disturbed (a killed restore's lease names a dead process:
            # taken over, not waited for).
            owner = unique_owner("gc")
            if not acquire_lease(core, row.id, "restore:hot", owner, 600.0):
                continue
            try:
                report.removed_dirs.append(str(ck_dir))
                if not dry_run:
                    shutil.rmtree(ck_dir, ignore_errors=True)
            finally:
                core.catalog.release_lease(row.id, "restore:hot", owner)
    if not dry_run:
        core.abandoned.difference_update(report.failed_rows)
    if not dry_run and not report.empty:
        core.catalog.record_event(
            "gc", detail={"removed": len(report.removed_dirs), "failed": report.failed_rows,
                          "pruned_parts": report.pruned_parts,
                          "sealed_removed": report.sealed_removed, "host": host()}
        )
    return report


def prune_parts(core: StoreCore, *, dry_run: bool = False) -> list[str]:
    """Remove this host's parts of checkpoints saved across hosts that are being deleted.

    A part goes when its checkpoint is pruned (DELETING, DELETED) or its hot copy is being
    deleted (retention on another host started it). Parts still arriving from a peer
    (COPYING) of a live checkpoint are left alone.

    Returns:
        ``"<checkpoint id>:<part host>"`` for every part removed (or that would be).
    """
    me = host()
    live = (ReplicaState.PRESENT, ReplicaState.DAMAGED, ReplicaState.DELETING,
            ReplicaState.COPYING)
    found = core.catalog.parts_on(me, tier="hot", states=live)
    pruned: list[str] = []
    by_ckpt: dict[str, list[str]] = {}
    for cid, part in found:
        by_ckpt.setdefault(cid, []).append(part.part)
    for cid, parts in by_ckpt.items():
        ck = core.catalog.get_any(cid)
        hot = ck.replica("hot")
        gone = ck.state in (CheckpointState.DELETING, CheckpointState.DELETED,
                            CheckpointState.FAILED)
        if not gone and hot is not None and hot.state not in (ReplicaState.DELETING,
                                                              ReplicaState.DELETED):
            continue
        pruned += [f"{cid}:{p}" for p in parts]
        if not dry_run:
            remove_local_parts(core, ck, parts=parts)
    return pruned
