"""Replica plumbing shared by archive, restore, verify and retention.

* :func:`store_tiers` / :func:`tier_of`: the store's configured tiers.
* :func:`manifest_on` / :func:`manifest_of`: a checkpoint's manifest read from a tier and
  checked against the digest the catalog records for that copy
  (:func:`~ckptstore.records.expected_digest`: a copy re-encoded with the archive codec has
  a manifest of its own); a digest this process already parsed is served from the format's
  manifest cache (:func:`~ckptstore.format.manifest.known_manifest`) without a read.
* :func:`referenced_chunks`: which chunk files on a tier other checkpoints still read
  (dedup, and the base chunks of delta-encoded chunks), so deleting one checkpoint's copy
  never breaks another.
* :func:`delete_replica`: the one safe way to delete a copy; it also frees the kept chunk
  files of already deleted checkpoints once nothing reads them any more. Deleting a copy
  that is already gone (its files removed by hand, a lost disk) completes: the replica is
  recorded DELETED and the ``replica_deleted`` event says ``already_gone``.
* :func:`copy_is_absent`: whether a copy has no file at all on its tier (a lost copy).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any

import blake3

from ckptstore.core import StoreCore
from ckptstore.errors import (
    CheckpointNotFoundError,
    ConflictError,
    IncompleteCheckpointError,
    IntegrityError,
    StorageError,
)
from ckptstore.format import Manifest, read_manifest
from ckptstore.format.constants import chunk_rel
from ckptstore.format.manifest import known_manifest, parse_verified
from ckptstore.format.sealed import ENVELOPE_NAME
from ckptstore.identity import host
from ckptstore.ops.tiering.parts import parted_manifest, remove_local_parts
from ckptstore.records import (
    SEALED_DIR,
    TIER_ORDER,
    Checkpoint,
    CheckpointState,
    ReplicaState,
    expected_digest,
)
from ckptstore.storage import (
    COMMIT_NAME,
    MANIFEST_NAME,
    Tier,
    is_not_found,
)

__all__ = [
    "ChunkId",
    "copy_is_absent",
    "delete_replica",
    "dependents",
    "manifest_of",
    "manifest_on",
    "record_parts_deleted",
    "referenced_chunks",
    "release_chunks",
    "run_resolver",
    "store_tiers",
    "tier_of",
    "tier_rank",
]

logger = logging.getLogger(__name__)

#: ``(owner checkpoint id, array name, chunk index)``: one chunk file on a tier.
ChunkId = tuple[str, str, int]

# Replica states whose copy is (or is becoming) usable, so its chunk references count.
_LIVE = frozenset({ReplicaState.PRESENT, ReplicaState.COPYING, ReplicaState.DAMAGED})

def tier_rank(name: str) -> int:
    """Sort key: hot < warm < cold < any other tier."""
    return TIER_ORDER.index(name) if name in TIER_ORDER else len(TIER_ORDER)


def store_tiers(core: StoreCore) -> dict[str, Tier]:
    """The store's tiers by name (see :attr:`~ckptstore.core.StoreCore.tiers`)."""
    return dict(core.tiers)


def tier_of(core: StoreCore, name: str) -> Tier:
    """The tier called ``name`` (see :meth:`~ckptstore.core.StoreCore.tier`).

    Raises:
        ConfigError: If the store has no such tier configured.
    """
    return core.tier(name)


def run_resolver(store: StoreCore, ck: Checkpoint) -> Callable[[str], str]:
    """Map checkpoint ids to run names (for chunks owned by other checkpoints), cached."""
    known = {ck.id: ck.run}

    def run_of(ckpt_id: str) -> str:
        if ckpt_id not in known:
            known[ckpt_id] = store.catalog.get_any(ckpt_id).run
        return known[ckpt_id]

    return run_of


