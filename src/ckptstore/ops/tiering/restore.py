"""Restore: bring a checkpoint back to the hot tier (or into any directory) and verify it.

The copy comes from the fastest tier holding a PRESENT replica (hot → warm → cold); if that
copy turns out damaged or unreachable the next one is tried. When no readable copy is left but
an archival one (S3 GLACIER) is, that copy is thawed first (:mod:`ckptstore.ops.tiering.thaw`: a
``ThawPendingError`` until S3 has restored its objects, then it is read like any other tier).
Chunks a delta reads from other checkpoints (dedup) are restored into their owners'
directories, so the usual ``locate`` (``<hot>/<run>/<id>``) finds them.

A copy re-encoded with the archive codec (:mod:`ckptstore.ops.tiering.reencode`) is restored as it
is: self-contained, in the archive codec, with its own manifest, whose digest the hot replica
then records too (:func:`~ckptstore.records.expected_digest`). Decoding it back into the
original layout is not possible in general (lossy deltas cannot be re-derived from their
reconstructed values) and not needed: it loads bit-exactly like the original.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

from ckptstore.core import StoreCore
from ckptstore.errors import (
    CheckpointNotFoundError,
    CkptError,
    ConfigError,
    IncompleteCheckpointError,
    IntegrityError,
    LeaseHeldError,
    MissingBaseError,
    StorageError,
    ThawPendingError,
)
from ckptstore.format import Manifest, verify_checkpoint
from ckptstore.format.localize import link_shared_chunks
from ckptstore.identity import host
from ckptstore.names import validate_name
from ckptstore.ops.leases import acquire_lease, lease_owner
from ckptstore.ops.tiering.damage import mark_damaged
from ckptstore.ops.tiering.parts import gather_parts, parts_source, record_gathered
from ckptstore.ops.tiering.replicas import (
    delete_replica,
    manifest_on,
    run_resolver,
    store_tiers,
    tier_rank,
)
from ckptstore.ops.tiering.sealed_tier import restore_sealed, unseal_parts
from ckptstore.ops.tiering.thaw import thawed_source
from ckptstore.records import Checkpoint, CheckpointState, ReplicaState, expected_digest
from ckptstore.storage import (
    COMMIT_NAME,
    LocalTier,
    Tier,
    copy_checkpoint,
    copy_keys,
    foreign_chunks,
    is_not_found,
)
from ckptstore.storage.transfer import source_checker

__all__ = ["delete_replica", "ensure_hot", "hot_digest", "restore_checkpoint",
           "unseal_parts_here"]

logger = logging.getLogger(__name__)

Progress = Callable[[int], None]

_POLL_S = 0.2


def _sources(store: StoreCore, ck: Checkpoint, exclude: str | None) -> list[Tier]:
    tiers = store_tiers(store)
    found = [
        tiers[r.tier]
        for r in ck.replicas
        if r.state == ReplicaState.PRESENT and r.tier in tiers and r.tier != exclude
        and tiers[r.tier].readable
    ]
    return sorted(found, key=lambda t: tier_rank(t.name))


def _key_of(tier: Tier, run_of: Callable[[str], str]) -> Callable[[str, str], str]:
    return lambda owner, rel: tier.key_for(run_of(owner), owner, rel)


def _restore_foreign(
    store: StoreCore,
    ck: Checkpoint,
    manifest: Manifest,
    first: Tier,
    target: Tier,
    run_of: Callable[[str], str],
    *,
    threads: int,
    progress: Progress | None,
    repair: bool = False,
) -> None:
    """Put the chunks ``ck`` reads from other checkpoints into their owners' dirs on target.

    With ``repair`` (restoring over a damaged copy) the chunks already there are checked too
    (size and crc32c against the manifest), and the damaged ones are copied again: the
    damage a read found may lie in a chunk another checkpoint owns.
    """
    tiers = sorted(store_tiers(store).values(), key=lambda t: tier_rank(t.name))
    check_target = source_checker(manifest, _key_of(target, run_of)) if repair else None
    for owner, refs in foreign_chunks(manifest).items():
        owner_run = run_of(owner)
        have = set(target.list_prefix(target.prefix_for(owner_run, owner)))
        missing = [r for r in refs if target.key_for(owner_run, owner, r.rel) not in have
                   or (check_target is not None
                       and _damaged_on(target, target.key_for(owner_run, owner, r.rel),
                                       check_target))]
        if not missing:
            continue
        problems: list[str] = []
        for tier in [first, *(t for t in tiers if t is not first)]:
            if not tier.readable or tier.url == target.url:
                continue
            pairs = [
                (tier.key_for(owner_run, owner, r.rel), target.key_for(owner_run, owner, r.rel))
                for r in missing
            ]
            check = source_checker(manifest, _key_of(tier, run_of))
            try:
                copy_keys(tier, target, pairs, threads=threads, progress=progress,
                          check_source=check)
                break
            except (StorageError, IntegrityError) as exc:
                problems.append(f"{tier.name}: {exc}")
        else:
            raise MissingBaseError(
                f"checkpoint {ck.ref} ({ck.id}) reads {len(missing)} chunks stored with "
                f"checkpoint {owner}, and no tier has them intact ({'; '.join(problems)}); "
                "it cannot be restored"
            )


def _damaged_on(tier: Tier, key: str, check: Callable[[str, bytes], str | None]) -> bool:
    """Whether the chunk file ``key`` on ``tier`` fails its size and crc32c."""
    try:
        return check(key, tier.get_bytes(key)) is not None
    except StorageError:
        return True  # unreadable is as good as damaged: copy it again


def _drop_stale_links(directory: Path, manifest: Manifest,
                      locate: Callable[[str], Path]) -> None:
    """Remove the links in ``directory`` to chunks of other checkpoints that are no longer
    the owner's file (it was replaced by a repair): reads then use the owner's file, and
    :func:`link_shared_chunks` links the new one in."""
    for array in manifest.arrays.values():
        for chunk in array.chunks:
            if chunk.src is None:
                continue
            own = directory / array.chunk_path(chunk.i)
            if not os.path.lexists(own):
                continue
            source = Path(locate(chunk.src)) / array.chunk_path(chunk.i)
            try:
                same = os.path.samefile(own, source)
            except OSError:
                same = False
            if not same:
                logger.info("dropping the stale link %s (its owner's chunk was repaired)", own)
                own.unlink(missing_ok=True)


def _restore_from(
    store: StoreCore,
    ck: Checkpoint,
    src: Tier,
    target: Tier,
    *,
    threads: int,
    progress: Progress | None,
    deep: bool,
    record: bool,
    actor: str,
    depth: int,
    repair: bool = False,
    key: str | os.PathLike[str] | None = None,
) -> tuple[Path, int, str | None]:
    """Restore ``ck`` from ``src``; return its directory, bytes and the copy's own digest
    (None when the copy holds the checkpoint's manifest). ``repair``: the target holds a
    damaged copy of ``ck`` to restore over. A sealed copy (an encrypted tier) is decrypted
    with ``key`` (or ``$CKPT_DECRYPT_KEY``, ``decrypt_key``) and checked in full before
    anything is written to ``target`` (:mod:`ckptstore.ops.tiering.sealed_tier`)."""
    replica = ck.replica(src.name)
    if replica is not None and replica.sealed:
        unsealed, nbytes, plain = restore_sealed(store, ck, src, target, key=key,
                                                 threads=threads, progress=progress)
        return unsealed, nbytes, (None if plain.digest == ck.manifest_digest
                                  else plain.digest)
    run_of = run_resolver(store, ck)
    manifest = manifest_on(src, ck)
    # Bases come back whole first: the reader needs each base directory to be a committed
    # checkpoint. Chunks of bases that exist nowhere whole are then copied one by one.
    for base_id in sorted(manifest.referenced_checkpoints()):
        base = store.catalog.get_any(base_id)
        base_dir = target.local_dir(base.run, base.id)
        if base_dir is not None and (base_dir / COMMIT_NAME).is_file():
            continue
        if depth < 64 and base.state == CheckpointState.COMMITTED and _sources(
                store, base, exclude=target.name if record else None):
            if record:
                _restore_hot(store, base, threads=threads, progress=progress, deep=deep,
                             actor=actor, wait_s=600.0, depth=depth + 1)
            else:
                _restore_into(store, base, target, record=False, threads=threads,
                              progress=progress, deep=deep, actor=actor, depth=depth + 1)
    _restore_foreign(store, ck, manifest, src, target, run_of, threads=threads,
                     progress=progress, repair=repair)
    directory = target.local_dir(ck.run, ck.id)
    assert directory is not None  # restore targets are local

    def locate(ckpt_id: str) -> Path:
        found = target.local_dir(run_of(ckpt_id), ckpt_id)
        assert found is not None
        return found

    if repair and directory.is_dir():
        _drop_stale_links(directory, manifest, locate)
    nbytes = copy_checkpoint(src, target, ck.run, ck.id, manifest, threads=threads,
                             progress=progress, run_of=run_of)
    # Shared chunks were restored into their owners' directories: link them in, so the
    # local copy is a complete Zarr group again, as a fresh save leaves it.
    link_shared_chunks(directory, manifest, locate)
    problems = verify_checkpoint(directory, manifest, locate=locate, deep=deep)
    if problems:
        raise IntegrityError(
            f"the copy of {ck.ref} restored from {src.name} fails verification: "
            + "; ".join(problems[:5])
            + f"; run `ckpt verify {ck.ref}` to repair the {src.name} copy"
        )
    digest = expected_digest(ck, src.name)
    return directory, nbytes, None if digest == ck.manifest_digest else digest


def _restore_into(
    store: StoreCore,
    ck: Checkpoint,
    target: Tier,
    *,
    record: bool,
    threads: int,
    progress: Progress | None,
    deep: bool,
    actor: str,
    depth: int = 0,
    archival: tuple[Tier, ...] = (),
    repair: bool = False,
    key: str | os.PathLike[str] | None = None,
) -> Path:
    """Restore ``ck`` into ``target`` from the fastest good copy (``archival``: only from
    these thawed views of archival tiers; ``repair``: over a damaged copy on ``target``).

    A local source whose copy turns out damaged on the way is checked and, when damaged,
    marked so (:func:`~ckptstore.ops.tiering.damage.mark_damaged`) before the next one is
    tried."""
    sources = list(archival) or _sources(store, ck, exclude=target.name if record else None)
    from_thaw = bool(archival)
    if not sources:
        # Only an archival (GLACIER) copy, if any: thawed_source asks S3 to restore it and
        # raises ThawPendingError until every object is readable.
        thawed = thawed_source(store, ck, key=key)
        if thawed is None:
            where = ", ".join(f"{r.tier}:{r.state}" for r in ck.replicas) or "none"
            raise CheckpointNotFoundError(
                f"checkpoint {ck.ref} ({ck.id}) has no readable PRESENT copy on a configured "
                f"tier (replicas: {where}); check the tier configuration"
            )
        sources, from_thaw = [thawed], True
    failures: list[CkptError] = []
    for src in sources:
        try:
            directory, nbytes, digest = _restore_from(store, ck, src, target, threads=threads,
                                              progress=progress, deep=deep, record=record,
                                              actor=actor, depth=depth, repair=repair,
                                              key=key)
        except (IntegrityError, IncompleteCheckpointError, StorageError) as exc:
            logger.warning("restoring %s from %s failed: %s", ck.ref, src.name, exc)
            failures.append(exc)
            _mark_if_damaged(store, ck, src, exc, deep=deep)
            continue
        if record:
            store.catalog.set_replica(ck.id, target.name, uri=str(directory),
                                      state=ReplicaState.PRESENT, bytes=nbytes, verified=True,
                                      manifest_digest=digest)
        store.catalog.record_event(
            "restored",
            checkpoint_id=ck.id,
            actor=actor,
            detail={"from": src.name, "tier": target.name if record else None,
                    "path": str(directory), "bytes": nbytes},
        )
        logger.info("restored %s (%s) from %s to %s", ck.ref, ck.id, src.name, directory)
        if from_thaw:
            store.catalog.finish_thaw(ck.id, src.name)
        return directory
    tried = "; ".join(f"{s.name}: {e}" for s, e in zip(sources, failures, strict=True))
    if not from_thaw:
        # Every readable copy failed; an archival copy may still be good once thawed.
        try:
            thawed = thawed_source(store, ck, key=key)
        except ThawPendingError as exc:
            exc.add_note("tried: " + tried)
            raise
        if thawed is not None:
            return _restore_into(store, ck, target, record=record, threads=threads,
                                 progress=progress, deep=deep, actor=actor, depth=depth,
                                 archival=(thawed,), repair=repair, key=key)
    last = failures[-1]
    last.add_note("tried: " + tried)
    raise last


def _mark_if_damaged(store: StoreCore, ck: Checkpoint, src: Tier, exc: CkptError, *,
                     deep: bool) -> None:
    """After a restore from ``src`` failed: when ``src`` is a local copy that fails its own
    check, mark it DAMAGED. A remote copy is left to ``ckpt verify`` (a failure there is
    as likely the network); so is a failure that is not about the bytes (a missing base)."""
    replica = ck.replica(src.name)
    if replica is not None and replica.sealed:
        return  # not a checkpoint directory; `ckpt verify` checks sealed copies
    directory = src.local_dir(ck.run, ck.id)
    if directory is None or isinstance(exc, MissingBaseError) or (
            isinstance(exc, StorageError) and not is_not_found(exc)):
        return
    run_of = run_resolver(store, ck)

    def locate(ckpt_id: str) -> Path:
        found = src.local_dir(run_of(ckpt_id), ckpt_id)
        assert found is not None
        return found

    try:
        manifest = manifest_on(src, ck, use_cache=False)
        problems = verify_checkpoint(directory, manifest, locate=locate, deep=deep)
    except (IntegrityError, IncompleteCheckpointError, CheckpointNotFoundError) as err:
        problems = [f"manifest: {err}"]
    except StorageError:
        return
    if problems:
        mark_damaged(store, ck, src.name, problems, found_by="restore",
                     seen=ck.replica(src.name))


def restore_checkpoint(
    store: StoreCore,
    ref: str,
    *,
    to: str | os.PathLike[str] | None = None,
    progress: Progress | None = None,
    threads: int = 4,
    deep: bool = True,
    owner: str | None = None,
    wait_s: float = 600.0,
    key: str | os.PathLike[str] | None = None,
) -> Path:
    """Restore a committed checkpoint and verify it.

    Without ``to`` the copy goes to the hot tier and is recorded there (replica PRESENT,
    verified, event ``restored``); concurrent restores of the same checkpoint wait for each
    other through the ``restore:hot`` lease. With ``to`` the directory is treated as a tier
    root: the checkpoint lands in ``<to>/<run>/<id>/`` (chunks read from other checkpoints in
    their ``<to>/<run>/<owner id>/``), nothing is recorded but the event.

    Args:
        store: The open store.
        ref: Checkpoint reference.
        to: Target root directory instead of the hot tier.
        progress: Called with the byte count of each file written.
        threads: Parallel transfers.
        deep: Re-hash every chunk after the copy (blake3 of the decoded chunk).
        owner: Lease owner (default: unique per call).
        wait_s: How long to wait for another restore of the same checkpoint.
        key: Private key that opens a sealed copy (an encrypted tier, ``encrypt_to``);
            default ``$CKPT_DECRYPT_KEY``, else the ``decrypt_key`` setting.

    Returns:
        The restored checkpoint directory.

    Raises:
        CheckpointNotFoundError: If the reference does not resolve or no tier holds a copy.
        IntegrityError: If every copy is damaged (MissingBaseError when a base's chunks are).
        StorageError: If the tiers holding copies are unreachable.
        LeaseHeldError: If another restore holds the lease for longer than ``wait_s``.
        DecryptionError: If the only copies are sealed and no key, or a key they were not
            encrypted to, was given, or they are altered or truncated (nothing is written).
    """
    ck = store.catalog.get(ref)
    actor = lease_owner(owner)
    if ck.parted:
        return _restore_parts(store, ck, to, actor, key=key)
    if to is not None:
        target = LocalTier(to, name="restore-target")
        # Reads the source tiers like a hot restore: retention must not delete under it.
        _lease_against_retention(store, ck, "restore", actor, wait_s)
        try:
            return _restore_into(store, store.catalog.get(ck.id), target, record=False,
                                 threads=threads, progress=progress, deep=deep, actor=actor,
                                 key=key)
        finally:
            store.catalog.release_lease(ck.id, "restore", actor)
    return _restore_hot(store, ck, threads=threads, progress=progress, deep=deep,
                        actor=actor, wait_s=wait_s, depth=0, key=key)


def _restore_parts(store: StoreCore, ck: Checkpoint, to: str | os.PathLike[str] | None,
                   actor: str, *, key: str | os.PathLike[str] | None = None) -> Path:
    """Gather every part of a checkpoint saved across hosts into one directory: this host's
    hot directory (each part then recorded as kept here too) or ``<to>/<run>/<id>``.

    Parts are read where they are in the clear (this host's disk, plain shared copies);
    when some part is in none of them but a sealed copy (an encrypted tier) is PRESENT, the
    whole checkpoint is decrypted from that copy with ``key`` instead."""
    if to is None and store.settings.hot_remote is not None:
        raise ConfigError(
            f"{ck.ref} lives in the hot tier in object storage ({store.settings.hot_remote}); "
            "there is nothing to restore to the hot tier: load it, or restore it with --to DIR"
        )
    directory = (store.checkpoint_dir(ck.run, ck.id) if to is None
                 else Path(to) / validate_name(ck.run) / ck.id)
    _lease_against_retention(store, ck, "restore", actor, 600.0)
    try:
        current = store.catalog.get_any(ck.id)
        sealed = _sealed_for_parts(store, current)
        if sealed is not None:
            nbytes = _unseal_parts(store, current, sealed, directory, record=to is None,
                                   key=key)
            source = sealed.name
        else:
            nbytes = gather_parts(store, current, directory, record=to is None,
                                  thaw=thawed_source)
            source = "parts"
    finally:
        store.catalog.release_lease(ck.id, "restore", actor)
    store.catalog.record_event(
        "restored", checkpoint_id=ck.id, actor=actor,
        detail={"from": source, "tier": "hot" if to is None else None, "path": str(directory),
                "bytes": nbytes, "host": host()},
    )
    return directory


def _sealed_for_parts(store: StoreCore, ck: Checkpoint) -> Tier | None:
    """The tier of the sealed copy to restore ``ck`` (saved across hosts) from: the fastest
    readable one with a PRESENT sealed copy, when some part is readable nowhere in the
    clear from this host; else None (the parts are gathered where they are)."""
    tiers = store_tiers(store)
    sealed = sorted((tiers[r.tier] for r in ck.replicas
                     if r.sealed and r.state == ReplicaState.PRESENT and r.tier in tiers
                     and tiers[r.tier].readable), key=lambda t: tier_rank(t.name))
    if not sealed:
        return None
    _, source = parts_source(store, ck)
    return sealed[0] if source.missing() else None


def _unseal_parts(store: StoreCore, ck: Checkpoint, src: Tier, directory: Path, *,
                  record: bool, key: str | os.PathLike[str] | None) -> int:
    """Decrypt the sealed copy of ``ck`` on ``src`` into ``directory``; with ``record`` (this
    host's hot directory) every part is recorded as kept here. Nothing is written, to the
    directory or the catalog, unless the whole copy decrypts and verifies."""
    me = host()
    kept = {p.part for p in store.catalog.parts(ck.id, "hot")
            if p.stored_on == me and p.state == ReplicaState.PRESENT}

    def copying(manifest: Manifest) -> None:
        if record:
            for part in ck.hosts:
                if part not in kept:
                    store.catalog.set_part(ck.id, "hot", part, stored_on=me,
                                           state=ReplicaState.COPYING)

    nbytes, manifest = unseal_parts(store, ck, src, directory, key=key, before_write=copying)
    if record:
        record_gathered(store, ck, manifest, directory)
    return nbytes


def unseal_parts_here(store: StoreCore, ck: Checkpoint) -> bool:
    """Restore ``ck`` (saved across hosts) onto this host's disk from a sealed copy, when
    some part is readable nowhere in the clear and a sealed copy is PRESENT: what a load
    does (:func:`~ckptstore.ops.tiering.parts.parts_source`'s ``unseal``), with the key
    from ``$CKPT_DECRYPT_KEY`` or ``decrypt_key``. Ranks of this host loading at once wait
    for each other (the ``restore`` lease); the later ones find the parts here.

    Returns:
        True when every part is on this host's disk now; False without a sealed copy.

    Raises:
        DecryptionError: Without a key, with a key the copy was not encrypted to, or if the
            copy is damaged (nothing is written).
    """
    if store.settings.hot_remote is not None or not any(
            r.sealed and r.state == ReplicaState.PRESENT for r in ck.replicas):
        return False
    actor = lease_owner(None)
    _restore_parts(store, ck, None, actor)
    return True


def _restore_hot(
    store: StoreCore,
    ck: Checkpoint,
    *,
    threads: int,
    progress: Progress | None,
    deep: bool,
    actor: str,
    wait_s: float,
    depth: int,
    key: str | os.PathLike[str] | None = None,
) -> Path:
    """Restore onto the hot tier under the ``restore:hot`` lease (waiting for another one)."""
    hot = store_tiers(store)["hot"]
    directory = store.checkpoint_dir(ck.run, ck.id)
    if _lease_against_retention(store, ck, "restore:hot", actor, wait_s):
        return directory
    try:
        current = store.catalog.get_any(ck.id)
        replica = current.replica("hot")
        if replica is not None and replica.state == ReplicaState.PRESENT:
            return directory
        # Over a damaged copy (marked by a read or the scrub): what is there is checked, not
        # trusted, shared chunks of other checkpoints included.
        damaged = replica is not None and replica.state == ReplicaState.DAMAGED
        return _restore_into(store, current, hot, record=True, threads=threads,
                             progress=progress, deep=deep, actor=actor, depth=depth,
                             repair=damaged, key=key)
    finally:
        store.catalog.release_lease(ck.id, "restore:hot", actor)


def _lease_against_retention(store: StoreCore, ck: Checkpoint, purpose: str, actor: str,
                             wait_s: float) -> bool:
    """Take lease ``purpose`` on ``ck`` while no retention run is deleting it.

    Retention takes its ``retention`` lease, then checks everyone else's; we take ours, then
    check retention's. Whichever order the two run in, one of them sees the other and backs
    off, so a checkpoint is never deleted while it is being restored. A lease left by a
    killed process on this host is taken over at once.

    Returns:
        True (without a lease) when a hot restore is not needed any more: the hot copy is
        PRESENT.

    Raises:
        CheckpointNotFoundError: If the checkpoint stopped being COMMITTED (it was pruned).
        LeaseHeldError: If another restore or a retention run holds on past ``wait_s``.
    """
    deadline = time.monotonic() + wait_s
    while True:
        current = store.catalog.get_any(ck.id)
        if current.state != CheckpointState.COMMITTED:
            raise CheckpointNotFoundError(
                f"checkpoint {ck.ref} ({ck.id}) was pruned while waiting to restore it (state "
                f"{current.state}); `ckpt events {ck.id}` shows its history"
            )
        replica = current.replica("hot")
        if purpose == "restore:hot" and replica is not None and \
                replica.state == ReplicaState.PRESENT:
            return True
        blocker = None
        if acquire_lease(store, ck.id, purpose, actor, max(wait_s, 60.0)):
            blocker = store.catalog.lease_holder(ck.id, "retention")
            if blocker is None:
                # Taken while retention cannot be deleting it: the state is final for now.
                if store.catalog.get_any(ck.id).state == CheckpointState.COMMITTED:
                    return False
                store.catalog.release_lease(ck.id, purpose, actor)
                continue
            store.catalog.release_lease(ck.id, purpose, actor)
        else:
            blocker = store.catalog.lease_holder(ck.id, purpose)
        if time.monotonic() > deadline:
            raise LeaseHeldError(
                f"{ck.ref} is busy ({blocker}) after {wait_s:.0f}s: another restore or a "
                "retention run is working on it; retry later"
            )
        time.sleep(_POLL_S)


def hot_digest(store: StoreCore, ck: Checkpoint) -> str | None:
    """The digest the hot copy's manifest must have (after :func:`ensure_hot`).

    ``ck`` may predate a restore that just brought a re-encoded copy to the hot tier; the
    catalog is only asked again in that case.
    """
    replica = ck.replica("hot")
    if replica is None or replica.state != ReplicaState.PRESENT:
        ck = store.catalog.get_any(ck.id)
    return expected_digest(ck, "hot")


def ensure_hot(store: StoreCore, ck: Checkpoint, *,
               key: str | os.PathLike[str] | None = None) -> Path:
    """The checkpoint's hot directory, restoring it first when only other tiers hold it.

    This is what makes ``store.load`` of an archived checkpoint transparent. ``key`` opens a
    sealed copy (default ``$CKPT_DECRYPT_KEY``, else ``decrypt_key``).

    Raises:
        As :func:`restore_checkpoint`.
    """
    if ck.parted:
        # Saved across hosts: this host's directory holds only its own part(s); loads read
        # each part where it is (ckptstore.ops.tiering.parts) instead of calling this.
        raise IncompleteCheckpointError(
            f"{ck.ref} ({ck.id}) was saved across hosts ({', '.join(ck.hosts)}) and no single "
            "directory holds it: load it with store.load / store.dcp_reader, or gather it "
            f"with `ckpt restore {ck.ref}` (or --to DIR)"
        )
    replica = ck.replica("hot")
    if replica is not None and replica.state == ReplicaState.PRESENT:
        return store.checkpoint_dir(ck.run, ck.id)
    return restore_checkpoint(store, ck.id, key=key)
