"""Doctor phase B: every copy the catalog says is PRESENT, checked on its tier.

A local copy is verified against its manifest (sizes, or every hash with ``deep``), its Zarr
metadata checked (:mod:`ckptstore.format.zarrcheck`) and its stray temporary files found; a
remote copy is listed (or, with ``deep``, downloaded and re-hashed).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from ckptstore.errors import (
    CheckpointNotFoundError,
    CkptError,
    IncompleteCheckpointError,
    IntegrityError,
    StorageError,
)
from ckptstore.format import Manifest, read_manifest, verify_checkpoint
from ckptstore.format.dcp.verify import verify_dcp
from ckptstore.format.zarrcheck import check_zarr_metadata, rewrite_zarr_metadata
from ckptstore.ops.tiering.parts import of_ranks, parted_manifest
from ckptstore.ops.tiering.replicas import manifest_on
from ckptstore.ops.tiering.sealed_tier import sealed_prefix, verify_sealed
from ckptstore.ops.upkeep.doctor.run import DoctorRun, is_temp, older_than
from ckptstore.progress import Progress, announce_total
from ckptstore.records import Checkpoint, CheckpointState, ReplicaState, expected_digest
from ckptstore.storage import Tier, is_not_found
from ckptstore.storage.transfer import owned_files

__all__ = ["check_replicas"]

logger = logging.getLogger(__name__)


def check_replicas(
    job: DoctorRun, everything: list[Checkpoint], progress: Progress | None = None
) -> None:
    """Check every PRESENT copy of every committed checkpoint on the run's tiers.

    Args:
        job: The run.
        everything: Every catalog row.
        progress: Called with 1 after each copy checked; first told how many there are.
    """
    todo = [(ck, tier) for ck in everything if ck.state == CheckpointState.COMMITTED
            for replica in ck.replicas
            if replica.state == ReplicaState.PRESENT
            and (tier := job.tiers.get(replica.tier)) is not None]
    # Checking copies is the slow part (a deep check re-hashes each one): one unit each.
    announce_total(progress, len(todo))
    committed = sum(ck.state == CheckpointState.COMMITTED for ck in everything)
    if committed:
        job.count("checkpoints", committed)
    for ck, tier in todo:
        job.count("replicas")
        _check_replica(job, ck, tier)
        if progress is not None:
            progress(1)


def _check_parts_here(job: DoctorRun, ck: Checkpoint) -> None:
    """The hot copy of a checkpoint saved across hosts: only the parts this host's disk
    holds are this host's to check (the others: doctor on their hosts)."""
    me = job.host
    mine = [p for p in job.store.catalog.parts(ck.id, "hot")
            if p.stored_on == me and p.state == ReplicaState.PRESENT]
    if not mine:
        return
    directory = job.store.checkpoint_dir(ck.run, ck.id)
    manifest, _ = parted_manifest(job.store, ck)
    ranks = job.store.catalog.part_ranks(ck.id)
    for part in mine:
        wanted = set(ranks.get(part.part, []))
        problems = (verify_dcp(directory, manifest, deep=job.deep, include=of_ranks(wanted))
                    if directory.is_dir() else [f"{directory}: missing"])
        if problems:

            def mark(part: str = part.part) -> None:
                job.store.catalog.set_part(ck.id, "hot", part, stored_on=me,
                                           state=ReplicaState.DAMAGED)

            missing = all("missing" in p for p in problems)
            job.find("missing-replica" if missing else "damaged-replica", ck.id,
                     f"{ck.ref}: the part of {part.part} on {me}: {'; '.join(problems[:3])}; "
                     "loads read it from another copy (a peer, the warm tier) meanwhile",
                     tier="hot", repair=mark)


def _check_sealed(job: DoctorRun, ck: Checkpoint, tier: Tier, copy_id: str) -> None:
    """A sealed copy (an encrypted tier): its envelope, objects and sizes, and with a key
    (``--key``, ``$CKPT_DECRYPT_KEY``, ``decrypt_key``) and ``--deep`` every chunk after
    decryption."""
    if ck.parted:
        # Sealed part by part: no host holds every part in the clear to reseal it from.
        hint = ("remove it and run `ckpt archive` on each of its hosts "
                f"({', '.join(ck.hosts)}): each seals its part again")
    elif any(r.tier != tier.name and r.state == ReplicaState.PRESENT and not r.sealed
             for r in ck.replicas):
        hint = "`ckpt verify --repair` seals it again from the hot copy"
    else:
        hint = ("no plain copy exists to reseal it from: `ckpt restore REF --key KEY` "
                "another copy first")
    try:
        if not tier.list_prefix(sealed_prefix(copy_id)):
            job.find("missing-replica", ck.id,
                     f"the catalog says the encrypted copy of {ck.ref} is PRESENT, but no "
                     f"object of sealed copy {copy_id} is left on {tier.name} (lost); {hint}",
                     tier=tier.name, repair=job.mark_damaged(ck, tier.name))
            return
        problems, _ = (verify_sealed(job.store, ck, tier, job.key) if job.deep else
                       verify_sealed(job.store, ck, tier, key=None, full=False))
    except StorageError as exc:
        job.find("missing-replica", ck.id, f"{ck.ref}: cannot check the copy: {exc}",
                 tier=tier.name)
        return
    if problems:
        job.find("damaged-replica", ck.id, f"{ck.ref}: {problems[0]}; {hint}",
                 tier=tier.name, repair=job.mark_damaged(ck, tier.name))


