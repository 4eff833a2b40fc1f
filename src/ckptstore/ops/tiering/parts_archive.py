"""Archiving a checkpoint saved across hosts, part by part.

A checkpoint saved across node-local disks (:mod:`ckptstore.ops.tiering.parts`) has no host
that holds all of it, so no host can copy it whole. Each host uploads the parts its own disk
holds (:func:`archive_parts`, run by archive on that host: ``ckpt archive``, its agent's flow,
or the embedded worker of its training processes), each part under a lease of its own,
checked against the manifest on the way (size, crc32c) and read back on the destination,
and recorded as one ``replica_parts`` row. The copy becomes PRESENT (verified) only when the
last part is in and the copy's shared documents, manifest and marker are written, by
whichever host comes last: until then it is never used as a complete copy, and retention
keeps the hot parts.

To an encrypted tier (``[tiers] encrypt_to``) the same steps write a copy sealed part by
part (:mod:`ckptstore.ops.tiering.sealed_tier`): the hosts agree on one copy id through the
catalog, each host seals its part as a sub-copy of it, and the last one seals the shared
documents, manifest and marker, envelope last. Every host must archive with the same
``encrypt_to``: a plain part is never added to a sealed copy, nor the reverse.

The rules around it (which checkpoints, the order, the report, leases renewed while copying)
are archive's (:mod:`ckptstore.ops.tiering.archive`), which calls in here with its lease
owner and length and the report it fills (:class:`PartsReport`); each lease is a
:class:`~ckptstore.ops.leases.RenewingLease`.
"""

from __future__ import annotations

import logging
from typing import Any, Protocol

import blake3
import crc32c as _crc32c

from ckptstore.core import StoreCore
from ckptstore.errors import ConfigError
from ckptstore.format import Manifest
from ckptstore.format.codecs import TRAILER
from ckptstore.format.constants import MANIFEST_NAME
from ckptstore.format.dcp.zarrdocs import shared_docs
from ckptstore.identity import host
from ckptstore.ops.leases import RenewingLease
from ckptstore.ops.tiering.parts import materialize, part_files, parted_manifest
from ckptstore.ops.tiering.sealed_tier import (
    new_copy_id,
    parts_missing,
    recipients_of,
    seal_part,
    seal_shared,
    sealed_uri,
    seals_tier,
)
from ckptstore.progress import Progress
from ckptstore.records import Checkpoint, ReplicaState
from ckptstore.storage import COMMIT_NAME, Tier
from ckptstore.storage.transfer import copy_keys, put_verified

__all__ = ["PartsReport", "archive_parts", "by_parts"]

logger = logging.getLogger(__name__)


class PartsReport(Protocol):
    """What archiving the parts adds to a run's report (an archive run's report has it).

    Attributes:
        archived: Ids of checkpoints whose copy this run completed.
        skipped: Id -> why the checkpoint was left alone (or is not complete yet).
        parts: Id -> the host parts this run uploaded.
    """

    archived: list[str]
    skipped: dict[str, str]
    parts: dict[str, list[str]]


def by_parts(store: StoreCore, ck: Checkpoint, src: str) -> bool:
    """Whether ``ck`` is archived from ``src`` part by part (saved across node-local disks)."""
    return ck.parted and src == "hot" and store.settings.hot_remote is None


def _part_purpose(tier: str, part: str) -> str:
    """Lease purpose for uploading one host's part (leases hold at most 64 characters)."""
    purpose = f"archive:{tier}:{part}"
    if len(purpose) <= 64:
        return purpose
    return f"archive:{tier}:#" + blake3.blake3(part.encode()).hexdigest()[:32]


def _dcp_checker(manifest: Manifest, key_of: dict[str, str]) -> Any:
    """Checks source files of a DCP-layout part against the manifest (size, crc32c)."""
    assert manifest.dcp is not None
    expect: dict[str, tuple[int, int | None]] = {
        key_of[f.path]: (f.nbytes, None) for f in manifest.files if f.path in key_of
    }
    for rel, size, crc in manifest.dcp.files():
        if rel in key_of:
            expect[key_of[rel]] = (size, crc)

    def check(key: str, data: bytes) -> str | None:
        if key not in expect:
            return None
        size, crc = expect[key]
        if len(data) != size:
            return f"{len(data)} bytes, the manifest records {size}"
        if crc is not None:
            got = int(_crc32c.crc32c(data[: -TRAILER.size]))
            trailer = TRAILER.unpack(data[-TRAILER.size:])[0] if len(data) >= TRAILER.size else -1
            if got != crc or trailer != crc:
                return f"crc32c {got:#010x} differs from the manifest's {crc:#010x}"
        return None

    return check


