"""Scrub replicas: re-hash every copy, mark damaged ones, repair them from a good copy.

A local copy is checked in place; a remote one is downloaded into a temporary directory
first (the only way to re-hash it). Copies in archival storage classes (GLACIER) cannot be
read without a restore request, so only their presence and sizes are checked.
"""

from __future__ import annotations

import logging
import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from ckptstore.core import StoreCore
from ckptstore.errors import (
    CkptError,
    IncompleteCheckpointError,
    IntegrityError,
    LeaseHeldError,
    StorageError,
)
from ckptstore.format import Manifest, verify_checkpoint
from ckptstore.identity import host
from ckptstore.ops.leases import lease_owner
from ckptstore.ops.tiering.parts import verify_parts_here
from ckptstore.ops.tiering.reencode import original_problems, reencode_copy
from ckptstore.ops.tiering.replicas import (
    manifest_on,
    run_resolver,
    store_tiers,
    tier_rank,
)
from ckptstore.ops.tiering.sealed_tier import (
    new_copy_id,
    seal_copy,
    sealed_prefix,
    sealed_uri,
    verify_sealed,
)
from ckptstore.records import Checkpoint, CheckpointState, ReplicaState, expected_digest
from ckptstore.storage import (
    MANIFEST_NAME,
    LocalTier,
    Tier,
    copy_checkpoint,
    foreign_chunks,
    is_not_found,
)
from ckptstore.storage.transfer import copy_foreign_chunks, iter_chunks, owned_files

__all__ = ["VerifyReport", "check_replica", "verify_replicas"]

logger = logging.getLogger(__name__)

_CHECKED_STATES = frozenset({ReplicaState.PRESENT, ReplicaState.DAMAGED})


@dataclass
class VerifyReport:
    """What a verify run found and did. Replicas are named ``"<checkpoint id>@<tier>"``.

    Attributes:
        checked: Every replica checked.
        ok: Replicas found intact.
        damaged: Replica -> problems found.
        repaired: Damaged replicas copied again from a good one and re-verified.
        unrepaired: Damaged replica -> why it could not be repaired.
        skipped: Replica -> why it was not checked.
    """

    checked: list[str] = field(default_factory=list)
    ok: list[str] = field(default_factory=list)
    damaged: dict[str, list[str]] = field(default_factory=dict)
    repaired: list[str] = field(default_factory=list)
    unrepaired: dict[str, str] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)

    @property
    def clean(self) -> bool:
        """True when every checked replica is intact now (maybe after repair)."""
        return not self.unrepaired and all(name in self.repaired for name in self.damaged)


def _download(tier: Tier, keys: list[str], root: Path) -> list[str]:
    """Fetch keys into ``root/<key>``; return problems for the ones that are missing."""
    problems: list[str] = []
    for key in keys:
        try:
            tier.get_file(key, root / key)
        except StorageError as exc:
            if not is_not_found(exc):
                raise
            problems.append(f"{key}: missing on {tier.name}")
    return problems


def _shallow_remote(tier: Tier, ck: Checkpoint, manifest: Manifest,
                    run_of: Callable[[str], str]) -> list[str]:
    """Presence and sizes, for tiers that cannot be read back (archival classes)."""
    sizes = {}
    for ref, chunk in _chunk_entries(manifest):
        sizes[tier.key_for(run_of(ref), ref, chunk[0])] = chunk[1]
    problems = []
    owners = {ck.id, *foreign_chunks(manifest)}
    prefixes = {tier.prefix_for(run_of(owner), owner) for owner in owners}
    listed = {k for p in prefixes for k in tier.list_prefix(p)}
    for rel in owned_files(manifest):
        key = tier.key_for(ck.run, ck.id, rel)
        if key not in listed:
            problems.append(f"{rel}: missing on {tier.name}")
    for key, nbytes in sizes.items():
        if key not in listed:
            problems.append(f"{key}: missing on {tier.name}")
        elif tier.size(key) != nbytes:
            problems.append(f"{key}: size differs from the manifest's {nbytes}")
    return problems


def _chunk_entries(manifest: Manifest) -> list[tuple[str, tuple[str, int]]]:
    out = []
    for ref in iter_chunks(manifest):
        chunk = manifest.arrays[ref.array].chunks[ref.index]
        out.append((ref.owner, (ref.rel, chunk.nbytes)))
    return out