def manifest_on(tier: Tier, ck: Checkpoint, *, use_cache: bool = True,
                digest: str | None = None) -> Manifest:
    """Read a checkpoint's manifest from one tier and check it against the catalog.

    Args:
        tier: The tier to read from.
        ck: The catalog record.
        use_cache: Return the manifest this process already parsed from bytes with the
            expected digest, if any, without reading the tier
            (:func:`~ckptstore.format.manifest.known_manifest`).
        digest: The expected digest (default: what the catalog records for the copy on
            ``tier``, :func:`~ckptstore.records.expected_digest`).

    Raises:
        IncompleteCheckpointError: If the copy has no ``COMMITTED`` marker.
        IntegrityError: If the manifest is damaged or is not the one the catalog recorded.
        StorageError: If the tier fails.
    """
    expect = digest if digest is not None else expected_digest(ck, tier.name)
    if use_cache:
        cached = known_manifest(expect, ck.id)
        if cached is not None:
            return cached
    local = tier.local_dir(ck.run, ck.id)
    if local is not None:
        # Both reads parse through the format's cache, which the lookup above consults.
        return read_manifest(local, expected_digest=expect)
    return _remote_manifest(tier, ck, expect)


def _remote_manifest(tier: Tier, ck: Checkpoint, expect: str | None) -> Manifest:
    where = f"{tier.name} copy of {ck.ref} ({ck.id})"
    try:
        marker = tier.get_bytes(tier.key_for(ck.run, ck.id, COMMIT_NAME))
    except StorageError as exc:
        if is_not_found(exc):
            raise IncompleteCheckpointError(
                f"the {where} has no {COMMIT_NAME} marker: it is incomplete; rerun the "
                "archive or verify flow to redo it"
            ) from exc
        raise
    data = tier.get_bytes(tier.key_for(ck.run, ck.id, MANIFEST_NAME))
    digest = blake3.blake3(data).hexdigest()
    if marker.decode("ascii", "replace").strip() != digest:
        raise IntegrityError(
            f"the manifest of the {where} has digest {digest}, which its {COMMIT_NAME} marker "
            "does not record: it is damaged; run `ckpt verify` to repair it"
        )
    if expect is not None and digest != expect:
        raise IntegrityError(
            f"the manifest of the {where} has digest {digest}, but the catalog recorded "
            f"{expect}: it is not this checkpoint; run `ckpt verify` to repair it"
        )
    return parse_verified(data, digest)


def manifest_of(store: StoreCore, ck: Checkpoint, *, tier: str | None = None) -> Manifest:
    """The checkpoint's manifest, from its fastest PRESENT replica.

    Args:
        store: The open store.
        ck: The checkpoint.
        tier: Return the manifest of the copy on this tier (which differs from the
            checkpoint's own when that copy was re-encoded), read from any copy holding the
            same manifest. Default: the checkpoint's own manifest, or failing that any
            copy's (every copy holds the same tensors).

    Raises:
        CheckpointNotFoundError: If no configured tier holds a readable copy.
    """
    wanted = expected_digest(ck, tier) if tier is not None else ck.manifest_digest
    cached = known_manifest(wanted, ck.id)
    if cached is not None:
        return cached
    if ck.parted:
        # No disk every host reaches holds it: the catalog does (checked against the digest).
        return parted_manifest(store, ck)[0]
    tiers = store_tiers(store)
    errors: list[str] = []

    def order(r: Any) -> tuple[bool, bool, int]:
        # Copies holding the wanted manifest first; archival tiers (GLACIER) last: their
        # manifest objects are readable, their chunks not.
        return (expected_digest(ck, r.tier) != wanted,
                not tiers[r.tier].readable if r.tier in tiers else True, tier_rank(r.tier))

    for replica in sorted(ck.replicas, key=order):
        source = tiers.get(replica.tier)
        if source is None or replica.state != ReplicaState.PRESENT or replica.sealed:
            continue  # a sealed copy's manifest is encrypted: read it after a restore
        if tier is not None and expected_digest(ck, replica.tier) != wanted:
            continue
        try:
            return manifest_on(source, ck)
        except (IntegrityError, IncompleteCheckpointError, StorageError) as exc:
            errors.append(f"{replica.tier}: {exc}")
    raise CheckpointNotFoundError(
        f"no readable copy of {ck.ref} ({ck.id}) holds its manifest"
        + (f" ({'; '.join(errors)})" if errors else "")
        + "; run `ckpt verify` to find and repair damaged copies"
    )