def archive_parts(
    store: StoreCore,
    ck: Checkpoint,
    src: Tier,
    dst: Tier,
    *,
    owner: str,
    lease_ttl_s: float,
    threads: int,
    progress: Progress | None,
    deep: bool,
    report: PartsReport,
) -> int:
    """Upload the parts of ``ck`` this host holds to ``dst``; complete the copy when the last
    part is in (whichever host uploads it).

    Args:
        store: The open store.
        ck: A checkpoint saved across hosts, with parts on ``src`` (the hot tier).
        src: The source tier.
        dst: The shared destination tier.
        owner: Lease owner, recorded as the events' actor.
        lease_ttl_s: Length of the leases (one per part, and ``archive:<tier>`` for
            completing the copy), renewed while the copy makes progress.
        threads: Parallel transfers.
        progress: Called with the bytes of each file uploaded.
        deep: Compare blake3 instead of crc32c when reading back.
        report: Where the parts uploaded, the copy completed and what was skipped go.

    Returns:
        The bytes uploaded.

    Raises:
        CkptError: As the copy raises it; the part being uploaded is recorded DELETED and
            the files already read back stay for a rerun.
    """
    me = host()
    rows = store.catalog.parts(ck.id)
    here = sorted({p.part for p in rows if p.tier == src.name and p.stored_on == me
                   and p.state == ReplicaState.PRESENT})
    done = {p.part for p in rows if p.tier == dst.name and p.stored_on is None
            and p.state == ReplicaState.PRESENT}
    todo = [part for part in here if part not in done]
    total = 0
    sealing = seals_tier(store, dst.name)
    if todo:
        directory = materialize(store, ck)
        manifest, _ = parted_manifest(store, ck)
        ranks = store.catalog.part_ranks(ck.id)
        uri = dst.uri_for(ck.run, ck.id)
        existing = set() if sealing else set(dst.list_prefix(dst.prefix_for(ck.run, ck.id)))
        for part in todo:
            lease = RenewingLease(store, ck.id, _part_purpose(dst.name, part), owner, lease_ttl_s)
            if not lease.acquire():
                holder = store.catalog.lease_holder(ck.id, _part_purpose(dst.name, part))
                report.skipped[ck.id] = f"part of {part}: lease held by {holder}"
                continue
            if _part_present(store, ck.id, dst.name, part):
                # Another archiver of this host uploaded it while we were getting here
                # (the lease was free again): marking it COPYING now would make a complete
                # copy look incomplete to the host that completes it.
                lease.release()
                continue
            try:
                files = part_files(manifest, ranks.get(part, []))
                pairs = [(src.key_for(ck.run, ck.id, rel), dst.key_for(ck.run, ck.id, rel))
                         for rel, _ in files]
                copy_id = None
                if sealing:
                    copy_id = _begin_sealed(store, ck, dst, part)
                else:
                    _check_plain(store, ck, dst)
                    began = store.catalog.set_part(ck.id, dst.name, part, stored_on=None,
                                                   state=ReplicaState.COPYING, uri=uri)
                    if began is not None and began.sealed:
                        # A sealed copy began between our look and our row.
                        store.catalog.set_part(ck.id, dst.name, part, stored_on=None,
                                               state=ReplicaState.DELETED, bytes=0, files=0)
                        raise _mixed(ck, dst, sealed=False)

                def tick(nbytes: int, lease: RenewingLease = lease) -> None:
                    lease.touch()
                    if progress is not None:
                        progress(nbytes)

                try:
                    if copy_id is not None:
                        assert directory is not None  # this host holds a part (``here``)
                        nbytes, _ = seal_part(store, ck, dst, copy_id=copy_id, part=part,
                                              directory=directory, manifest=manifest,
                                              ranks=ranks.get(part, []), threads=threads,
                                              deep=deep, progress=tick)
                    else:
                        nbytes = copy_keys(
                            src, dst, pairs, threads=threads, progress=tick, deep=deep,
                            existing=existing,
                            check_source=_dcp_checker(manifest, {
                                rel: k for (rel, _), (k, _) in zip(files, pairs, strict=True)}),
                        )
                except BaseException:
                    # Files already uploaded and read back stay: a rerun keeps those.
                    store.catalog.set_part(ck.id, dst.name, part, stored_on=None,
                                           state=ReplicaState.DELETED, bytes=0, files=0)
                    raise
                store.catalog.set_part(ck.id, dst.name, part, stored_on=None,
                                       state=ReplicaState.PRESENT, bytes=nbytes,
                                       files=len(files), verified=True)
                detail: dict[str, object] = {"part": part, "host": me, "tier": dst.name,
                                             "bytes": nbytes, "files": len(files)}
                if copy_id is not None:
                    detail.update(encrypted=True, copy=copy_id)
                store.catalog.record_event("part_archived", checkpoint_id=ck.id, actor=owner,
                                           detail=detail)
                report.parts.setdefault(ck.id, []).append(part)
                total += nbytes
                logger.info("uploaded the part of %s of %s (%s) to %s: %d files, %d bytes",
                            part, ck.ref, ck.id, dst.name, len(files), nbytes)
            finally:
                lease.release()
    elif not here:
        report.skipped.setdefault(ck.id, f"no part of it on this host ({me})")
    total += _complete_parts(store, ck, dst, owner=owner, lease_ttl_s=lease_ttl_s, deep=deep,
                             report=report)
    return total