def check_replica(store: StoreCore, ck: Checkpoint, tier: Tier, *,
                  deep: bool = True, digest: str | None = None,
                  key: str | os.PathLike[str] | None = None) -> list[str]:
    """Check one copy of a checkpoint; return its problems (``[]`` when intact).

    Args:
        store: The open store.
        ck: The checkpoint.
        tier: The tier holding the copy.
        deep: Re-hash every chunk (False: presence and sizes only).
        digest: The manifest digest the copy must have (default: what the catalog records
            for it, :func:`~ckptstore.records.expected_digest`).
        key: Private key that opens a sealed copy (an encrypted tier) for a full check;
            default ``$CKPT_DECRYPT_KEY``, else ``decrypt_key``; without one a sealed copy's
            envelope, objects and sizes are checked.

    Raises:
        StorageError: If the tier cannot be reached (not a property of the copy).
    """
    replica = ck.replica(tier.name)
    if replica is not None and replica.sealed:
        # Encrypted tier: in full with a key ($CKPT_DECRYPT_KEY, decrypt_key), else the
        # envelope, the objects it counts and their sizes (sealed_tier.verify_sealed).
        return verify_sealed(store, ck, tier, key)[0]
    run_of = run_resolver(store, ck)
    try:
        # The manifest and marker objects are readable even in archival classes.
        manifest = manifest_on(tier, ck, use_cache=False, digest=digest)
    except (IntegrityError, IncompleteCheckpointError) as exc:
        return [f"manifest: {exc}"]
    except StorageError as exc:
        if is_not_found(exc):
            return [f"{MANIFEST_NAME}: missing on {tier.name}"]
        raise
    if not tier.readable:
        return _shallow_remote(tier, ck, manifest, run_of)
    local = tier.local_dir(ck.run, ck.id)
    if local is not None:
        def locate(ckpt_id: str) -> Path:
            found = tier.local_dir(run_of(ckpt_id), ckpt_id)
            assert found is not None
            return found

        # A checkpoint directory replaced by a link reads another directory's files.
        linked = [f"{local}: the checkpoint directory is a symlink"] if local.is_symlink() else []
        return (linked + verify_checkpoint(local, manifest, locate=locate, deep=deep)
                + original_problems(local, manifest, ck.manifest_digest))
    with tempfile.TemporaryDirectory(prefix="ckpt-verify-") as tmp:
        root = Path(tmp)
        keys = [tier.key_for(ck.run, ck.id, rel) for rel in owned_files(manifest)]
        keys += [
            tier.key_for(run_of(owner), owner, ref.rel)
            for owner, refs in foreign_chunks(manifest).items()
            for ref in refs
        ]
        problems = _download(tier, keys, root)
        scratch = LocalTier(root, name=tier.name)
        directory = scratch.local_dir(ck.run, ck.id)

        def locate_tmp(ckpt_id: str) -> Path:
            return scratch.local_dir(run_of(ckpt_id), ckpt_id)

        return (problems
                + verify_checkpoint(directory, manifest, locate=locate_tmp, deep=deep)
                + original_problems(directory, manifest, ck.manifest_digest))


def _reencoded_codec(store: StoreCore, ck: Checkpoint, dst: Tier) -> str | None:
    """The codec of the re-encoded copy on ``dst`` (None: it is not a re-encoded copy).

    Read from the copy's manifest while that is intact, else the configured archive codec.
    """
    if dst.name not in {r.tier for r in ck.replicas if r.manifest_digest is not None}:
        return None
    try:
        manifest = manifest_on(dst, ck, use_cache=True)
        if manifest.reencoded_from is not None:
            return manifest.codec
    except CkptError:
        pass
    return store.settings.archive_codec


