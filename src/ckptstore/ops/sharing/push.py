"""Push and pull: copy checkpoints, with their metadata, from one store into another.

Both directions are one operation, :func:`push_checkpoints` (a pull is a push from the
remote into this store). The other store is untrusted: its catalog and its files are
checked, never believed. Per checkpoint, as :mod:`ckptstore.ops.tiering.archive` does
between tiers, and more:

0. **Stores apart.** No tier of one store may be the same as, inside or above a tier of the
   other (:mod:`ckptstore.ops.sharing.overlap`), checked on every push, pull and sync: a
   remote's config can change after it was added.
1. **Nothing twice.** A checkpoint keeps its id in the other store (signatures sign ids and
   lineage names them). One COMMITTED there with the same manifest digest is skipped; one
   with another digest is a :class:`~ckptstore.errors.ConflictError`. One the destination
   pruned (DELETED) is history, not a conflict: sending it again makes it present again
   under the same id, if its content is the same (``revived`` event). A sync
   (:mod:`ckptstore.ops.sharing.sync`) leaves what the destination pruned pruned.
2. **Bases first.** A delta (xor, lossy) or dedup'd checkpoint reads chunks that its bases
   own; those bases are pushed first, whole, so each arrives as a checkpoint the destination
   can load. With ``self_contained`` the checkpoint is instead re-encoded into a copy holding
   every chunk it reads (:func:`ckptstore.ops.tiering.reencode.reencode_copy`); so is one
   whose base the source pruned and the destination lacks (its chunks are still readable
   at the source, but no base checkpoint can arrive first).
3. **Identity before bytes.** The source copy's manifest must hash to the digest the source
   catalog records, name the checkpoint's id and, for a re-encoded copy, carry the original
   manifest with that digest describing the same chunks. With ``require_signature`` (a
   trusted public key of the destination) the checkpoint's signature (its ``SIGNATURE``
   file or ``signed`` event) must verify against its id and that digest before anything is
   written.
4. **A PENDING row, under a lease.** The destination gets a PENDING row with the same id (not
   listed, loaded or used as a base) and a ``push`` lease on it: a second push of the same
   checkpoint finds the row and the lease and is refused (:class:`LeaseHeldError`) instead of
   copying alongside. A lease whose holder died is taken over (:mod:`ckptstore.ops.leases`).
5. **Copy, verify, commit.** Only files the destination lacks are written
   (:func:`ckptstore.storage.transfer.copy_keys` keeps every file already there that matches,
   so the chunks a fine-tune shares with its pushed base never travel again). Every chunk
   read from the source must decode to content whose blake3 is the manifest's (size and
   crc32c only guard transport: they can be forged), and what lands is read back and
   compared by blake3; the copy's manifest and marker are checked on the destination; then
   the row is committed. What it records comes from the verified manifest (step, sizes,
   codec, kind, lossy bounds), never from the other catalog, except what only a catalog
   knows (metrics, tags, run versions: checked like any catalog input). Signatures arrive
   as ``signed`` events and lineage edges whose other end the destination holds are added.
   A parent or edge to a checkpoint the destination lacks is kept as a reference to the
   source store in the ``received`` event.

A failure removes exactly what this run wrote for the checkpoint (files and the directories
they needed, :class:`~ckptstore.storage.writelog.WriteLog`: never a file it did not create)
and its row (a revived row returns to DELETED; a run the arrival created goes too): the
destination is as before. A crash (kill point ``push.*`` in :mod:`ckptstore.faultpoints`)
leaves a PENDING row and some files; rerunning the push takes the dead pusher's lease over,
keeps the files that match, and completes.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import blake3

from ckptstore.core import StoreCore
from ckptstore.errors import (
    CheckpointNotFoundError,
    CkptError,
    ConflictError,
    IncompleteCheckpointError,
    IntegrityError,
    LeaseHeldError,
    MissingExtraError,
)
from ckptstore.faultpoints import fault_point
from ckptstore.format import Manifest
from ckptstore.format.constants import COMMIT_NAME, MANIFEST_NAME
from ckptstore.numeric import counted, human_bytes
from ckptstore.ops.leases import RenewingLease, lease_owner
from ckptstore.ops.sharing.overlap import check_no_overlap
from ckptstore.ops.sharing.remote import store_id
from ckptstore.ops.sharing.signing import (
    SIGNATURE_NAME,
    SignatureDoc,
    check_signature,
    load_public_key,
)
from ckptstore.ops.tiering.reencode import (
    check_codec,
    check_original,
    is_reencoded,
    original_manifest_bytes,
    reencode_copy,
)
from ckptstore.ops.tiering.replicas import manifest_on, run_resolver
from ckptstore.ops.writing.context import adopt_context, context_payload
from ckptstore.ops.writing.lossy import lossy_record
from ckptstore.progress import Progress, announce_total
from ckptstore.records import Checkpoint, CheckpointState, ReplicaState
from ckptstore.storage import Tier, copy_checkpoint
from ckptstore.storage.transfer import copy_foreign_chunks, require_foreign_chunks
from ckptstore.storage.writelog import WriteLog

__all__ = [
    "LEASE_PURPOSE",
    "PushReport",
    "push_checkpoints",
    "source_tier",
]

logger = logging.getLogger(__name__)

#: Purpose of the destination lease that serialises pushes of one checkpoint.
LEASE_PURPOSE = "push"
#: Lease length; renewed while a copy makes progress.
LEASE_TTL_S = 3600.0
#: Codec of copies made self-contained (``--self-contained``) unless another is asked.
SELF_CONTAINED_CODEC = "zstd-1"
_MAX_SIGNATURE = 64 * 1024


@dataclass
class PushReport:
    """What a push, pull or sync did.

    Attributes:
        remote: The remote's name.
        direction: ``push`` (this store → remote) or ``pull`` (remote → this store).
        tier: The destination tier the copies went to.
        pushed: Ids committed at the destination by this run (bases first).
        present: Ids the destination already had (same digest): nothing sent.
        self_contained: Ids whose copy was re-encoded to hold every chunk it reads.
        bytes_sent: Bytes actually written to the destination (files it already held
            intact are not counted: a fine-tune after its base sends only its new chunks).
        files_sent: Files actually written.
        lineage_elsewhere: Id -> parents and edges kept as references to the source store.
        revived: Ids the destination had pruned and holds again (among ``pushed``).
        pruned_there: Ids a sync left alone because the destination pruned them.
    """

    remote: str
    direction: str
    tier: str
    pushed: list[str] = field(default_factory=list)
    present: list[str] = field(default_factory=list)
    self_contained: list[str] = field(default_factory=list)
    bytes_sent: int = 0
    files_sent: int = 0
    lineage_elsewhere: dict[str, list[dict[str, str]]] = field(default_factory=dict)
    revived: list[str] = field(default_factory=list)
    pruned_there: list[str] = field(default_factory=list)

    def summary(self) -> str:
        """One line for logs and the CLI."""
        arrow = "->" if self.direction == "push" else "<-"
        text = (f"{self.direction} {arrow} {self.remote} ({self.tier}): {len(self.pushed)} "
                f"copied, {len(self.present)} already there, {human_bytes(self.bytes_sent)} in "
                f"{counted(self.files_sent, 'file')} sent")
        if self.revived:
            text += f"; {len(self.revived)} pruned there before, present again"
        if self.pruned_there:
            text += f"; {len(self.pruned_there)} pruned there, left so"
        return text

    def to_json(self) -> dict[str, Any]:
        """JSON-ready form (``--json``)."""
        return {"remote": self.remote, "direction": self.direction, "tier": self.tier,
                "pushed": list(self.pushed), "present": list(self.present),
                "self_contained": list(self.self_contained), "bytes_sent": self.bytes_sent,
                "files_sent": self.files_sent,
                "lineage_elsewhere": {k: list(v) for k, v in self.lineage_elsewhere.items()},
                "revived": list(self.revived), "pruned_there": list(self.pruned_there)}


def source_tier(store: StoreCore, ck: Checkpoint) -> Tier:
    """The fastest tier holding a complete, readable copy of ``ck`` to push from.

    A checkpoint saved across hosts has no complete hot copy on any one host; its archived
    copy is used.

    Raises:
        CheckpointNotFoundError: If no tier holds such a copy.
    """
    for name in ("hot", "warm", "cold"):
        replica = ck.replica(name)
        if replica is None or replica.state != ReplicaState.PRESENT:
            continue
        if replica.sealed:
            continue  # an encrypted tier's copy: plaintext only after a restore with a key
        if name == "hot" and ck.parted and store.settings.hot_remote is None:
            continue
        if name not in store.settings.tier_urls():
            continue
        tier = store.tier(name)
        if tier.readable:
            return tier
    where = ", ".join(f"{r.tier}:{r.state}" for r in ck.replicas) or "nowhere"
    raise CheckpointNotFoundError(
        f"checkpoint {ck.ref} ({ck.id}) has no complete readable copy to push (replicas: "
        f"{where}); restore or archive it first (`ckpt restore {ck.ref}`, with --key KEY "
        "for a copy on an encrypted tier)"
    )


@dataclass
class _Push:
    """One push run: both stores, its options and its report."""

    src: StoreCore
    dst: StoreCore
    dst_tier: Tier
    report: PushReport
    owner: str
    self_contained: bool
    codec: str
    public_key: Any
    progress: Progress | None
    deep: bool
    threads: int
    lease_ttl_s: float
    keep_pruned: bool = False
    visited: set[str] = field(default_factory=set)
    # Files are written from the transfer threads of storage/transfer.py.
    lock: threading.Lock = field(default_factory=threading.Lock)

    def sent(self, nbytes: int) -> None:
        with self.lock:
            self.report.bytes_sent += nbytes
            self.report.files_sent += 1
        if self.progress is not None:
            self.progress(nbytes)


def _at_destination(dst: StoreCore, ckpt_id: str) -> Checkpoint | None:
    try:
        return dst.catalog.get_any(ckpt_id)
    except CheckpointNotFoundError:
        return None


def _signatures(src: StoreCore, ck: Checkpoint) -> tuple[list[SignatureDoc], list[str]]:
    """Every signature the source holds for ``ck`` (its hot ``SIGNATURE`` file and its
    ``signed`` events), and what was wrong with those that could not be parsed."""
    docs: list[SignatureDoc] = []
    problems: list[str] = []
    replica = ck.replica("hot")
    if replica is not None and replica.state == ReplicaState.PRESENT:
        path = src.checkpoint_dir(ck.run, ck.id) / SIGNATURE_NAME
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            fd = -1
        if fd >= 0:
            try:
                docs.append(SignatureDoc.parse(os.read(fd, _MAX_SIGNATURE + 1)))
            except IntegrityError as exc:
                problems.append(f"its {SIGNATURE_NAME} file: {exc}")
            finally:
                os.close(fd)
    for event in src.catalog.events(ck.id, limit=1000):
        if event.kind == "signed":
            try:
                doc = SignatureDoc.parse(dict(event.detail))
            except IntegrityError as exc:
                problems.append(f"a signed event: {exc}")
                continue
            if all(d.to_dict() != doc.to_dict() for d in docs):
                docs.append(doc)
    return docs, problems


def _check_signature(ctx: _Push, ck: Checkpoint, docs: list[SignatureDoc],
                     problems: list[str]) -> None:
    """With a trusted key at the destination, ``ck`` must carry a signature by it, and every
    signature by it must verify: one bad copy of a signature means something was altered."""
    if ctx.public_key is None:
        return
    from ckptstore.ops.sharing.signing import key_fingerprint

    if problems:
        raise IntegrityError(f"checkpoint {ck.ref} ({ck.id}) carries a malformed signature ("
                             + "; ".join(problems[:2]) + "); not pushing it")
    fingerprint = key_fingerprint(ctx.public_key)
    mine = [d for d in docs if d.key_fingerprint == fingerprint]
    if not mine:
        raise IntegrityError(
            f"checkpoint {ck.ref} ({ck.id}) carries no signature by the trusted key "
            f"{fingerprint[:16]}... and the destination requires one; sign it (`ckpt sign`) "
            "or push without --require-signature"
        )
    assert ck.manifest_digest is not None
    for doc in mine:
        check_signature(doc, ck.id, ck.manifest_digest, ctx.public_key)


def _identity(ck: Checkpoint, src_tier: Tier, manifest: Manifest) -> Manifest:
    """The checkpoint's own manifest, proven from the source copy's one.

    ``manifest`` hashes to what the source catalog records for the copy
    (:func:`~ckptstore.ops.tiering.replicas.manifest_on`). Here the checkpoint's own
    manifest bytes (the copy's, or the original a re-encoded copy carries) must hash to the
    checkpoint's digest, which a signature signs, and name the checkpoint; a re-encoded
    copy must describe the same chunks (:func:`~ckptstore.ops.tiering.reencode.check_original`).

    Raises:
        IntegrityError: If any of that does not hold.
    """
    assert ck.manifest_digest is not None
    data = original_manifest_bytes(src_tier, ck.run, manifest, ck.manifest_digest)
    original = (check_original(manifest, data, ck.manifest_digest) if is_reencoded(manifest)
                else manifest)
    if original.id != ck.id or manifest.id != ck.id:
        raise IntegrityError(
            f"the source's manifest for checkpoint {ck.id} describes checkpoint "
            f"{original.id}: the other store's catalog and files disagree; not copying it")
    if original.files:
        raise IntegrityError(
            f"checkpoint {ck.ref} ({ck.id}) holds files of another layout (DCP) that its "
            "manifest pins by size and crc32c only, which cannot prove them against forgery; "
            "it cannot be verified on arrival. Share a copy in the regular layout instead "
            f"(`ckpt convert {ck.ref} --codec zstd-1` makes one)")
    return original


def _begin(ctx: _Push, ck: Checkpoint, identity: Manifest, kind: str,
           base_id: str | None) -> tuple[Checkpoint, bool, bool]:
    """The PENDING destination row for ``ck``: new, left by a dead push, or a pruned one
    revived. Returns it, whether it was revived and whether its run was created for it."""
    dst, tier = ctx.dst, ctx.dst_tier
    found = _at_destination(dst, ck.id)
    if found is not None and found.state == CheckpointState.FAILED:
        dst.catalog.forget_failed_arrival(ck.id)
        found = None
    if found is not None and found.state == CheckpointState.DELETED:
        assert ck.manifest_digest is not None
        revived = dst.catalog.revive_arrival(
            ck.id, ck.manifest_digest, kind=kind, base_id=base_id, tier=tier.name,
            uri=tier.uri_for(ck.run, ck.id),
            detail={"from_store": store_id(ctx.src), "tier": tier.name,
                    "direction": ctx.report.direction})
        if revived is not None:
            logger.info("%s: %s (%s) was pruned at the destination; it arrives again",
                        ctx.report.remote, found.ref, ck.id)
            return revived, True, False
        found = _at_destination(dst, ck.id)
    run_created = False
    if found is None:
        run_created = not _run_exists(dst, ck.run)
        parent = ck.parent_id
        if parent is not None and _at_destination(dst, parent) is None:
            parent = None  # kept as a reference to the source store (see _lineage)
        lossy = lossy_record(identity)
        try:
            found = dst.catalog.begin_checkpoint(
                ck.run, identity.step, ckpt_id=ck.id, metrics=ck.metrics, tags=ck.tags,
                parent_id=parent, kind=kind, base_id=base_id, codec=identity.codec,
                lossy=lossy["lossy"], error_bound=lossy.get("error_bound"), tier=tier.name,
                uri=tier.uri_for(ck.run, ck.id),
            )
        except ConflictError:
            # Another push began the same checkpoint a moment ago: its lease decides.
            found = dst.catalog.get_any(ck.id)
            run_created = False
    if found.state != CheckpointState.PENDING:
        raise ConflictError(f"checkpoint {ck.id} is {found.state} at the destination (a "
                            "prune or another push is at work there); rerun the push once "
                            "it is done")
    return found, False, run_created


def _run_exists(store: StoreCore, run: str) -> bool:
    try:
        store.catalog.get_run(run)
    except CheckpointNotFoundError:
        return False
    return True


def _discard(ctx: _Push, ck: Checkpoint, log: WriteLog, *, revived: bool,
             run_created: bool) -> None:
    """Undo this arrival at the destination: the files it wrote (and only those), then its
    row (a revived one returns to DELETED) and the run it created; best effort."""
    try:
        log.undo()
        ctx.dst_tier.abort_multipart_uploads(ctx.dst_tier.prefix_for(ck.run, ck.id))
    except MissingExtraError:
        pass
    except CkptError as exc:
        logger.warning("could not remove the partial copy of %s at the destination (%s); a "
                       "rerun reuses or replaces it", ck.ref, exc)
    try:
        if revived:
            ctx.dst.catalog.bury_arrival(ck.id, "push failed")
        else:
            ctx.dst.catalog.fail_checkpoint(ck.id, "push failed")
            ctx.dst.catalog.forget_failed_arrival(ck.id)
            if run_created:
                ctx.dst.catalog.forget_empty_run(ck.run)
    except CkptError as exc:
        logger.warning("could not remove the destination row of %s (%s); the next push "
                       "takes it over", ck.ref, exc)


def _copy(ctx: _Push, ck: Checkpoint, src_tier: Tier, manifest: Manifest, dst: WriteLog,
          lease: RenewingLease, contained: bool) -> tuple[int, str | None]:
    """Copy ``ck``'s files to the destination tier (through ``dst``, which records what is
    written); returns (bytes, copy's own digest)."""
    run_of = run_resolver(ctx.src, ck)

    def tick(nbytes: int) -> None:
        lease.touch()
        ctx.sent(nbytes)

    if contained:
        # The re-encoder decodes every chunk and checks its content's blake3 on the way.
        result = reencode_copy(src_tier, dst, ck.run, manifest, ctx.codec,
                               run_of=run_of, own_digest=ck.manifest_digest,
                               threads=ctx.threads, progress=tick, deep=True)
        ctx.report.self_contained.append(ck.id)
        return result.bytes, result.manifest.digest
    # Chunks of the bases: already there when the bases were pushed (then only read back).
    copy_foreign_chunks(src_tier, dst, manifest, run_of, threads=ctx.threads,
                        progress=tick, deep=ctx.deep, untrusted=True)
    fault_point("push.foreign_copied")
    nbytes = copy_checkpoint(src_tier, dst, ck.run, ck.id, manifest, threads=ctx.threads,
                             progress=tick, deep=ctx.deep, run_of=run_of, untrusted=True)
    return nbytes, manifest.digest


def _verify_destination(ctx: _Push, ck: Checkpoint, manifest: Manifest, digest: str) -> None:
    """The destination copy is complete: manifest and marker hold ``digest``, and every
    chunk the copy reads from its bases is in the base's prefix."""
    tier = ctx.dst_tier
    data = tier.get_bytes(tier.key_for(ck.run, ck.id, MANIFEST_NAME))
    marker = tier.get_bytes(tier.key_for(ck.run, ck.id, COMMIT_NAME))
    got = blake3.blake3(data).hexdigest()
    if got != digest or marker.decode("ascii", "replace").strip() != digest:
        raise IntegrityError(f"the {tier.name} copy of {ck.ref} at the destination has "
                             f"manifest {got}, not {digest}; the push is not committed")
    if digest == manifest.digest:
        require_foreign_chunks(tier, manifest, run_resolver(ctx.src, ck))


def _lineage(ctx: _Push, ck: Checkpoint) -> list[dict[str, str]]:
    """Add the lineage edges whose other end the destination holds; return the others."""
    elsewhere: list[dict[str, str]] = []
    source = store_id(ctx.src)
    if ck.parent_id is not None:
        there = _at_destination(ctx.dst, ck.parent_id)
        if there is None:
            elsewhere.append({"kind": "parent", "checkpoint": ck.parent_id, "store": source})
    for src_id, dst_id, kind in ctx.src.catalog.edges(ck.id):
        other = src_id if dst_id == ck.id else dst_id
        if _at_destination(ctx.dst, other) is None:
            elsewhere.append({"kind": kind, "checkpoint": other, "store": source,
                              "direction": "from" if other == src_id else "to"})
        else:
            ctx.dst.catalog.add_edge(src_id, dst_id, kind)
    return elsewhere


def _carry_context(ctx: _Push, ck: Checkpoint) -> None:
    """The context ``ck`` was saved under, with the blobs it names, so the destination can
    hand back how to reproduce it too. Each blob is checked against its digest on arrival
    (``record_context``); the destination records it from its own version of ``ck`` on."""
    payload = context_payload(ctx.src.catalog, ck)
    if payload is not None:
        adopt_context(ctx.dst.catalog, ctx.dst.catalog.get_any(ck.id), *payload)


def _record(ctx: _Push, ck: Checkpoint, docs: list[SignatureDoc], nbytes: int,
            sent: int) -> None:
    """After the commit: run versions, signatures, lineage, and the events on both sides.

    Idempotent, and run again for a checkpoint found committed at the destination: a push
    killed right after its commit (kill point ``push.committed``) is completed by the rerun.
    """
    try:
        info = ctx.src.catalog.get_run(ck.run)
        ctx.dst.catalog.ensure_run(ck.run, experiment=info.experiment,
                                   config=info.config or None,
                                   code_version=info.code_version,
                                   data_version=info.data_version, host=info.host)
    except CheckpointNotFoundError:
        pass
    _carry_context(ctx, ck)
    known = ctx.dst.catalog.events(ck.id, limit=1000)
    have = {json.dumps(e.detail, sort_keys=True) for e in known if e.kind == "signed"}
    for doc in docs:
        if json.dumps(doc.to_dict(), sort_keys=True) not in have:
            ctx.dst.catalog.record_event("signed", checkpoint_id=ck.id, actor=ctx.owner,
                                         detail=doc.to_dict())
    elsewhere = _lineage(ctx, ck)
    if elsewhere:
        ctx.report.lineage_elsewhere[ck.id] = elsewhere
    if any(e.kind == "received" for e in known) and sent == 0:
        return
    ctx.dst.catalog.record_event(
        "received", checkpoint_id=ck.id, actor=ctx.owner,
        detail={"from_store": store_id(ctx.src), "tier": ctx.dst_tier.name, "bytes": nbytes,
                "bytes_sent": sent, "lineage_elsewhere": elsewhere,
                "self_contained": ck.id in ctx.report.self_contained},
    )
    ctx.src.catalog.record_event(
        "pushed", checkpoint_id=ck.id, actor=ctx.owner,
        detail={"to_store": store_id(ctx.dst), "tier": ctx.dst_tier.name, "bytes_sent": sent},
    )


def _bases_there(ctx: _Push, bases: set[str]) -> bool:
    """Push ``bases`` first (oldest first); False when one can arrive neither way: the
    source pruned it (its chunks stay readable there) and the destination lacks it."""
    rows = {b: ctx.src.catalog.get_any(b) for b in bases}
    for base in sorted(bases, key=lambda i: rows[i].created_at):
        if rows[base].state == CheckpointState.COMMITTED:
            continue
        there = _at_destination(ctx.dst, base)
        if there is None or there.state != CheckpointState.COMMITTED:
            logger.info("%s: base %s was pruned at the source and is not at the "
                        "destination; sending a self-contained copy instead",
                        ctx.report.remote, base)
            return False
    for base in sorted(bases, key=lambda i: rows[i].created_at):
        if rows[base].state == CheckpointState.COMMITTED:
            _push_one(ctx, base, selected=False)
    return True


def _push_one(ctx: _Push, ckpt_id: str, *, selected: bool = True) -> None:
    if ckpt_id in ctx.visited:
        return
    ctx.visited.add(ckpt_id)
    ck = ctx.src.catalog.get_any(ckpt_id)
    if ck.state != CheckpointState.COMMITTED or ck.manifest_digest is None:
        raise IncompleteCheckpointError(
            f"checkpoint {ck.ref} ({ck.id}) is {ck.state}, not COMMITTED; only committed "
            "checkpoints can be pushed")
    there = _at_destination(ctx.dst, ck.id)
    if there is not None and there.state == CheckpointState.COMMITTED:
        if there.manifest_digest != ck.manifest_digest:
            raise ConflictError(
                f"the destination has another checkpoint with id {ck.id} ({there.ref}); "
                "refusing to push a different checkpoint under the same id")
        ctx.report.present.append(ck.id)
        replica = there.replica(ctx.dst_tier.name)
        _record(ctx, ck, _signatures(ctx.src, ck)[0], replica.bytes if replica else 0, 0)
        return
    if (there is not None and there.state == CheckpointState.DELETED and selected
            and ctx.keep_pruned):
        ctx.report.pruned_there.append(ck.id)
        return
    src_tier = source_tier(ctx.src, ck)
    manifest = manifest_on(src_tier, ck)
    identity = _identity(ck, src_tier, manifest)
    contained = ctx.self_contained and bool(manifest.referenced_checkpoints())
    if not contained:
        # Bases first: the copy's chunk references must land on committed checkpoints.
        bases = set(manifest.referenced_checkpoints())
        if identity.base_id is not None:
            bases.add(identity.base_id)
        contained = not _bases_there(ctx, bases)
    docs, problems = _signatures(ctx.src, ck)
    _check_signature(ctx, ck, docs, problems)  # before a single byte is written
    kind, base_id = ("full", None) if contained else (identity.kind, identity.base_id)
    row, revived, run_created = _begin(ctx, ck, identity, kind, base_id)
    lease = RenewingLease(ctx.dst, row.id, LEASE_PURPOSE, ctx.owner, ctx.lease_ttl_s)
    if not lease.acquire():
        holder = ctx.dst.catalog.lease_holder(row.id, LEASE_PURPOSE)
        raise LeaseHeldError(
            f"checkpoint {ck.ref} ({ck.id}) is being pushed to {ctx.report.remote} by "
            f"{holder}; wait for that push (or for its lease to expire) and rerun")
    fault_point("push.begun")
    sent_before = ctx.report.bytes_sent
    log = WriteLog(ctx.dst_tier)
    try:
        nbytes, digest = _copy(ctx, ck, src_tier, manifest, log, lease, contained)
        fault_point("push.copied")
        assert digest is not None
        _verify_destination(ctx, ck, manifest, digest)
        fault_point("push.verified")
    except BaseException:
        _discard(ctx, ck, log, revived=revived, run_created=run_created)
        lease.release()
        raise
    try:
        # Everything recorded comes from the verified manifest, not the other catalog.
        ctx.dst.catalog.commit_checkpoint(
            ck.id, manifest_digest=ck.manifest_digest, logical_bytes=identity.logical_bytes,
            stored_bytes=identity.stored_bytes, tier=ctx.dst_tier.name, replica_bytes=nbytes,
            uri=ctx.dst_tier.uri_for(ck.run, ck.id), **lossy_record(identity),
        )
        if digest != ck.manifest_digest:
            # A self-contained copy holds a re-encoded manifest; until this update a reader
            # gets a clear digest mismatch, never wrong data (as ops/sharing/bundle.py imports).
            ctx.dst.catalog.set_replica(ck.id, ctx.dst_tier.name, state=ReplicaState.PRESENT,
                                        manifest_digest=digest)
        fault_point("push.committed")
        _record(ctx, ck, docs, nbytes, ctx.report.bytes_sent - sent_before)
    finally:
        lease.release()
    ctx.report.pushed.append(ck.id)
    if revived:
        ctx.report.revived.append(ck.id)
    logger.info("%s: %s (%s) copied to the %s tier, %d bytes sent", ctx.report.remote,
                ck.ref, ck.id, ctx.dst_tier.name, ctx.report.bytes_sent - sent_before)


def _destination_tier(dst: StoreCore, tier: str | None) -> Tier:
    """The tier copies go to: ``tier``, else the destination's warm tier, else its hot."""
    if tier is None:
        tier = "warm" if "warm" in dst.settings.tier_urls() else "hot"
    return dst.tier(tier)


def push_checkpoints(
    src: StoreCore,
    dst: StoreCore,
    refs: Sequence[str],
    *,
    remote: str,
    direction: str = "push",
    tier: str | None = None,
    self_contained: bool = False,
    codec: str = SELF_CONTAINED_CODEC,
    require_signature: str | os.PathLike[str] | None = None,
    progress: Progress | None = None,
    deep: bool = False,
    threads: int = 4,
    owner: str | None = None,
    lease_ttl_s: float = LEASE_TTL_S,
    keep_pruned: bool = False,
) -> PushReport:
    """Copy checkpoints of ``src`` (with their bases) into ``dst``: copy → verify → commit.

    Args:
        src: The store the checkpoints come from.
        dst: The store they go to.
        refs: Checkpoint references in ``src`` (``run@latest``, ids, aliases, ...).
        remote: The remote's name, for messages and the report.
        direction: ``push`` or ``pull`` (which side is the remote), for the report.
        tier: Destination tier (default: its warm tier if configured, else hot).
        self_contained: Re-encode checkpoints that read chunks of other checkpoints into
            copies holding every chunk (their bases are then not pushed).
        codec: Codec preset of self-contained copies.
        require_signature: A PEM public key the destination trusts: every checkpoint must
            carry a signature by it that verifies, or nothing of it is written.
        progress: Called with the bytes of each file written; one with ``set_total`` is told
            the checkpoints' stored bytes first (an upper bound: dedup'd chunks don't travel).
        deep: Compare blake3 instead of crc32c when reading back.
        threads: Parallel transfers per checkpoint.
        owner: Lease owner (default: unique per call).
        lease_ttl_s: Lease length; renewed while copying.
        keep_pruned: Leave a checkpoint of ``refs`` that the destination pruned as it is
            (reported in ``pruned_there``) instead of sending it again (what a sync does).

    Returns:
        The :class:`PushReport`.

    Raises:
        CheckpointNotFoundError: If a reference does not resolve or a checkpoint has no
            readable copy.
        ConfigError: If the destination tier is not configured or ``codec`` is unknown.
        IntegrityError: If a signature is required and missing or invalid, the source's
            manifest is not the checkpoint's, a source chunk's content does not hash to the
            manifest's blake3 (naming checkpoint, tensor and chunk), or a copy does not
            verify (nothing of that checkpoint is then visible at the destination).
        RemoteError: If the two are one store, or a tier of one overlaps a tier of the
            other.
        LeaseHeldError: If another push of the same checkpoint is in progress.
        ConflictError: If the destination holds a different checkpoint under the same id.
        StorageError: If a tier or catalog fails (rerun to resume).
    """
    if self_contained:
        check_codec(codec)
    if store_id(src) == store_id(dst):
        from ckptstore.errors import RemoteError

        raise RemoteError(f"remote {remote!r} is this very store; nothing to copy")
    mine, theirs = (dst, src) if direction == "pull" else (src, dst)
    check_no_overlap(mine.settings, theirs.settings, remote)
    public_key = load_public_key(require_signature) if require_signature is not None else None
    checkpoints = [src.catalog.get(ref) for ref in refs]
    dst_tier = _destination_tier(dst, tier)
    report = PushReport(remote=remote, direction=direction, tier=dst_tier.name)
    ctx = _Push(src=src, dst=dst, dst_tier=dst_tier, report=report,
                owner=lease_owner(owner), self_contained=self_contained, codec=codec,
                public_key=public_key, progress=progress, deep=deep, threads=threads,
                lease_ttl_s=lease_ttl_s, keep_pruned=keep_pruned)
    announce_total(progress, sum(ck.stored_bytes for ck in checkpoints))
    for ck in sorted(checkpoints, key=lambda c: (c.created_at, c.version)):
        try:
            _push_one(ctx, ck.id)
        except CkptError as exc:
            exc.add_note(f"{direction} report so far: {report.summary()}; rerun to resume")
            raise
    logger.info("%s", report.summary())
    return report