def _check_replica(job: DoctorRun, ck: Checkpoint, tier: Tier) -> None:
    if ck.parted and tier.name == "hot" and job.store.settings.hot_remote is None:
        _check_parts_here(job, ck)
        return
    replica = ck.replica(tier.name)
    if replica is not None and replica.sealed:
        _check_sealed(job, ck, tier, replica.sealed)
        return
    local = tier.local_dir(ck.run, ck.id)
    hint = ("`ckpt verify --repair` copies it again from another replica"
            if any(r.tier != tier.name and r.state == ReplicaState.PRESENT
                   for r in ck.replicas)
            else "no other copy exists: restore it from a backup")
    try:
        manifest = (read_manifest(local, expected_digest=expected_digest(ck, tier.name))
                    if local is not None else manifest_on(tier, ck, use_cache=False))
    except (CheckpointNotFoundError, IncompleteCheckpointError) as exc:
        job.find("missing-replica", ck.id,
                 f"the catalog says {ck.ref} is PRESENT, but {_lost(ck, tier, exc)}; {hint}",
                 tier=tier.name, repair=job.mark_damaged(ck, tier.name))
        return
    except IntegrityError as exc:
        job.find("damaged-replica", ck.id, f"{ck.ref}: {exc}; {hint}",
                 tier=tier.name, repair=job.mark_damaged(ck, tier.name))
        return
    except StorageError as exc:
        if not is_not_found(exc):
            # The tier is unreachable: that says nothing about the copy; mark nothing.
            job.find("missing-replica", ck.id, f"{ck.ref}: cannot check the copy: {exc}",
                     tier=tier.name)
            return
        job.find("missing-replica", ck.id, f"{ck.ref}: {_lost(ck, tier, exc)}; {hint}",
                 tier=tier.name, repair=job.mark_damaged(ck, tier.name))
        return
    if local is not None:
        _check_local_copy(job, ck, tier, local, manifest, hint)
    else:
        _check_remote_copy(job, ck, tier, manifest, hint)


def _check_local_copy(job: DoctorRun, ck: Checkpoint, tier: Tier, local: Path, manifest: Manifest,
                      hint: str) -> None:
    def locate(ckpt_id: str) -> Path:
        other = job.store.catalog.get_any(ckpt_id)
        found = tier.local_dir(other.run, other.id)
        if found is None:
            raise CheckpointNotFoundError(f"base {ckpt_id} is not on {tier.name}")
        return found

    # Zarr metadata is its own finding below, with its own repair.
    problems = verify_checkpoint(local, manifest, locate=locate, deep=job.deep, metadata=False)
    if local.is_symlink():  # reads would silently come from the link's target
        problems.insert(0, "the checkpoint directory is a symlink")
    if problems:
        missing = all("missing" in p for p in problems)
        job.find("missing-replica" if missing else "damaged-replica", ck.id,
                 f"{ck.ref}: {'; '.join(problems[:3])}"
                 + (f" (+{len(problems) - 3} more)" if len(problems) > 3 else "")
                 + f"; {hint}",
                 tier=tier.name, repair=job.mark_damaged(ck, tier.name))
        return
    meta = check_zarr_metadata(local, manifest)
    if meta:

        def rewrite(local: Path = local, manifest: Manifest = manifest) -> None:
            rewrite_zarr_metadata(local, manifest)

        job.find("zarr-metadata", ck.id,
                 f"{ck.ref}: {'; '.join(meta[:3])}; our loads never use it, but "
                 "zarr.open_group would: the documents are rewritten from the manifest",
                 tier=tier.name, repair=rewrite)
    for dirpath, _dirs, files in os.walk(local):
        for name in files:
            path = Path(dirpath) / name
            if is_temp(name) and older_than(path, job.grace_s):
                job.find("stray-temp", str(path),
                         "temporary file of a killed write inside a committed copy",
                         tier=tier.name,
                         repair=lambda path=path: path.unlink(missing_ok=True))


def _check_remote_copy(job: DoctorRun, ck: Checkpoint, tier: Tier, manifest: Manifest,
                       hint: str) -> None:
    if job.deep:
        from ckptstore.ops.upkeep.verify import check_replica

        problems = check_replica(job.store, ck, tier, deep=True)
    else:
        have = set(tier.list_prefix(tier.prefix_for(ck.run, ck.id)))
        job.count("keys", len(have))
        problems = [f"{rel}: missing" for rel in owned_files(manifest)
                    if tier.key_for(ck.run, ck.id, rel) not in have]
    if problems:
        missing = all("missing" in p for p in problems)
        job.find("missing-replica" if missing else "damaged-replica", ck.id,
                 f"{ck.ref}: {'; '.join(problems[:3])}; {hint}", tier=tier.name,
                 repair=job.mark_damaged(ck, tier.name))


def _lost(ck: Checkpoint, tier: Tier, exc: Exception) -> str:
    """``exc`` as text, said plainly when the copy has no file left at all."""
    try:
        gone = not tier.list_prefix(tier.prefix_for(ck.run, ck.id))
    except CkptError:
        gone = False
    if gone:
        return (f"the copy is lost: no file of it is left on {tier.name} ({exc}); "
                "`ckpt prune` deletes such a copy like any other")
    return str(exc)