def _repair(
    store: StoreCore,
    ck: Checkpoint,
    dst: Tier,
    *,
    deep: bool,
    owner: str,
    threads: int,
) -> str:
    """Copy ``ck`` onto ``dst`` again from a verified copy; return the donor tier's name.

    A donor holding the same manifest as the damaged copy is copied as is. A re-encoded
    copy (archive codec) whose donor holds another manifest (the original on hot) is
    re-encoded again from it: files that are still right are kept, damaged ones rewritten.
    Otherwise the donor's copy is copied as is and the replica records the donor's digest.

    Raises:
        CkptError: If no donor is intact, the lease is held, or the copy fails.
    """
    tiers = store_tiers(store)
    damaged = ck.replica(dst.name)
    if damaged is not None and damaged.sealed:
        return _reseal(store, ck, dst, damaged.sealed, deep=deep, owner=owner,
                       threads=threads)
    want = expected_digest(ck, dst.name)
    # A sealed copy cannot be copied into a plain one without its key: not a donor here
    # (a damaged hot copy is restored from it by read repair or `ckpt restore --key`).
    donors = sorted(
        (tiers[r.tier] for r in ck.replicas
         if r.tier != dst.name and r.state == ReplicaState.PRESENT and r.tier in tiers
         and tiers[r.tier].readable and not r.sealed),
        # Same manifest first: the cheapest exact repair.
        key=lambda t: (expected_digest(ck, t.name) != want, tier_rank(t.name)),
    )
    codec = _reencoded_codec(store, ck, dst)
    reasons: list[str] = []
    purpose = f"archive:{dst.name}"
    for donor in donors:
        problems = check_replica(store, ck, donor, deep=deep)
        if problems:
            reasons.append(f"{donor.name} is damaged too ({problems[0]})")
            store.catalog.set_replica(ck.id, donor.name, state=ReplicaState.DAMAGED)
            continue
        if not store.catalog.acquire_lease(ck.id, purpose, owner, 3600.0):
            raise LeaseHeldError(
                f"another flow is writing the {dst.name} copy of {ck.ref}; retry the repair "
                "after it finishes"
            )
        try:
            manifest = manifest_on(donor, ck)
            run_of = run_resolver(store, ck)
            donor_digest = expected_digest(ck, donor.name)
            digest: str | None
            if codec is not None and donor_digest != want:
                result = reencode_copy(donor, dst, ck.run, manifest, codec, run_of=run_of,
                                       own_digest=ck.manifest_digest, threads=threads,
                                       deep=deep)
                nbytes, digest = result.bytes, result.manifest.digest
            else:
                copy_foreign_chunks(donor, dst, manifest, run_of, threads=threads, deep=deep)
                nbytes = copy_checkpoint(donor, dst, ck.run, ck.id, manifest,
                                         threads=threads, deep=deep, run_of=run_of)
                digest = donor_digest
            after = check_replica(store, ck, dst, deep=deep, digest=digest)
            if after:
                raise IntegrityError(
                    f"the {dst.name} copy of {ck.ref} still fails after repair: {after[0]}"
                )
            store.catalog.set_replica(
                ck.id, dst.name, uri=dst.uri_for(ck.run, ck.id), state=ReplicaState.PRESENT,
                bytes=nbytes, verified=True,
                manifest_digest=None if digest == ck.manifest_digest else digest,
            )
        finally:
            store.catalog.release_lease(ck.id, purpose, owner)
        return donor.name
    raise IntegrityError(
        f"no intact copy of {ck.ref} ({ck.id}) to repair its {dst.name} copy from"
        + (f": {'; '.join(reasons)}" if reasons else "")
    )


def _reseal(store: StoreCore, ck: Checkpoint, dst: Tier, old_copy: str, *, deep: bool,
            owner: str, threads: int) -> str:
    """Repair a damaged sealed copy: seal a new one from an intact plain copy (the hot
    one, usually), record it, then remove the damaged one; return the donor tier's name.

    Raises:
        CkptError: If no plain copy is intact, the lease is held, or sealing fails.
    """
    if ck.parted:
        # No host holds every part in the clear to seal a copy from, and sealing is done
        # part by part by each host: the damaged copy goes, then each host archives again.
        raise IntegrityError(
            f"the encrypted {dst.name} copy of {ck.ref} ({ck.id}), saved across hosts, is "
            "damaged; it is repaired by sealing it again part by part: remove it "
            f"(ckptstore.ops.tiering.replicas.delete_replica) and run `ckpt archive` on each "
            f"of its hosts ({', '.join(ck.hosts)})")
    tiers = store_tiers(store)
    donors = sorted((tiers[r.tier] for r in ck.replicas
                     if r.tier != dst.name and r.state == ReplicaState.PRESENT
                     and r.tier in tiers and tiers[r.tier].readable and not r.sealed),
                    key=lambda t: tier_rank(t.name))
    reasons: list[str] = []
    purpose = f"archive:{dst.name}"
    for donor in donors:
        problems = check_replica(store, ck, donor, deep=deep)
        if problems:
            reasons.append(f"{donor.name} is damaged too ({problems[0]})")
            store.catalog.set_replica(ck.id, donor.name, state=ReplicaState.DAMAGED)
            continue
        if not store.catalog.acquire_lease(ck.id, purpose, owner, 3600.0):
            raise LeaseHeldError(f"another flow is writing the {dst.name} copy of {ck.ref}; "
                                 "retry the repair after it finishes")
        try:
            copy_id = new_copy_id()
            sealed = seal_copy(store, ck, donor, dst, copy_id=copy_id, threads=threads,
                               deep=deep)
            store.catalog.set_replica(ck.id, dst.name, uri=sealed_uri(dst, copy_id),
                                      state=ReplicaState.PRESENT, bytes=sealed.bytes,
                                      verified=True, manifest_digest=sealed.digest)
            dst.delete_prefix(sealed_prefix(old_copy))
        finally:
            store.catalog.release_lease(ck.id, purpose, owner)
        return donor.name
    raise IntegrityError(
        f"no intact plain copy of {ck.ref} ({ck.id}) to reseal its encrypted {dst.name} copy "
        "from" + (f": {'; '.join(reasons)}" if reasons else "")
        + "; restore it with `ckpt restore REF --key KEY` first, then run verify again")