def _reads_on(store: StoreCore, ck: Checkpoint, tier: str) -> Manifest | None:
    """The manifest whose chunk references the copy of ``ck`` on ``tier`` follows.

    None for a re-encoded copy: it is self-contained by construction (every chunk its own,
    raw; see :mod:`ckptstore.ops.tiering.reencode`), so it reads no other checkpoint's files. Any
    other copy follows the checkpoint's own manifest (a COPYING re-encode has no digest
    recorded yet and so counts with the original's references: the safe side).
    """
    replica = ck.replica(tier)
    if replica is not None and (replica.manifest_digest is not None or replica.sealed):
        return None  # re-encoded or sealed: self-contained
    return manifest_of(store, ck, tier=tier)


def copy_is_absent(store: StoreCore, ck: Checkpoint, tier: str) -> bool:
    """Whether the copy of ``ck`` on ``tier`` has no file left at all (it is lost).

    Raises:
        ConfigError: If the tier is not configured.
        StorageError: If the tier cannot be listed (that says nothing about the copy).
    """
    target = tier_of(store, tier)
    replica = ck.replica(tier)
    if replica is not None and replica.sealed:
        return not target.list_prefix(f"{SEALED_DIR}/{replica.sealed}/")
    return not target.list_prefix(target.prefix_for(ck.run, ck.id))


def _live_reads(store: StoreCore, ck: Checkpoint, tier: str) -> Manifest | None:
    """:func:`_reads_on`, except that a lost copy (no file left on the tier) reads nothing.

    Without that exception, one copy whose files were removed by hand made every deletion
    on the tier fail: what it reads could not be known, though it reads nothing any more.
    """
    try:
        return _reads_on(store, ck, tier)
    except CheckpointNotFoundError:
        if copy_is_absent(store, ck, tier):
            logger.info("the %s copy of %s (%s) is lost (no file left); it reads nothing",
                        tier, ck.ref, ck.id)
            return None
        raise


def referenced_chunks(
    store: StoreCore,
    tier: str,
    *,
    exclude: Iterable[str] = (),
) -> set[ChunkId]:
    """Chunks on ``tier`` that checkpoints read from another checkpoint's directory.

    Dedup means a chunk file owned (physically stored) by checkpoint A may be read by B, and
    a delta-encoded chunk of B is decoded against A's chunk with the same array and index.
    This collects, from the manifests of every COMMITTED checkpoint with a live replica
    (PRESENT, COPYING or DAMAGED) on ``tier``, each such chunk whose owner is another
    checkpoint (:meth:`~ckptstore.format.Manifest.chunk_refs`). Deleting A's copy on that
    tier must keep exactly these of A's chunk files.

    Known gap: a save still in progress (PENDING, no manifest yet) that deduplicates against
    A is not seen; retention keeps the newest checkpoint of each run, which is the base new
    saves use, so this does not arise in practice.

    Args:
        store: The open store.
        tier: Tier name.
        exclude: Checkpoint ids whose references do not count (the ones being deleted).

    Returns:
        ``{(owner id, array name, chunk index)}``.

    Raises:
        CheckpointNotFoundError: If a live replica's manifest cannot be read anywhere (the
            caller must then not delete anything: it cannot know what is still needed).
    """
    skip = set(exclude)
    out: set[ChunkId] = set()
    for ck in store.catalog.list(state=CheckpointState.COMMITTED, order_by="created_at"):
        replica = ck.replica(tier)
        if ck.id in skip or replica is None or replica.state not in _LIVE:
            continue
        manifest = _live_reads(store, ck, tier)
        if manifest is not None:
            out.update(ref for ref in manifest.chunk_refs() if ref[0] != ck.id)
    return out


def dependents(store: StoreCore, ck: Checkpoint, tier: str) -> list[Checkpoint]:
    """Live checkpoints on ``tier`` that read chunk files ``ck`` holds there (dedup)."""
    out = []
    for other in store.catalog.list(state=CheckpointState.COMMITTED, order_by="created_at"):
        replica = other.replica(tier)
        if other.id == ck.id or replica is None or replica.state not in _LIVE:
            continue
        manifest = _live_reads(store, other, tier)
        if manifest is not None and ck.id in manifest.referenced_checkpoints():
            out.append(other)
    return out


