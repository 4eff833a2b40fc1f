"""Push and pull: copy checkpoints, with their metadata, from one store into another.

Both directions are one operation, :func:`push_checkpoints` (a pull is a push from the
remote into this store). Per checkpoint, as :mod:`ckptstore.ops.tiering.archive` does between tiers:

1. **Nothing twice.** A checkpoint keeps its id in the other store (signatures sign ids and
   lineage names them). One COMMITTED there with the same manifest digest is skipped; one
   with another digest is a :class:`~ckptstore.errors.ConflictError`.
2. **Bases first.** A delta (xor, lossy) or dedup'd checkpoint reads chunks that its bases
   own; those bases are pushed first, whole, so each arrives as a checkpoint the destination
   can load. With ``self_contained`` the checkpoint is instead re-encoded into a copy holding
   every chunk it reads (:func:`ckptstore.ops.tiering.reencode.reencode_copy`).
3. **Signatures before bytes.** With ``require_signature`` (a trusted public key of the
   destination) the checkpoint's signature (its ``SIGNATURE`` file or ``signed`` event) must
   verify against its id and manifest digest before anything is written; the manifest read
   from the source is checked against that digest, and every chunk against the manifest.
4. **A PENDING row, under a lease.** The destination gets a PENDING row with the same id (not
   listed, loaded or used as a base) and a ``push`` lease on it: a second push of the same
   checkpoint finds the row and the lease and is refused (:class:`LeaseHeldError`) instead of
   copying alongside. A lease whose holder died is taken over (:mod:`ckptstore.ops.leases`).
5. **Copy, verify, commit.** Only files the destination lacks are written
   (:func:`ckptstore.storage.transfer.copy_keys` keeps every file already there that matches,
   so the chunks a fine-tune shares with its pushed base never travel again); each is read
   back and compared; the copy's manifest and marker are checked on the destination; then
   the row is committed with the source's metadata (step, metrics, tags, lossy bounds), the
   run gets its code/data versions, signatures arrive as ``signed`` events and lineage edges
   whose other end the destination holds are added. A parent or edge to a checkpoint the
   destination lacks is kept as a reference to the source store in the ``received`` event.

A failure removes what this run wrote for the checkpoint and deletes its row: nothing becomes
visible. A crash (kill point ``push.*`` in :mod:`ckptstore.faultpoints`) leaves a PENDING
row and some files; rerunning the push takes the dead pusher's lease over, keeps the files
that match, and completes.
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
from ckptstore.ops.leases import RenewingLease, lease_owner
from ckptstore.ops.sharing.remote import store_id
from ckptstore.ops.sharing.signing import (
    SIGNATURE_NAME,
    SignatureDoc,
    check_signature,
    load_public_key,
)
from ckptstore.ops.tiering.reencode import check_codec, reencode_copy
from ckptstore.ops.tiering.replicas import manifest_on, run_resolver
from ckptstore.progress import Progress, announce_total
from ckptstore.records import Checkpoint, CheckpointState, ReplicaState
from ckptstore.storage import Tier, copy_checkpoint
from ckptstore.storage.transfer import copy_foreign_chunks, require_foreign_chunks

__all__ = [
    "LEASE_PURPOSE",
    "PushReport",
    "SyncSelection",
    "push_checkpoints",
    "source_tier",
    "sync_run",
    "sync_selection",
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

    def summary(self) -> str:
        """One line for logs and the CLI."""
        arrow = "->" if self.direction == "push" else "<-"
        return (f"{self.direction} {arrow} {self.remote} ({self.tier}): {len(self.pushed)} "
                f"copied, {len(self.present)} already there, {self.bytes_sent} bytes in "
                f"{self.files_sent} files sent")

    def to_json(self) -> dict[str, Any]:
        """JSON-ready form (``--json``)."""
        return {"remote": self.remote, "direction": self.direction, "tier": self.tier,
                "pushed": list(self.pushed), "present": list(self.present),
                "self_contained": list(self.self_contained), "bytes_sent": self.bytes_sent,
                "files_sent": self.files_sent,
                "lineage_elsewhere": {k: list(v) for k, v in self.lineage_elsewhere.items()}}


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
        f"{where}); restore or archive it first (`ckpt restore {ck.ref}`)"
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


def _begin(ctx: _Push, ck: Checkpoint, kind: str, base_id: str | None) -> Checkpoint:
    """The PENDING destination row for ``ck``, new or left by a dead push, leased by us."""
    dst = ctx.dst
    found = _at_destination(dst, ck.id)
    if found is not None and found.state == CheckpointState.FAILED:
        dst.catalog.forget_failed_arrival(ck.id)
        found = None
    if found is None:
        parent = ck.parent_id
        if parent is not None and _at_destination(dst, parent) is None:
            parent = None  # kept as a reference to the source store (see _lineage)
        try:
            found = dst.catalog.begin_checkpoint(
                ck.run, ck.step, ckpt_id=ck.id, metrics=ck.metrics, tags=ck.tags,
                parent_id=parent, kind=kind, base_id=base_id, codec=ck.codec,
                lossy=ck.lossy, error_bound=ck.error_bound, tier=ctx.dst_tier.name,
                uri=ctx.dst_tier.uri_for(ck.run, ck.id),
            )
        except ConflictError:
            # Another push began the same checkpoint a moment ago: its lease decides.
            found = dst.catalog.get_any(ck.id)
    if found.state != CheckpointState.PENDING:
        raise ConflictError(f"checkpoint {ck.id} became {found.state} at the destination "
                            "while this push started; rerun the push")
    return found


def _discard(ctx: _Push, ck: Checkpoint) -> None:
    """Remove this checkpoint's files and row from the destination; best effort."""
    tier = ctx.dst_tier
    try:
        tier.delete(tier.key_for(ck.run, ck.id, COMMIT_NAME))
        tier.delete_keys(tier.list_prefix(tier.prefix_for(ck.run, ck.id)))
        tier.abort_multipart_uploads(tier.prefix_for(ck.run, ck.id))
    except MissingExtraError:
        pass
    except CkptError as exc:
        logger.warning("could not remove the partial copy of %s at the destination (%s); a "
                       "rerun reuses or replaces it", ck.ref, exc)
    try:
        ctx.dst.catalog.fail_checkpoint(ck.id, "push failed")
        ctx.dst.catalog.forget_failed_arrival(ck.id)
    except CkptError as exc:
        logger.warning("could not remove the destination row of %s (%s); the next push "
                       "takes it over", ck.ref, exc)