def _verify_parts(store: StoreCore, ck: Checkpoint, name: str, deep: bool, owner: str,
                  report: VerifyReport) -> None:
    try:
        problems = verify_parts_here(store, ck, deep=deep)
    except CkptError as exc:
        report.skipped[name] = f"could not check: {exc}"
        return
    store.catalog.record_event(
        "verified", checkpoint_id=ck.id, actor=owner,
        detail={"tier": "hot", "host": host(), "ok": not problems, "deep": deep,
                "problems": problems[:20]},
    )
    if problems:
        report.damaged[name] = problems
        report.unrepaired[name] = (
            "a damaged part is read from its other copies (a peer, the warm tier) meanwhile; "
            f"`ckpt restore {ck.ref}` on this host gathers every part here again"
        )
    else:
        report.ok.append(name)


def verify_replicas(
    store: StoreCore,
    *,
    ref: str | None = None,
    tier: str | None = None,
    run: str | None = None,
    repair: bool = True,
    deep: bool = True,
    owner: str | None = None,
    threads: int = 4,
    key: str | os.PathLike[str] | None = None,
) -> VerifyReport:
    """Re-hash replicas, mark damaged ones DAMAGED and (with ``repair``) fix them.

    Checkpoints are visited oldest first so a base is repaired before the deltas reading its
    chunks. Each checked replica gets a ``verified`` event (``ok`` and the problems); a
    repaired one also gets ``repaired`` (with the donor tier) and becomes PRESENT again.

    Args:
        store: The open store.
        ref: Only this checkpoint.
        tier: Only replicas on this tier.
        run: Only this run.
        repair: Copy damaged replicas again from an intact one.
        deep: Re-hash every chunk (False: presence and sizes only).
        owner: Lease owner for repairs (default: unique per call).
        threads: Parallel transfers during repair.
        key: Private key that opens sealed copies (encrypted tiers) for a full check
            (default ``$CKPT_DECRYPT_KEY``, else ``decrypt_key``; without one: envelopes,
            objects and sizes only).

    Returns:
        The :class:`VerifyReport`.

    Raises:
        CheckpointNotFoundError: If ``ref`` does not resolve.
    """
    report = VerifyReport()
    owner = lease_owner(owner)
    tiers = store_tiers(store)
    if ref is not None:
        todo = [store.catalog.get(ref)]
    else:
        todo = store.catalog.list(run=run, state=CheckpointState.COMMITTED,
                                  order_by="created_at")
    for ck in sorted(todo, key=lambda c: (c.created_at, c.version)):
        for replica in sorted(ck.replicas, key=lambda r: tier_rank(r.tier)):
            if tier is not None and replica.tier != tier:
                continue
            name = f"{ck.id}@{replica.tier}"
            if replica.state not in _CHECKED_STATES:
                continue
            if replica.tier not in tiers:
                report.skipped[name] = f"tier {replica.tier} is not configured here"
                continue
            target = tiers[replica.tier]
            report.checked.append(name)
            if ck.parted and replica.tier == "hot" and store.settings.hot_remote is None:
                # Saved across hosts: this host checks the parts its own disk holds (and
                # records each); the other hosts' parts are theirs to check.
                _verify_parts(store, ck, name, deep, owner, report)
                continue
            try:
                problems = check_replica(store, ck, target, deep=deep, key=key)
            except CkptError as exc:
                report.skipped[name] = f"could not check: {exc}"
                logger.warning("cannot verify %s: %s", name, exc)
                continue
            store.catalog.record_event(
                "verified", checkpoint_id=ck.id, actor=owner,
                detail={"tier": replica.tier, "ok": not problems, "deep": deep,
                        "problems": problems[:20]},
            )
            if not problems:
                report.ok.append(name)
                store.catalog.set_replica(ck.id, replica.tier, state=ReplicaState.PRESENT,
                                          verified=True)
                continue
            report.damaged[name] = problems
            logger.warning("%s copy of %s is damaged: %s", replica.tier, ck.ref, problems[0])
            store.catalog.set_replica(ck.id, replica.tier, state=ReplicaState.DAMAGED)
            if not repair:
                continue
            try:
                donor = _repair(store, store.catalog.get_any(ck.id), target, deep=deep,
                                owner=owner, threads=threads)
            except CkptError as exc:
                report.unrepaired[name] = str(exc)
                logger.warning("could not repair %s: %s", name, exc)
                continue
            report.repaired.append(name)
            store.catalog.record_event(
                "repaired", checkpoint_id=ck.id, actor=owner,
                detail={"tier": replica.tier, "from": donor, "problems": problems[:20]},
            )
            logger.info("repaired the %s copy of %s from %s", replica.tier, ck.ref, donor)
    return report