def _begin_sealed(store: StoreCore, ck: Checkpoint, dst: Tier, part: str) -> str:
    """Record ``part`` COPYING to ``dst`` as a sealed copy; return the copy's id.

    The hosts agree on one copy id through the tier's aggregate replica row: a host that
    finds no copy under way proposes a fresh one, and the row keeps the id of whichever
    host recorded its part first (:meth:`~ckptstore.catalog.Catalog.set_part` records the
    URI of a new copy only), which every host then uses.

    Raises:
        ConfigError: If a plain copy of the checkpoint is under way on ``dst`` (another host
            archived its part without ``encrypt_to``).
    """
    current = store.catalog.get_any(ck.id).replica(dst.name)
    proposed = new_copy_id()
    if current is not None and current.state != ReplicaState.DELETED:
        if current.sealed is None:
            raise _mixed(ck, dst, sealed=True)
        proposed = current.sealed
    agreed = store.catalog.set_part(ck.id, dst.name, part, stored_on=None,
                                    state=ReplicaState.COPYING,
                                    uri=sealed_uri(dst, proposed))
    copy_id = agreed.sealed if agreed is not None else None
    if copy_id is None:
        # A plain copy began between our look and our row: undo ours, say why.
        store.catalog.set_part(ck.id, dst.name, part, stored_on=None,
                               state=ReplicaState.DELETED, bytes=0, files=0)
        raise _mixed(ck, dst, sealed=True)
    return copy_id


def _check_plain(store: StoreCore, ck: Checkpoint, dst: Tier) -> None:
    """Refuse a plain part into a sealed copy under way (another host has ``encrypt_to``)."""
    current = store.catalog.get_any(ck.id).replica(dst.name)
    if current is not None and current.state != ReplicaState.DELETED and current.sealed:
        raise _mixed(ck, dst, sealed=False)


def _mixed(ck: Checkpoint, dst: Tier, *, sealed: bool) -> ConfigError:
    this, other = ("encrypted", "plain") if sealed else ("plain", "encrypted")
    return ConfigError(
        f"cannot add an {this} part of {ck.ref} ({ck.id}) to the {other} {dst.name} copy "
        f"other hosts are assembling: every host of a checkpoint saved across hosts must "
        "archive with the same [tiers] encrypt_to (use one config file on every node)")


def _part_present(store: StoreCore, ckpt_id: str, tier: str, part: str) -> bool:
    """Whether ``part`` already has a PRESENT copy on ``tier`` (a shared tier: stored on no
    host)."""
    return any(p.part == part and p.stored_on is None and p.state == ReplicaState.PRESENT
               for p in store.catalog.parts(ckpt_id, tier))