def _copy(ctx: _Push, ck: Checkpoint, src_tier: Tier, manifest: Manifest,
          lease: RenewingLease) -> tuple[int, str | None]:
    """Copy ``ck``'s files to the destination tier; returns (bytes, copy's own digest)."""
    run_of = run_resolver(ctx.src, ck)

    def tick(nbytes: int) -> None:
        lease.touch()
        ctx.sent(nbytes)

    if ctx.self_contained and manifest.referenced_checkpoints():
        result = reencode_copy(src_tier, ctx.dst_tier, ck.run, manifest, ctx.codec,
                               run_of=run_of, own_digest=ck.manifest_digest,
                               threads=ctx.threads, progress=tick, deep=ctx.deep)
        ctx.report.self_contained.append(ck.id)
        return result.bytes, result.manifest.digest
    # Chunks of the bases: already there when the bases were pushed (then only read back).
    copy_foreign_chunks(src_tier, ctx.dst_tier, manifest, run_of, threads=ctx.threads,
                        progress=tick, deep=ctx.deep)
    fault_point("push.foreign_copied")
    nbytes = copy_checkpoint(src_tier, ctx.dst_tier, ck.run, ck.id, manifest,
                             threads=ctx.threads, progress=tick, deep=ctx.deep, run_of=run_of)
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


