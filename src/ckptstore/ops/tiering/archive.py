"""Archive (hot → warm) and demote (warm → cold): copy → verify → record → maybe delete.

Both are driven by catalog state and idempotent: a checkpoint is worked on only while it has
a PRESENT replica on the source tier and none on the destination, under a catalog lease, so
two runs never copy the same checkpoint and a rerun after a crash redoes only what is
missing (files already on the destination that match are kept). A checkpoint never has zero
verified copies: the source copy is deleted (demote only) after the destination copy is
verified and recorded.

A checkpoint saved across hosts (:mod:`ckptstore.ops.dcp.parts`) is archived part by part,
each host uploading its own parts (:mod:`ckptstore.ops.tiering.parts_archive`; to an
encrypted tier, each host sealing its own part); the copy becomes PRESENT only when the last
part is in.

Archive may re-encode (``reencode`` / the ``archive_codec`` setting): the copy is then written
by :mod:`ckptstore.ops.tiering.reencode` as a self-contained copy whose chunks use the archive
codec, with a manifest of its own whose digest the replica row records
(:attr:`~ckptstore.records.Replica.manifest_digest`). Demote copies whatever the source copy
is, re-encoded or not, as is, with its digest.

One module because archive and demote are one transaction with one set of rules (lease,
copy, verify, record, then maybe delete); uploading the parts of a checkpoint saved across
hosts and re-encoding live apart.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta

from ckptstore.core import StoreCore
from ckptstore.errors import CkptError, ConfigError, MissingExtraError
from ckptstore.format.constants import chunk_rel
from ckptstore.numeric import human_bytes
from ckptstore.ops.leases import RenewingLease, lease_owner
from ckptstore.ops.tiering.parts_archive import archive_parts, by_parts
from ckptstore.ops.tiering.reencode import (
    ReencodeResult,
    check_codec,
    reencode_copy,
    why_not_reencode,
)
from ckptstore.ops.tiering.replicas import (
    delete_replica,
    dependents,
    manifest_on,
    referenced_chunks,
    run_resolver,
    tier_of,
)
from ckptstore.ops.tiering.sealed_tier import (
    copy_sealed,
    drop_unfinished,
    is_sealed_on,
    new_copy_id,
    recipients_of,
    seal_copy,
    sealed_uri,
    seals_tier,
)
from ckptstore.progress import Progress, announce_total
from ckptstore.records import Checkpoint, CheckpointState, ReplicaState, expected_digest
from ckptstore.storage import COMMIT_NAME, Tier, copy_checkpoint, is_retryable
from ckptstore.storage.transfer import copy_foreign_chunks

__all__ = ["ArchiveReport", "archive_checkpoints", "demote_checkpoints"]

logger = logging.getLogger(__name__)

#: Default lease length; the lease is renewed while a copy makes progress.
LEASE_TTL_S = 3600.0


@dataclass
class ArchiveReport:
    """What an archive or demote run did.

    Attributes:
        src: Source tier.
        tier: Destination tier.
        archived: Ids of checkpoints copied (and verified) to ``tier`` by this run.
        removed: Ids whose ``src`` copy was deleted afterwards (demote only).
        skipped: Id -> reason, for checkpoints left alone (lease held, already there, ...).
        failed: Id -> error message.
        bytes: Bytes of the copies made.
        reencode: The codec copies were re-encoded with (None: copied as they are).
        reencoded: Id -> ``{"source_bytes": ..., "bytes": ...}`` for the copies re-encoded:
            the chunk data's encoded size in the source layout (each chunk once, whichever
            checkpoint holds it) and in the new copy.
        not_reencoded: Id -> why a copy was made as is although ``reencode`` was asked
            (already in that codec; a DCP layout).
        parts: Id -> the host parts this run uploaded, for checkpoints saved across hosts
            (the id is in ``archived`` once the copy is complete).
    """

    src: str
    tier: str
    archived: list[str] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)
    failed: dict[str, str] = field(default_factory=dict)
    bytes: int = 0
    reencode: str | None = None
    reencoded: dict[str, dict[str, int]] = field(default_factory=dict)
    not_reencoded: dict[str, str] = field(default_factory=dict)
    parts: dict[str, list[str]] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        """True when nothing failed."""
        return not self.failed

    def summary(self) -> str:
        """One line for logs and error notes."""
        uploaded = sum(len(p) for p in self.parts.values())
        line = (
            f"{self.src} -> {self.tier}: {len(self.archived)} copied ({human_bytes(self.bytes)}), "
            + (f"{uploaded} host parts uploaded, " if uploaded else "") +
            f"{len(self.removed)} source copies removed, {len(self.skipped)} skipped, "
            f"{len(self.failed)} failed"
        )
        if self.reencoded:
            before = sum(r["source_bytes"] for r in self.reencoded.values())
            after = sum(r["bytes"] for r in self.reencoded.values())
            line += (f", {len(self.reencoded)} re-encoded to {self.reencode} "
                     f"(chunks {before} -> {after} bytes)")
        return line


def _present(ck: Checkpoint, tier: str) -> bool:
    replica = ck.replica(tier)
    return replica is not None and replica.state == ReplicaState.PRESENT


def _deleting(ck: Checkpoint, tier: str) -> bool:
    replica = ck.replica(tier)
    return replica is not None and replica.state == ReplicaState.DELETING


def _candidates(
    store: StoreCore, *, run: str | None, ref: str | None, src: str, dst: str
) -> list[Checkpoint]:
    """COMMITTED checkpoints on ``src`` and not on ``dst``, oldest first (bases first)."""
    if ref is not None:
        found = [store.catalog.get(ref)]
    else:
        found = store.catalog.list(run=run, state=CheckpointState.COMMITTED,
                                   order_by="created_at")

    def on_src(ck: Checkpoint) -> bool:
        if by_parts(store, ck, src):
            # Parts survive on their hosts when another host's part is lost (DAMAGED).
            replica = ck.replica(src)
            return replica is not None and replica.state in (ReplicaState.PRESENT,
                                                             ReplicaState.DAMAGED)
        return _present(ck, src)

    todo = [ck for ck in found if on_src(ck) and not _present(ck, dst)]
    return sorted(todo, key=lambda ck: (ck.created_at, ck.version))


def _discard_partial(store: StoreCore, dst: Tier, ck: Checkpoint) -> None:
    """Remove what a failed copy left on ``dst`` (marker first); best effort.

    Chunk files other checkpoints on ``dst`` read (dedup) are kept. If the tier is down this
    does nothing: the next run keeps the files that match and redoes the rest.
    """
    try:
        prefix = dst.prefix_for(ck.run, ck.id)
        dst.delete(dst.key_for(ck.run, ck.id, COMMIT_NAME))
        keep = {
            dst.key_for(ck.run, ck.id, chunk_rel(array, index))
            for owner, array, index in referenced_chunks(store, dst.name, exclude=[ck.id])
            if owner == ck.id
        }
        dst.delete_keys(k for k in dst.list_prefix(prefix) if k not in keep)
        dst.abort_multipart_uploads(prefix)
    except MissingExtraError:
        pass  # the tier's package is not installed: nothing can have been written
    except CkptError as exc:
        logger.warning("could not remove the partial %s copy of %s (%s); a rerun reuses or "
                       "replaces it", dst.name, ck.ref, exc)


def _copy_one(
    store: StoreCore,
    ck: Checkpoint,
    src: Tier,
    dst: Tier,
    *,
    lease: RenewingLease,
    threads: int,
    progress: Progress | None,
    deep: bool,
    reencode: str | None,
    report: ArchiveReport,
) -> int:
    """Copy one checkpoint ``src`` → ``dst`` under a held lease and record the replica.

    With ``reencode`` the copy is re-encoded (unless :func:`why_not_reencode` says it is
    pointless); otherwise it is byte for byte the source copy, and records the source
    copy's manifest digest (which is the checkpoint's own unless that copy was re-encoded).
    """
    if seals_tier(store, dst.name) or is_sealed_on(ck, src.name):
        return _copy_sealed(store, ck, src, dst, lease=lease, threads=threads,
                            progress=progress, deep=deep, reencode=reencode)
    uri = dst.uri_for(ck.run, ck.id)
    manifest = manifest_on(src, ck)
    run_of = run_resolver(store, ck)
    if reencode is not None:
        why = why_not_reencode(manifest, reencode)
        if why is not None:
            report.not_reencoded[ck.id] = why
            reencode = None
    src_digest = expected_digest(ck, src.name)
    same_digest = None if src_digest == ck.manifest_digest else src_digest

    def tick(nbytes: int) -> None:
        lease.touch()
        if progress is not None:
            progress(nbytes)

    # A re-encode in progress has no digest of its own yet: until it is recorded the copy
    # counts with the checkpoint's own chunk references, which only keeps more files.
    store.catalog.set_replica(ck.id, dst.name, uri=uri, state=ReplicaState.COPYING,
                              manifest_digest=None if reencode else same_digest)
    result: ReencodeResult | None = None
    digest: str | None
    try:
        if reencode is not None:
            result = reencode_copy(src, dst, ck.run, manifest, reencode, run_of=run_of,
                                   own_digest=ck.manifest_digest, threads=threads,
                                   progress=tick, deep=deep)
            nbytes, digest = result.bytes, result.manifest.digest
        else:
            # Chunks a delta reads from its base go first, into the base's prefix; usually
            # the base was archived just before (oldest first) and nothing is copied here.
            copy_foreign_chunks(src, dst, manifest, run_of, threads=threads, progress=tick,
                                deep=deep)
            nbytes = copy_checkpoint(src, dst, ck.run, ck.id, manifest, threads=threads,
                                     progress=tick, deep=deep, run_of=run_of)
            digest = same_digest
    except BaseException:
        _discard_partial(store, dst, ck)
        store.catalog.set_replica(ck.id, dst.name, state=ReplicaState.DELETED, bytes=0)
        raise
    # Recorded only now, after every file was read back: a copy's digest is never claimed
    # for files that are not all there.
    store.catalog.set_replica(ck.id, dst.name, uri=uri, state=ReplicaState.PRESENT,
                              bytes=nbytes, verified=True, manifest_digest=digest)
    if result is not None:
        report.reencoded[ck.id] = {"source_bytes": result.source_bytes,
                                   "bytes": result.chunk_bytes}
    return nbytes


def _copy_sealed(
    store: StoreCore,
    ck: Checkpoint,
    src: Tier,
    dst: Tier,
    *,
    lease: RenewingLease,
    threads: int,
    progress: Progress | None,
    deep: bool,
    reencode: str | None,
) -> int:
    """Write the ``dst`` copy of ``ck`` as a sealed copy (``encrypt_to``) and record it.

    A sealed source copy (a demote) is copied as it is, ciphertext to ciphertext, under the
    same copy id (a copy sealed part by part too: its parts' sub-copies come along); a plain
    one is sealed (:func:`~ckptstore.ops.tiering.sealed_tier.seal_copy`) for the configured
    recipients. The replica row names the sealed prefix and records the
    plaintext manifest's digest; the ``archived`` / ``demoted`` event says ``encrypted``.
    """
    drop_unfinished(store, ck, dst)
    source = ck.replica(src.name)
    copy_id = source.sealed if source is not None and source.sealed else new_copy_id()
    uri = sealed_uri(dst, copy_id)

    def tick(nbytes: int) -> None:
        lease.touch()
        if progress is not None:
            progress(nbytes)

    # Recorded before the first object, so a crash leaves a row that names the prefix
    # (doctor and gc find what it wrote there).
    store.catalog.set_replica(ck.id, dst.name, uri=uri, state=ReplicaState.COPYING,
                              manifest_digest=expected_digest(ck, src.name))
    try:
        if source is not None and source.sealed:
            nbytes = copy_sealed(src, dst, copy_id, deep=deep, progress=tick)
            digest = expected_digest(ck, src.name)
        else:
            sealed = seal_copy(store, ck, src, dst, copy_id=copy_id, reencode=reencode,
                               threads=threads, deep=deep, progress=tick)
            nbytes, digest = sealed.bytes, sealed.digest
    except BaseException:
        store.catalog.set_replica(ck.id, dst.name, state=ReplicaState.DELETED, bytes=0)
        raise
    # The digest is recorded even when it is the checkpoint's own: a sealed copy is
    # self-contained, and a recorded digest is what tells replicas.py it reads no chunks.
    store.catalog.set_replica(ck.id, dst.name, uri=uri, state=ReplicaState.PRESENT,
                              bytes=nbytes, verified=True, manifest_digest=digest)
    return nbytes


def _run(
    store: StoreCore,
    todo: list[Checkpoint],
    *,
    src: Tier,
    dst: Tier,
    report: ArchiveReport,
    owner: str,
    threads: int,
    progress: Progress | None,
    deep: bool,
    lease_ttl_s: float,
    remove_source: bool,
    raise_errors: bool,
    reencode: str | None = None,
) -> ArchiveReport:
    errors: list[BaseException] = []
    visited: set[str] = set()
    verb = "demoted" if remove_source else "archived"
    # The total a progress bar shows: what was written so far plus the stored bytes of the
    # checkpoints still to go, announced up front and again after each checkpoint (a
    # re-encoded copy writes fewer bytes than it reads; a dedup'd one may copy a base's).
    written = 0

    def counted(nbytes: int) -> None:
        nonlocal written
        written += nbytes
        if progress is not None:
            progress(nbytes)

    def announce(position: int) -> None:
        remaining = sum(ck.stored_bytes or 0 for ck in todo[position:] if ck.id not in visited)
        announce_total(progress, written + remaining)

    announce(0)

    def process(ckpt_id: str, depth: int) -> None:
        if ckpt_id in visited:
            return
        visited.add(ckpt_id)
        listed = store.catalog.get_any(ckpt_id)
        if not remove_source and by_parts(store, listed, src.name):
            # With encrypt_to, each host seals its own part (parts_archive, sealed_tier).
            if reencode is not None:
                report.not_reencoded[ckpt_id] = (
                    "saved across hosts: each host's part is copied as it is")
            try:
                report.bytes += archive_parts(
                    store, listed, src, dst, owner=owner, threads=threads, progress=counted,
                    deep=deep, report=report, lease_ttl_s=lease_ttl_s,
                )
            except CkptError as exc:
                report.failed.setdefault(ckpt_id, str(exc))
                raise
            return
        lease = RenewingLease(store, ckpt_id, f"archive:{dst.name}", owner, lease_ttl_s)
        if not lease.acquire():
            holder = store.catalog.lease_holder(ckpt_id, f"archive:{dst.name}")
            report.skipped[ckpt_id] = f"lease held by {holder}"
            return
        try:
            # Re-read under the lease: another run may have finished it since we listed.
            ck = store.catalog.get_any(ckpt_id)
            if ck.state != CheckpointState.COMMITTED:
                report.skipped[ck.id] = f"state is {ck.state}"
                return
            if not _present(ck, dst.name):
                if not _present(ck, src.name):
                    report.skipped[ck.id] = f"no PRESENT copy on {src.name} any more"
                    return
                # A delta's bases go first, whole: the reader needs each base directory to
                # be a committed checkpoint on the tier it reads from.
                # A sealed copy is self-contained: its bases need not be there first.
                sealing = seals_tier(store, dst.name) or is_sealed_on(ck, src.name)
                bases = () if sealing else manifest_on(src, ck).referenced_checkpoints()
                for base_id in sorted(bases):
                    base = store.catalog.get_any(base_id)
                    if (depth < 64 and base.state == CheckpointState.COMMITTED
                            and _present(base, src.name) and not _present(base, dst.name)):
                        process(base_id, depth + 1)
                nbytes = _copy_one(store, ck, src, dst, lease=lease, threads=threads,
                                   progress=counted, deep=deep, reencode=reencode,
                                   report=report)
                report.archived.append(ck.id)
                report.bytes += nbytes
                done = store.catalog.get_any(ck.id).replica(dst.name)
                detail: dict[str, object] = {"from": src.name, "tier": dst.name,
                                             "bytes": nbytes, "uri": done.uri if done
                                             else dst.uri_for(ck.run, ck.id)}
                if done is not None and done.sealed:
                    detail["encrypted"] = True
                    detail["copy"] = done.sealed
                    detail["recipients"] = recipients_of(dst, done.sealed)
                if ck.id in report.reencoded:
                    detail["reencoded"] = {"codec": reencode, **report.reencoded[ck.id]}
                store.catalog.record_event(verb, checkpoint_id=ck.id, actor=owner,
                                           detail=detail)
                logger.info("%s %s (%s) to %s: %s bytes", verb, ck.ref, ck.id, dst.name,
                            nbytes)
            elif not remove_source:
                report.skipped[ck.id] = f"already on {dst.name}"
            if remove_source:
                _remove_source(store, ck, src, report, owner)
        except CkptError as exc:
            report.failed.setdefault(ckpt_id, str(exc))
            raise
        finally:
            lease.release()

    for position, listed in enumerate(todo):
        if position:
            announce(position)
        try:
            process(listed.id, 0)
        except MissingExtraError:
            raise  # the same for every checkpoint: say it once, which extra to install
        except CkptError as exc:
            errors.append(exc)
            logger.warning("%s -> %s failed for %s (%s): %s", src.name, dst.name, listed.ref,
                           listed.id, exc)
            if is_retryable(exc):
                # The tier is down or throttling: every further checkpoint would fail the
                # same way, slowly. Stop; the next run resumes.
                break
    announce(len(todo))  # what was really written: the bar ends full
    if remove_source and not errors:
        # Source copies kept because a younger delta still read them: the deltas may have
        # moved since, so try again, newest first (a chain releases from its tip).
        for ckpt_id in [i for i in reversed(list(report.skipped)) if i in visited]:
            if not report.skipped[ckpt_id].startswith(f"{src.name} copy kept"):
                continue
            lease = RenewingLease(store, ckpt_id, f"archive:{dst.name}", owner, lease_ttl_s)
            if not lease.acquire():
                continue
            try:
                del report.skipped[ckpt_id]
                _remove_source(store, store.catalog.get_any(ckpt_id), src, report, owner)
            except CkptError as exc:
                report.failed[ckpt_id] = str(exc)
                errors.append(exc)
            finally:
                lease.release()
    logger.info("%s", report.summary())
    if errors and raise_errors:
        first = errors[0]
        first.add_note(f"archive report: {report.summary()}; rerun to resume")
        raise first
    return report


def _remove_source(store: StoreCore, ck: Checkpoint, src: Tier, report: ArchiveReport,
                   owner: str) -> None:
    """Delete the source copy once the destination copy is verified and recorded."""
    current = store.catalog.get_any(ck.id)
    if not (_present(current, src.name) or _deleting(current, src.name)):
        return
    readers = dependents(store, ck, src.name)
    if readers:
        # Younger deltas on src still read this copy's chunks; it goes when they have moved.
        report.skipped[ck.id] = (
            f"{src.name} copy kept: read by {', '.join(d.ref for d in readers[:3])}"
        )
        return
    delete_replica(store, ck, src.name, actor=owner)
    report.removed.append(ck.id)


def archive_checkpoints(
    store: StoreCore,
    *,
    run: str | None = None,
    ref: str | None = None,
    tier: str = "warm",
    src: str = "hot",
    reencode: str | None = None,
    owner: str | None = None,
    progress: Progress | None = None,
    threads: int = 4,
    deep: bool = False,
    lease_ttl_s: float = LEASE_TTL_S,
    raise_errors: bool = True,
) -> ArchiveReport:
    """Copy COMMITTED checkpoints from ``src`` (hot) to ``tier``, verify, record.

    Every checkpoint with a PRESENT replica on ``src`` and none on ``tier`` is copied,
    oldest first (so a delta's base goes before the delta): lease ``archive:<tier>`` →
    replica COPYING → copy data, manifest, marker (each read back and compared) → replica
    PRESENT (verified) → event ``archived`` → lease released. On failure the partial copy is
    removed, the replica set DELETED and the source copy is untouched.

    Args:
        store: The open store.
        run: Only this run.
        ref: Only this checkpoint.
        tier: Destination tier.
        src: Source tier.
        reencode: Codec preset to re-encode with (e.g. ``zstd-3``): each copy is written
            self-contained with that codec, verified, and recorded with its own manifest
            digest (see :mod:`ckptstore.ops.tiering.reencode`). None copies as is.
        owner: Lease owner (default: unique per call).
        progress: Called with the byte count of each file written; one with ``set_total``
            (:mod:`ckptstore.progress`) is told the bytes to copy (re-estimated after each
            checkpoint).
        threads: Parallel transfers per checkpoint.
        deep: Compare blake3 instead of crc32c when reading back.
        lease_ttl_s: Lease length; renewed while copying.
        raise_errors: Raise the first error after the run (True) or only report it.

    Returns:
        The :class:`ArchiveReport`.

    Raises:
        ConfigError: If a tier is not configured, ``tier`` equals ``src`` or ``reencode``
            is not a codec preset (raised before anything is copied).
        StorageError: If a tier fails (retryable ones stop the run early); others as they
            come from the copy (IntegrityError, MissingBaseError), with the report attached
            as a note.
    """
    if tier == src:
        raise ConfigError(f"cannot archive from {src!r} to itself; choose another tier")
    if reencode is not None:
        check_codec(reencode)
    dst_tier, src_tier = tier_of(store, tier), tier_of(store, src)
    report = ArchiveReport(src=src, tier=tier, reencode=reencode)
    todo = _candidates(store, run=run, ref=ref, src=src, dst=tier)
    return _run(store, todo, src=src_tier, dst=dst_tier, report=report,
                owner=lease_owner(owner), threads=threads, progress=progress, deep=deep,
                lease_ttl_s=lease_ttl_s, remove_source=False, raise_errors=raise_errors,
                reencode=reencode)


def demote_checkpoints(
    store: StoreCore,
    *,
    older_than_days: float,
    src: str = "warm",
    dst: str = "cold",
    run: str | None = None,
    owner: str | None = None,
    progress: Progress | None = None,
    threads: int = 4,
    deep: bool = False,
    lease_ttl_s: float = LEASE_TTL_S,
    raise_errors: bool = True,
    now: datetime | None = None,
) -> ArchiveReport:
    """Move copies older than ``older_than_days`` from ``src`` to ``dst``.

    Per checkpoint: copy → verify → record the ``dst`` replica PRESENT → event ``demoted`` →
    delete the ``src`` copy with :func:`~ckptstore.ops.tiering.replicas.delete_replica` (which keeps
    chunk files younger deltas on ``src`` still read). A rerun after a crash between copy and
    delete only deletes.

    Args:
        store: The open store.
        older_than_days: Minimum age (since commit) of the checkpoints to move.
        src: Tier to move from.
        dst: Tier to move to.
        run: Only this run.
        owner: Lease owner (default: unique per call).
        progress: Called with the byte count of each file written.
        threads: Parallel transfers per checkpoint.
        deep: Compare blake3 instead of crc32c when reading back.
        lease_ttl_s: Lease length; renewed while copying.
        raise_errors: Raise the first error after the run (True) or only report it.
        now: The current time (tests).

    Returns:
        The :class:`ArchiveReport` (``removed`` lists the source copies deleted).

    Raises:
        ConfigError: If a tier is not configured, ``src == dst`` or the age is negative.
        StorageError: As :func:`archive_checkpoints`.
    """
    if src == dst:
        raise ConfigError(f"cannot demote from {src!r} to itself; choose another tier")
    if older_than_days < 0:
        raise ConfigError(f"older_than_days must be >= 0, got {older_than_days}")
    src_tier, dst_tier = tier_of(store, src), tier_of(store, dst)
    cutoff = (now or datetime.now(UTC)) - timedelta(days=older_than_days)
    found = store.catalog.list(run=run, state=CheckpointState.COMMITTED, order_by="created_at")

    def age_ref(ck: Checkpoint) -> datetime:
        when = ck.committed_at or ck.created_at
        return when if when.tzinfo is not None else when.replace(tzinfo=UTC)

    # Already on dst but still on src counts too: a crash between copy and delete, and so
    # does a source copy a crash left DELETING after the destination copy was recorded.
    todo = sorted(
        (ck for ck in found
         if (_present(ck, src) or (_deleting(ck, src) and _present(ck, dst)))
         and age_ref(ck) <= cutoff),
        key=lambda ck: (ck.created_at, ck.version),
    )
    report = ArchiveReport(src=src, tier=dst)
    return _run(store, todo, src=src_tier, dst=dst_tier, report=report,
                owner=lease_owner(owner), threads=threads, progress=progress, deep=deep,
                lease_ttl_s=lease_ttl_s, remove_source=True, raise_errors=raise_errors)
