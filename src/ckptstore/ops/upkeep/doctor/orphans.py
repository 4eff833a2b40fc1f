"""Doctor phase C: data on the tiers that the catalog does not (or no longer) own.

Hot-tier directories are classified like gc does
(:func:`ckptstore.ops.tiering.gc.classify_hot_dir`); other tiers are listed and grouped by
checkpoint, keeping every chunk file another
checkpoint still reads. Unmarked leftovers are removable; marked data without a row is only
reported (it may be another catalog's checkpoint); an unrecorded complete copy is adopted if
it verifies.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from ckptstore.errors import CkptError
from ckptstore.format.constants import COMMIT_NAME, chunk_rel
from ckptstore.ops.tiering.gc import HotDir, classify_hot_dir
from ckptstore.ops.tiering.replicas import referenced_chunks
from ckptstore.ops.upkeep.doctor.run import DoctorRun, is_temp, older_than
from ckptstore.records import SEALED_DIR, Checkpoint, CheckpointState, ReplicaState
from ckptstore.storage import Tier

__all__ = ["check_hot_dirs", "check_tier_keys"]

logger = logging.getLogger(__name__)


def check_hot_dirs(job: DoctorRun, by_id: dict[str, Checkpoint]) -> None:
    """Classify every directory (and stray file) of the hot tier against the catalog.

    Args:
        job: The run.
        by_id: Every catalog row, by checkpoint id.
    """
    hot = job.store.hot
    if "hot" not in job.tiers or not hot.is_dir():
        return
    for run_dir in sorted(hot.iterdir()):
        if run_dir.name.startswith(".") or not run_dir.is_dir() or run_dir.is_symlink():
            if is_temp(run_dir.name) and older_than(run_dir, job.grace_s):
                job.find("stray-temp", str(run_dir), "temporary file of a killed write",
                         tier="hot", repair=lambda p=run_dir: p.unlink(missing_ok=True))
            continue
        for ck_dir in sorted(run_dir.iterdir()):
            job.count("directories")
            if not ck_dir.is_dir() or ck_dir.is_symlink():
                if is_temp(ck_dir.name) and older_than(ck_dir, job.grace_s):
                    job.find("stray-temp", str(ck_dir), "temporary file of a killed "
                             "write", tier="hot",
                             repair=lambda p=ck_dir: p.unlink(missing_ok=True))
                continue
            _hot_dir(job, ck_dir, by_id.get(ck_dir.name))


def _hot_dir(job: DoctorRun, ck_dir: Path, ck: Checkpoint | None) -> None:
    kind = classify_hot_dir(ck_dir, ck)
    remove = job.remover(ck_dir)
    if kind is HotDir.FOREIGN_STORE:
        job.find("orphan-data", str(ck_dir),
                 "holds another store's marker: that store lives inside this hot tier; "
                 "never removed here: move that store elsewhere", tier="hot")
    elif kind is HotDir.ORPHAN_COMMITTED:
        job.find("orphan-data", str(ck_dir),
                 "a committed checkpoint directory with no catalog row (from another "
                 "catalog?): import it (`ckpt import-bundle`) or delete it by hand",
                 tier="hot")
    elif kind is HotDir.ORPHAN_UNFINISHED:
        job.find("orphan-data", str(ck_dir),
                 "an unfinished directory with no catalog row", tier="hot",
                 repair=remove if older_than(ck_dir, job.grace_s) else None)
    elif ck is None or kind in (HotDir.SAVING, HotDir.RECORDED):
        return  # a live save (dead ones were handled above), or the recorded copy
    elif kind is HotDir.LEFTOVER:
        job.find("orphan-data", str(ck_dir),
                 f"left behind by {ck.ref}, which is {ck.state}", tier="hot",
                 repair=remove)
    elif kind is HotDir.UNRECORDED:
        job.find("orphan-data", str(ck_dir),
                 f"a complete-looking copy of {ck.ref} the catalog does not record (a "
                 "restore was killed after its last file): adopted if it verifies, "
                 "removed if not", tier="hot",
                 repair=job.with_lease(ck.id, "restore:hot",
                                       _adopter(job, ck, job.tiers["hot"])))
    else:
        why = ("left by an interrupted prune" if ck.state == CheckpointState.DELETING
               else "a partial copy: a restore was killed")
        job.find("orphan-data", str(ck_dir), f"{why} ({ck.ref})", tier="hot",
                 repair=job.with_lease(ck.id, "restore:hot", remove))


def _adopter(job: DoctorRun, ck: Checkpoint, tier: Tier) -> Any:
    """Record an unrecorded, marked copy as PRESENT if it verifies in full, else drop it.

    Run under the tier's flow lease, so no copy is being written there meanwhile.
    """

    def adopt() -> None:
        from ckptstore.ops.tiering.replicas import delete_replica
        from ckptstore.ops.upkeep.verify import check_replica

        current = job.store.catalog.get_any(ck.id)
        replica = current.replica(tier.name)
        if replica is not None and replica.state == ReplicaState.PRESENT:
            return
        problems = check_replica(job.store, current, tier, deep=True)
        if problems:
            # Not a usable copy: remove it the safe way (marker first, shared chunks kept).
            job.store.catalog.set_replica(ck.id, tier.name, state=ReplicaState.DAMAGED)
            delete_replica(job.store, current, tier.name, actor=job.owner, force=True,
                           keep_referenced=True)
            return
        prefix = tier.prefix_for(ck.run, ck.id)
        size = 0
        local = tier.local_dir(ck.run, ck.id)
        if local is not None:
            size = sum(p.stat().st_size for p in local.rglob("*") if p.is_file())
        job.store.catalog.set_replica(ck.id, tier.name, uri=tier.uri_for(ck.run, ck.id),
                                      state=ReplicaState.PRESENT, bytes=size or None,
                                      verified=True)
        job.store.catalog.record_event(
            "adopted", checkpoint_id=ck.id, actor=job.owner,
            detail={"tier": tier.name, "prefix": prefix, "verified": "deep"},
        )

    return adopt


def check_tier_keys(job: DoctorRun, by_id: dict[str, Checkpoint]) -> None:
    """Group every other tier's keys by checkpoint and judge the ones nothing needs.

    Args:
        job: The run.
        by_id: Every catalog row, by checkpoint id.
    """
    for name, tier in sorted(job.tiers.items()):
        if name == "hot":
            continue
        try:
            keys = tier.list_prefix("")
        except CkptError as exc:
            job.find("missing-replica", tier.url, f"cannot list the tier: {exc}",
                     tier=name)
            continue
        job.count("keys", len(keys))
        groups: dict[tuple[str, str], list[str]] = {}
        _sealed_leftovers(job, tier, keys, by_id)
        for key in keys:
            parts = key.split("/", 2)
            # A dot prefix is never a run: sealed copies pushed here by other stores
            # (``.sealed/``, ops/sharing/sealed.py) belong to no catalog row.
            if len(parts) == 3 and not parts[0].startswith("."):
                groups.setdefault((parts[0], parts[1]), []).append(key)
        try:
            needed = {
                tier.key_for(by_id[owner].run, owner, chunk_rel(array, index))
                for owner, array, index in referenced_chunks(job.store, name)
                if owner in by_id
            }
        except CkptError as exc:
            # Without knowing which chunk files other copies read, nothing may go.
            job.find("orphan-data", tier.url,
                     f"cannot tell which files of {name} other checkpoints still read "
                     f"({exc}); not judging this tier's files", tier=name)
            continue
        for (run, ckpt_id), group in sorted(groups.items()):
            _tier_group(job, tier, run, ckpt_id, group, by_id.get(ckpt_id), needed)


def _sealed_leftovers(job: DoctorRun, tier: Tier, keys: list[str],
                      by_id: dict[str, Checkpoint]) -> None:
    """Sealed copies (an encrypted tier) that a row of this catalog names but no longer
    owns: a DELETED or DELETING copy whose objects are still there. Sealed copies no row
    names are left alone: they may be encrypted pushes of other stores (this tier may be
    their remote), which this catalog knows nothing of."""
    copies = {key.split("/", 2)[1] for key in keys
              if key.startswith(SEALED_DIR + "/") and key.count("/") >= 2}
    if not copies:
        return
    for ck in by_id.values():
        replica = ck.replica(tier.name)
        if replica is None or replica.sealed not in copies or replica.state not in (
                ReplicaState.DELETED, ReplicaState.DELETING):
            continue
        prefix = f"{SEALED_DIR}/{replica.sealed}/"

        def remove(prefix: str = prefix) -> None:
            tier.delete_prefix(prefix)

        job.find("orphan-data", prefix, f"objects of the deleted encrypted copy of {ck.ref} "
                 f"are still on {tier.name}; `ckpt gc` (or doctor --fix) removes them",
                 tier=tier.name, repair=remove)


def _tier_group(job: DoctorRun, tier: Tier, run: str, ckpt_id: str, keys: list[str],
                ck: Checkpoint | None, needed: set[str]) -> None:
    marker = f"{run}/{ckpt_id}/{COMMIT_NAME}"
    marked = marker in keys
    prefix = f"{run}/{ckpt_id}/"
    spare = [k for k in keys if k not in needed]
    if not spare:
        return
    replica = ck.replica(tier.name) if ck is not None else None
    if ck is not None and ck.state == CheckpointState.PENDING:
        return
    if replica is not None and replica.state in (
        ReplicaState.PRESENT, ReplicaState.DAMAGED, ReplicaState.DELETING,
        ReplicaState.COPYING,
    ):
        return

    def delete(spare: list[str] = spare, marked: bool = marked) -> None:
        if marked:
            tier.delete(marker)
        tier.delete_keys(k for k in spare if k != marker)

    if ck is None:
        detail = f"{len(spare)} object(s) under {prefix} with no catalog row"
        if marked:
            job.find("orphan-data", prefix, detail + " but with a commit marker (another "
                     "catalog's checkpoint?): delete it by hand if unwanted",
                     tier=tier.name)
        else:
            job.find("orphan-data", prefix, detail + " (an unfinished copy)",
                     tier=tier.name, repair=delete)
        return
    gone = ck.state in (CheckpointState.FAILED, CheckpointState.DELETED)
    purpose = f"archive:{tier.name}"
    if marked and ck.state == CheckpointState.COMMITTED:
        job.find("orphan-data", prefix,
                 f"a marked copy of {ck.ref} the catalog does not record on {tier.name} "
                 "(a copy was killed after its last file): adopted if it verifies, "
                 "removed if not", tier=tier.name,
                 repair=job.with_lease(ck.id, purpose, _adopter(job, ck, tier)))
        return
    detail = (f"{len(spare)} object(s) of {ck.ref} left on {tier.name} "
              f"({'checkpoint ' + ck.state if gone else 'a killed or abandoned copy'})")
    job.find("orphan-data", prefix, detail, tier=tier.name,
             repair=delete if gone else job.with_lease(ck.id, purpose, delete))