def _push_one(ctx: _Push, ckpt_id: str) -> None:
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
    src_tier = source_tier(ctx.src, ck)
    manifest = manifest_on(src_tier, ck)
    contained = ctx.self_contained and bool(manifest.referenced_checkpoints())
    if not contained:
        # Bases first: the copy's chunk references must land on committed checkpoints.
        bases = set(manifest.referenced_checkpoints())
        if ck.base_id is not None:
            bases.add(ck.base_id)
        for base in sorted(bases, key=lambda i: ctx.src.catalog.get_any(i).created_at):
            _push_one(ctx, base)
    docs, problems = _signatures(ctx.src, ck)
    _check_signature(ctx, ck, docs, problems)  # before a single byte is written
    kind, base_id = ("full", None) if contained else (ck.kind, ck.base_id)
    row = _begin(ctx, ck, kind, base_id)
    lease = RenewingLease(ctx.dst, row.id, LEASE_PURPOSE, ctx.owner, ctx.lease_ttl_s)
    if not lease.acquire():
        holder = ctx.dst.catalog.lease_holder(row.id, LEASE_PURPOSE)
        raise LeaseHeldError(
            f"checkpoint {ck.ref} ({ck.id}) is being pushed to {ctx.report.remote} by "
            f"{holder}; wait for that push (or for its lease to expire) and rerun")
    fault_point("push.begun")
    sent_before = ctx.report.bytes_sent
    try:
        nbytes, digest = _copy(ctx, ck, src_tier, manifest, lease)
        fault_point("push.copied")
        assert digest is not None
        _verify_destination(ctx, ck, manifest, digest)
        fault_point("push.verified")
    except BaseException:
        _discard(ctx, ck)
        lease.release()
        raise
    try:
        ctx.dst.catalog.commit_checkpoint(
            ck.id, manifest_digest=ck.manifest_digest, logical_bytes=ck.logical_bytes,
            stored_bytes=ck.stored_bytes, tier=ctx.dst_tier.name, replica_bytes=nbytes,
            uri=ctx.dst_tier.uri_for(ck.run, ck.id), lossy=ck.lossy,
            error_bound=ck.error_bound, lossy_scope=ck.lossy_scope,
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

    Returns:
        The :class:`PushReport`.

    Raises:
        CheckpointNotFoundError: If a reference does not resolve or a checkpoint has no
            readable copy.
        ConfigError: If the destination tier is not configured or ``codec`` is unknown.
        IntegrityError: If a signature is required and missing or invalid, or a copy does
            not verify (nothing of that checkpoint is then visible at the destination).
        LeaseHeldError: If another push of the same checkpoint is in progress.
        ConflictError: If the destination holds a different checkpoint under the same id.
        StorageError: If a tier or catalog fails (rerun to resume).
    """
    if self_contained:
        check_codec(codec)
    if store_id(src) == store_id(dst):
        from ckptstore.errors import RemoteError

        raise RemoteError(f"remote {remote!r} is this very store; nothing to copy")
    public_key = load_public_key(require_signature) if require_signature is not None else None
    checkpoints = [src.catalog.get(ref) for ref in refs]
    dst_tier = _destination_tier(dst, tier)
    report = PushReport(remote=remote, direction=direction, tier=dst_tier.name)
    ctx = _Push(src=src, dst=dst, dst_tier=dst_tier, report=report,
                owner=lease_owner(owner), self_contained=self_contained, codec=codec,
                public_key=public_key, progress=progress, deep=deep, threads=threads,
                lease_ttl_s=lease_ttl_s)
    announce_total(progress, sum(ck.stored_bytes for ck in checkpoints))
    for ck in sorted(checkpoints, key=lambda c: (c.created_at, c.version)):
        try:
            _push_one(ctx, ck.id)
        except CkptError as exc:
            exc.add_note(f"{direction} report so far: {report.summary()}; rerun to resume")
            raise
    logger.info("%s", report.summary())
    return report


@dataclass(frozen=True)
class SyncSelection:
    """What one sync pushes: to which remotes, which runs, and of each run which checkpoints.

    Attributes:
        remotes: Remote names.
        runs: Run names.
        best: Only each run's best checkpoint by this metric (None: every committed one).
        mode: ``min`` or ``max`` for ``best``.
        tag: Only checkpoints with this tag.
    """

    remotes: list[str]
    runs: list[str]
    best: str | None
    mode: str
    tag: str | None


def sync_selection(
    store: StoreCore,
    *,
    remote: str | None = None,
    runs: list[str] | None = None,
    best: str | None = None,
    mode: str | None = None,
    tag: str | None = None,
) -> SyncSelection:
    """What a sync pushes: each argument given, else the store's ``sync`` setting, else all.

    A scheduled sync is started without arguments, so the config's ``[sync]`` table is how
    an operator selects runs and bests for it.

    Raises:
        RemoteError: If the remote (given or configured) is not a remote of the store.
    """
    config = store.settings.sync
    remote = remote if remote is not None else config.get("remote")
    if remote is not None:
        store.catalog.remote(remote)  # unknown: fails before anything is pushed
        remotes = [remote]
    else:
        remotes = [r.name for r in store.catalog.remotes()]
    chosen = runs if runs is not None else config.get("runs")
    names = list(chosen) if chosen is not None else [r.name for r in store.catalog.runs()]
    return SyncSelection(
        remotes=remotes,
        runs=names,
        best=best if best is not None else config.get("best"),
        mode=mode if mode is not None else config.get("mode", "min"),
        tag=tag if tag is not None else config.get("tag"),
    )


def sync_run(
    src: StoreCore,
    dst: StoreCore,
    run: str,
    *,
    remote: str,
    tag: str | None = None,
    best: str | None = None,
    mode: str = "min",
    **options: Any,
) -> PushReport:
    """Push the committed checkpoints of ``run`` the destination lacks.

    Args:
        src: The store the checkpoints come from.
        dst: The store they go to.
        run: The run.
        remote: The remote's name.
        tag: Only checkpoints with this tag.
        best: Only the run's best checkpoint by this metric (``mode`` ``min`` or ``max``).
        mode: ``min`` or ``max`` for ``best``.
        **options: Passed on to :func:`push_checkpoints`.

    Returns:
        The :class:`PushReport`.

    Raises:
        CheckpointNotFoundError: If the run does not exist (or has no ``best`` metric).
        As :func:`push_checkpoints`.
    """
    src.catalog.get_run(run)
    if best is not None:
        todo = [src.catalog.best(run, best, mode)]
    else:
        todo = src.catalog.list(run=run, state=CheckpointState.COMMITTED,
                                order_by="created_at")
    if tag is not None:
        todo = [ck for ck in todo if tag in ck.tags]
    # What the destination has is reported as present, not sent again.
    return push_checkpoints(src, dst, [ck.id for ck in todo], remote=remote, **options)