def delete_replica(
    store: StoreCore,
    ck: Checkpoint,
    tier: str,
    *,
    actor: str | None = None,
    force: bool = False,
    keep_referenced: bool = False,
) -> int:
    """Delete a checkpoint's copy on one tier, safely.

    Order: refuse if this is the last verified copy, or if other live checkpoints on the
    tier read its chunks → replica DELETING → remove the ``COMMITTED`` marker → remove the
    other files → replica DELETED → event ``replica_deleted``. Safe to rerun after a crash.

    Dedup: other checkpoints may read chunk files from this one's directory. By default a
    copy whose chunks are read by other live copies on the same tier is not deleted
    (ConflictError naming them): delete or compact the readers first. With
    ``keep_referenced=True`` the copy is deleted except exactly the chunk files
    :func:`referenced_chunks` reports (marker first, as always): chunk-level reclamation.
    The format's reader reads such kept chunks without the owner's marker, checking each
    against the size and crc32c in the reader's own manifest.

    Afterwards, chunk files that checkpoints deleted earlier kept for this copy's sake are
    freed when no live copy on the tier reads them any more (see :func:`release_chunks`).

    Args:
        store: The open store.
        ck: The checkpoint (re-read from the catalog here).
        tier: The tier whose copy goes.
        actor: Who deletes (recorded in the event).
        force: Delete even the last verified copy of a COMMITTED checkpoint (used when the
            checkpoint itself is being pruned).
        keep_referenced: Keep only the referenced chunk files instead of refusing.

    Returns:
        Number of files deleted.

    Raises:
        ConflictError: If the copy is the last PRESENT, verified copy of a COMMITTED
            checkpoint and ``force`` is False, or other copies read its chunks and
            ``keep_referenced`` is False.
        StorageError: If the tier fails; the replica stays DELETING and a rerun finishes.
    """
    ck = store.catalog.get_any(ck.id)
    if ck.parted and tier == "hot" and store.settings.hot_remote is None:
        return _delete_hot_parts(store, ck, actor=actor, force=force)
    if tier == "memory" and tier not in store_tiers(store):
        # A host-local copy in shared memory (ckptstore.ops.writing.memory), never a verified
        # copy and not a storage tier: forget it; its files go here or on its own host.
        from ckptstore.ops.writing.memory import drop_memory_copy

        return drop_memory_copy(store, ck, actor=actor)
    target = tier_of(store, tier)
    replica = ck.replica(tier)
    if (
        not force
        and ck.state == CheckpointState.COMMITTED
        and replica is not None
        and replica.state == ReplicaState.PRESENT
    ):
        others = [
            r for r in ck.replicas
            if r.tier != tier and r.state == ReplicaState.PRESENT and r.verified_at is not None
        ]
        if not others:
            raise ConflictError(
                f"refusing to delete the {tier} copy of {ck.ref} ({ck.id}): it is the last "
                "verified copy; archive or restore it to another tier first"
            )
    if replica is not None and replica.sealed:
        return _delete_sealed(store, ck, tier, target, replica.sealed, actor)
    prefix = target.prefix_for(ck.run, ck.id)
    if not target.list_prefix(prefix):
        # Already gone (removed by hand, a lost disk, or an earlier run of this delete):
        # nothing to delete and nothing any other checkpoint could still read from it.
        return _record_gone(store, ck, tier, target, prefix, actor)
    keep_ids = {
        (array, index)
        for owner, array, index in referenced_chunks(store, tier, exclude=[ck.id])
        if owner == ck.id
    }
    if keep_ids and not keep_referenced:
        readers = ", ".join(d.ref for d in dependents(store, ck, tier)[:5])
        raise ConflictError(
            f"refusing to delete the {tier} copy of {ck.ref} ({ck.id}): {len(keep_ids)} of its "
            f"chunk files are read by other checkpoints on {tier} ({readers}); delete or "
            "compact those first"
        )
    # Read before deleting: which other checkpoints' kept chunks this copy was reading.
    readers_of = _foreign_owners(store, target, ck)
    store.catalog.set_replica(ck.id, tier, state=ReplicaState.DELETING)
    keep = {target.key_for(ck.run, ck.id, f"{array}/c/{index}") for array, index in keep_ids}
    # The marker goes first and alone: from here on the copy is visibly incomplete.
    marker = target.key_for(ck.run, ck.id, COMMIT_NAME)
    deleted = 1 if target.delete(marker) else 0
    if keep:
        rest = [k for k in target.list_prefix(prefix) if k not in keep and k != marker]
        deleted += target.delete_keys(rest)
        logger.info("%s copy of %s: kept %d chunk files other checkpoints read",
                    tier, ck.ref, len(keep))
    else:
        deleted += target.delete_prefix(prefix)
    target.abort_multipart_uploads(prefix)
    record_parts_deleted(store, ck, tier)  # while DELETING: the aggregate stays so until all are
    store.catalog.set_replica(ck.id, tier, state=ReplicaState.DELETED, bytes=0)
    freed = release_chunks(store, tier, readers_of) if readers_of else 0
    store.catalog.record_event(
        "replica_deleted",
        checkpoint_id=ck.id,
        actor=actor,
        detail={"tier": tier, "files": deleted, "kept_chunks": len(keep),
                "freed_chunks": freed},
    )
    return deleted + freed