def _complete_parts(store: StoreCore, ck: Checkpoint, dst: Tier, *,
                    owner: str, lease_ttl_s: float, deep: bool,
                    report: PartsReport) -> int:
    """Write the copy's shared files, manifest and marker once every part is on ``dst``,
    then record it PRESENT (verified). Any host may do it; the first one does."""
    current = store.catalog.get_any(ck.id)
    copy = current.replica(dst.name)
    if copy is not None and copy.state == ReplicaState.PRESENT:
        return 0
    rows = store.catalog.parts(ck.id, dst.name)
    have = {p.part for p in rows if p.stored_on is None and p.state == ReplicaState.PRESENT}
    missing = [h for h in current.hosts if h not in have]
    if missing:
        report.skipped.setdefault(
            ck.id, f"{dst.name} copy incomplete: waiting for the parts of {', '.join(missing)}")
        return 0
    lease = RenewingLease(store, ck.id, f"archive:{dst.name}", owner, lease_ttl_s)
    if not lease.acquire():
        report.skipped.setdefault(ck.id, "another host is completing the copy")
        return 0
    try:
        manifest, data = parted_manifest(store, current)
        if copy is not None and copy.sealed:
            return _complete_sealed(store, current, dst, copy.sealed, manifest, data,
                                    sorted(have), owner=owner, deep=deep, report=report)
        total = 0
        for rel, doc in shared_docs(manifest).items():
            total += put_verified(dst, dst.key_for(ck.run, ck.id, rel), doc, deep=deep)
        total += put_verified(dst, dst.key_for(ck.run, ck.id, MANIFEST_NAME), data, deep=deep)
        # Every part and the manifest are on dst and read back: only now the marker.
        marker = (manifest.digest + "\n").encode("ascii")
        total += put_verified(dst, dst.key_for(ck.run, ck.id, COMMIT_NAME), marker, deep=deep)
        store.catalog.complete_parts(ck.id, dst.name, uri=dst.uri_for(ck.run, ck.id))
        size = sum(p.bytes for p in rows if p.stored_on is None) + total
        store.catalog.record_event(
            "archived", checkpoint_id=ck.id, actor=owner,
            detail={"from": "hot", "tier": dst.name, "bytes": size,
                    "uri": dst.uri_for(ck.run, ck.id), "parts": sorted(have)},
        )
        report.archived.append(ck.id)
        logger.info("archived %s (%s) to %s: all %d parts in", ck.ref, ck.id, dst.name,
                    len(have))
        return total
    finally:
        lease.release()


def _complete_sealed(store: StoreCore, ck: Checkpoint, dst: Tier, copy_id: str,
                     manifest: Manifest, data: bytes, have: list[str], *, owner: str,
                     deep: bool, report: PartsReport) -> int:
    """Complete a copy sealed part by part: seal the shared documents, manifest and marker
    as its top-level object (:func:`~ckptstore.ops.tiering.sealed_tier.seal_shared`, its
    envelope last), then record the copy PRESENT (verified) with every object's bytes.

    A part recorded as sealed whose objects are gone from the tier is recorded DELETED
    instead, so that its host seals it again on its next archive."""
    lost = parts_missing(ck, dst, copy_id)
    if lost:
        for part in lost:
            store.catalog.set_part(ck.id, dst.name, part, stored_on=None,
                                   state=ReplicaState.DELETED, bytes=0, files=0)
        logger.warning("the sealed parts of %s of %s (%s) are gone from %s; their hosts seal "
                       "them again on their next archive", ", ".join(lost), ck.ref, ck.id,
                       dst.name)
        report.skipped.setdefault(
            ck.id, f"{dst.name} copy incomplete: the parts of {', '.join(lost)} are gone "
            "from the tier; archive again on those hosts")
        return 0
    total = seal_shared(store, ck, dst, copy_id=copy_id, manifest=manifest, data=data,
                        deep=deep)
    uri = sealed_uri(dst, copy_id)
    store.catalog.complete_parts(ck.id, dst.name, uri=uri)
    rows = store.catalog.parts(ck.id, dst.name)
    size = sum(p.bytes for p in rows if p.stored_on is None
               and p.state == ReplicaState.PRESENT) + total
    # The copy's bytes are its parts' and the top-level object's (what `ckpt verify`
    # compares the tier's objects with, without a key).
    store.catalog.set_replica(ck.id, dst.name, uri=uri, state=ReplicaState.PRESENT,
                              bytes=size, verified=True)
    store.catalog.record_event(
        "archived", checkpoint_id=ck.id, actor=owner,
        detail={"from": "hot", "tier": dst.name, "bytes": size, "uri": uri, "parts": have,
                "encrypted": True, "copy": copy_id, "recipients": recipients_of(dst, copy_id)},
    )
    report.archived.append(ck.id)
    logger.info("archived %s (%s) to %s, encrypted: all %d parts in", ck.ref, ck.id, dst.name,
                len(have))
    return total