def _delete_sealed(store: StoreCore, ck: Checkpoint, tier: str, target: Tier, copy_id: str,
                   actor: str | None) -> int:
    """Delete a sealed copy (``.sealed/<copy id>/``): envelope first, as the marker of a
    plain copy, then the rest. No other copy reads its objects (each is self-contained and
    encrypted under its own key), so nothing is kept."""
    prefix = f"{SEALED_DIR}/{copy_id}/"
    if not target.list_prefix(prefix):
        return _record_gone(store, ck, tier, target, prefix, actor)
    store.catalog.set_replica(ck.id, tier, state=ReplicaState.DELETING)
    deleted = 1 if target.delete(prefix + ENVELOPE_NAME) else 0
    deleted += target.delete_prefix(prefix)
    target.abort_multipart_uploads(prefix)
    record_parts_deleted(store, ck, tier)  # while DELETING: the aggregate stays so until all are
    store.catalog.set_replica(ck.id, tier, state=ReplicaState.DELETED, bytes=0)
    store.catalog.record_event(
        "replica_deleted", checkpoint_id=ck.id, actor=actor,
        detail={"tier": tier, "files": deleted, "kept_chunks": 0, "freed_chunks": 0,
                "encrypted": True, "copy": copy_id},
    )
    return deleted


def record_parts_deleted(store: StoreCore, ck: Checkpoint, tier: str) -> None:
    """Record the parts of ``ck``'s copy on shared tier ``tier`` DELETED, its files or
    objects being gone (a checkpoint saved across hosts; nothing otherwise): a later archive
    then uploads them again instead of taking them for done."""
    if not ck.parted:
        return
    for part in store.catalog.parts(ck.id, tier):
        if part.state != ReplicaState.DELETED:
            store.catalog.set_part(ck.id, tier, part.part, stored_on=part.stored_on,
                                   state=ReplicaState.DELETED, bytes=0, files=0)


def _record_gone(store: StoreCore, ck: Checkpoint, tier: str, target: Tier, prefix: str,
                 actor: str | None) -> int:
    """Finish deleting a copy that has no file left: record it DELETED, say so in the log."""
    replica = ck.replica(tier)
    target.abort_multipart_uploads(prefix)
    if replica is not None and replica.state != ReplicaState.DELETED:
        store.catalog.set_replica(ck.id, tier, state=ReplicaState.DELETED, bytes=0)
    record_parts_deleted(store, ck, tier)
    logger.info("the %s copy of %s (%s) was already gone (no file under %s); recorded it as "
                "deleted", tier, ck.ref, ck.id, prefix)
    store.catalog.record_event(
        "replica_deleted",
        checkpoint_id=ck.id,
        actor=actor,
        detail={"tier": tier, "files": 0, "kept_chunks": 0, "freed_chunks": 0,
                "already_gone": True,
                "was": replica.state.value if replica is not None else None},
    )
    return 0


def _delete_hot_parts(store: StoreCore, ck: Checkpoint, *, actor: str | None,
                      force: bool) -> int:
    """Delete the hot copy of a checkpoint saved across hosts: this host's parts now, the
    other hosts' parts by their own agents (:func:`~ckptstore.ops.tiering.gc.prune_parts`).

    The copy is DELETING from the first step; it becomes DELETED when the last host has
    removed its parts. The last-verified-copy rule holds as for any copy.
    """
    replica = ck.replica("hot")
    if (not force and ck.state == CheckpointState.COMMITTED and replica is not None
            and replica.state in (ReplicaState.PRESENT, ReplicaState.DAMAGED)):
        others = [r for r in ck.replicas if r.tier != "hot" and r.state == ReplicaState.PRESENT
                  and r.verified_at is not None]
        if not others:
            raise ConflictError(
                f"refusing to delete the hot parts of {ck.ref} ({ck.id}): no other verified "
                "complete copy exists (a warm copy is complete only once every host has "
                "uploaded its part); archive it from every host first"
            )
    store.catalog.set_replica(ck.id, "hot", state=ReplicaState.DELETING)
    deleted = remove_local_parts(store, ck)
    store.catalog.record_event(
        "replica_deleted", checkpoint_id=ck.id, actor=actor,
        detail={"tier": "hot", "files": deleted, "host": host(),
                "pending_hosts": [p.stored_on for p in store.catalog.parts(ck.id, "hot")
                                  if p.state != ReplicaState.DELETED]},
    )
    return deleted


def _foreign_owners(store: StoreCore, target: Tier, ck: Checkpoint) -> set[str]:
    """Ids of the checkpoints whose chunk files ``ck``'s copy on ``target`` reads."""
    try:
        cached = known_manifest(expected_digest(ck, target.name), ck.id)
        manifest = cached if cached is not None else manifest_on(target, ck)
    except (CheckpointNotFoundError, IncompleteCheckpointError, IntegrityError, StorageError):
        # A half-deleted copy has no marker any more; what it read is then found by the
        # next deletion of a reader, or by `ckpt gc`.
        return set()
    return manifest.referenced_checkpoints()


def release_chunks(store: StoreCore, tier: str, owners: Iterable[str]) -> int:
    """Delete kept chunk files of ``owners`` on ``tier`` that no live copy reads any more.

    Only owners without a live copy (PRESENT, COPYING or DAMAGED) on the tier are touched:
    their directory holds nothing but chunk files kept for readers (see
    :func:`delete_replica`). When the last of them goes, the directory goes too.

    Args:
        store: The open store.
        tier: Tier name.
        owners: Checkpoint ids whose kept chunk files may have lost their last reader.

    Returns:
        Number of files deleted.

    Raises:
        StorageError: If the tier fails (what was deleted stays deleted; a rerun finishes).
    """
    target = tier_of(store, tier)
    dead: list[Checkpoint] = []
    for owner in sorted(set(owners)):
        try:
            ck = store.catalog.get_any(owner)
        except CheckpointNotFoundError:
            continue
        replica = ck.replica(tier)
        if replica is None or replica.state not in _LIVE:
            dead.append(ck)
    if not dead:
        return 0
    still = referenced_chunks(store, tier)
    deleted = 0
    for ck in dead:
        prefix = target.prefix_for(ck.run, ck.id)
        keep = {target.key_for(ck.run, ck.id, chunk_rel(array, index))
                for owner, array, index in still if owner == ck.id}
        present = target.list_prefix(prefix)
        if not present:
            continue
        if keep:
            deleted += target.delete_keys(k for k in present if k not in keep)
        else:
            # delete_prefix also removes the emptied folders of a local tier.
            deleted += target.delete_prefix(prefix)
        logger.info("%s tier: freed unreferenced chunk files of deleted %s (%s); %d kept",
                    tier, ck.ref, ck.id, len(keep))
    return deleted
