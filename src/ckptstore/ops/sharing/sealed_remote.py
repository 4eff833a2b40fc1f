"""Encrypted push and pull: sealed copies through a remote's tier.

A sealed copy (:mod:`ckptstore.ops.sharing.sealed`, the format) is written by
:func:`push_sealed` under ``.sealed/<copy id>/`` in a remote's tier, envelope last, and the
remote's catalog records nothing of it. :func:`pull_sealed` lists the remote's sealed copies,
opens those its private key unwraps, picks the one a reference names by their encrypted
headers (with ``require_signature``: only copies signed by that key) and imports it through
:func:`~ckptstore.ops.sharing.sealed.unseal_import`, every chunk checked against the
manifest's blake3 after decryption.

The sending store keeps the bookkeeping (docs/SHARING.md): a ``sealing`` event (remote, tier,
copy id) before the first object, a ``pushed_sealed`` event (and the recipients'
fingerprints) once the envelope is written. The first lets the next push of the checkpoint
remove what a killed push left; the second lets a push to the same recipients send nothing.
"""

from __future__ import annotations

import logging
import os
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ckptstore.core import StoreCore
from ckptstore.errors import (
    CheckpointNotFoundError,
    CkptError,
    DecryptionError,
    IntegrityError,
    InvalidNameError,
    RemoteError,
)
from ckptstore.format.crypt import TAG_BYTES
from ckptstore.format.sealed import (
    ENVELOPE_NAME,
    SEALED_DIR,
    Envelope,
    Getter,
    OpenedCopy,
    open_copy,
    recipient_keys,
    seal_objects,
)
from ckptstore.keyfiles import encryption_fingerprint, load_decryption_key
from ckptstore.ops.sharing.bundle import bundle_contents
from ckptstore.ops.sharing.sealed import private_workdir, unseal_import
from ckptstore.ops.sharing.signing import (
    SIGNATURE_NAME,
    SignatureDoc,
    check_signature,
    key_fingerprint,
    load_public_key,
)
from ckptstore.progress import Progress, announce_total
from ckptstore.records import Checkpoint
from ckptstore.refs import parse_ref
from ckptstore.storage import Tier

__all__ = ["SealedReport", "pull_sealed", "push_sealed", "sealed_copies", "sealed_for"]

logger = logging.getLogger(__name__)

_EVENT = "pushed_sealed"
_BEGUN_EVENT = "sealing"


@dataclass
class SealedReport:
    """What an encrypted push or pull did.

    Attributes:
        remote: The remote's name.
        direction: ``push`` or ``pull``.
        tier: The tier the sealed copies are on, at the remote.
        copies: Per checkpoint: ``checkpoint`` id, ``copy`` id, ``bytes`` (ciphertext).
        present: Ids a sealed copy to the same recipients already held (push), or this
            store already had (pull): nothing sent.
        refused: Copies a pull passed over because they matched a reference but carried
            no valid signature by the required key (unsigned or forged).
    """

    remote: str
    direction: str
    tier: str
    copies: list[dict[str, Any]] = field(default_factory=list)
    present: list[str] = field(default_factory=list)
    refused: int = 0

    @property
    def bytes_sent(self) -> int:
        """Ciphertext bytes moved."""
        return sum(int(c["bytes"]) for c in self.copies)

    def summary(self) -> str:
        """One line for logs and the CLI."""
        arrow = "->" if self.direction == "push" else "<-"
        text = (f"{self.direction} {arrow} {self.remote} ({self.tier}, encrypted): "
                f"{len(self.copies)} sealed cop{'y' if len(self.copies) == 1 else 'ies'} "
                f"moved, {len(self.present)} already there, {self.bytes_sent} bytes")
        if self.refused:
            text += f"; {self.refused} unsigned or forged refused"
        return text

    def to_json(self) -> dict[str, Any]:
        """JSON-ready form (``--json``)."""
        return {"remote": self.remote, "direction": self.direction, "tier": self.tier,
                "encrypted": True, "copies": [dict(c) for c in self.copies],
                "present": list(self.present), "bytes_sent": self.bytes_sent,
                "refused": self.refused}


def _check_apart(mine: StoreCore, theirs: StoreCore, remote: str) -> None:
    from ckptstore.ops.sharing.overlap import check_no_overlap
    from ckptstore.ops.sharing.remote import store_id

    if store_id(mine) == store_id(theirs):
        raise RemoteError(f"remote {remote!r} is this very store; nothing to copy")
    check_no_overlap(mine.settings, theirs.settings, remote)


def _tier_of(store: StoreCore, tier: str | None) -> Tier:
    if tier is None:
        tier = "warm" if "warm" in store.settings.tier_urls() else "hot"
    return store.tier(tier)


def _already_sealed(src: StoreCore, ck: Checkpoint, remote: str, tier: Tier,
                    fingerprints: list[str]) -> str | None:
    """A copy id this store sealed for ``ck`` to the same recipients, still on ``tier``."""
    for event in src.catalog.events(ck.id, limit=1000):
        detail = dict(event.detail)
        if event.kind != _EVENT or detail.get("remote") != remote or \
                detail.get("tier") != tier.name or \
                sorted(detail.get("recipients") or []) != sorted(fingerprints):
            continue
        copy_id = str(detail.get("copy", ""))
        if copy_id.isalnum() and tier.exists(f"{SEALED_DIR}/{copy_id}/{ENVELOPE_NAME}"):
            return copy_id
    return None


def push_sealed(src: StoreCore, dst: StoreCore, refs: Sequence[str], *, remote: str,
                encrypt_to: Sequence[str | os.PathLike[str]], tier: str | None = None,
                threads: int = 4, progress: Progress | None = None) -> SealedReport:
    """Push checkpoints to a remote as sealed copies only ``encrypt_to`` can read.

    Each checkpoint is sealed (:func:`~ckptstore.ops.sharing.sealed.seal_objects`) into
    ``.sealed/<copy id>/`` on the remote's tier; the remote's catalog records nothing. The
    envelope is written last, so a copy without one is unfinished (a failed push deletes
    what it wrote). This store records a
    ``pushed_sealed`` event (remote, tier, copy id, recipients' fingerprints): pushing the
    same checkpoint to the same recipients again finds the copy and sends nothing.

    Args:
        src: This store.
        dst: The remote store.
        refs: Checkpoint references in ``src``; one that reads chunks of others (delta,
            dedup'd) is sealed as a self-contained re-encoded copy.
        remote: The remote's name.
        encrypt_to: Recipients' X25519 public keys (PEM files).
        tier: The remote's tier (default: its warm tier if it has one, else hot).
        threads: Members encrypted and uploaded in parallel.
        progress: Called with each member's plaintext size.

    Returns:
        The :class:`SealedReport`.

    Raises:
        ConfigError: If a recipient key is not an X25519 public key (a signing key, say).
        RemoteError: If the remote is this store or a tier of one overlaps the other's.
        CheckpointNotFoundError: If a reference does not resolve.
        StorageError: If the remote's tier cannot be written (nothing of that copy stays).
    """
    recipients = recipient_keys(encrypt_to)
    fingerprints = [encryption_fingerprint(k) for k in recipients]
    _check_apart(src, dst, remote)
    dst_tier = _tier_of(dst, tier)
    report = SealedReport(remote=remote, direction="push", tier=dst_tier.name)
    for ref in refs:
        ck = src.catalog.get(ref)
        _remove_abandoned(src, ck, remote, dst_tier)
        if _already_sealed(src, ck, remote, dst_tier, fingerprints) is not None:
            report.present.append(ck.id)
            continue
        with private_workdir(src) as workdir:
            envelope, sent = _push_one(src, ck, dst_tier, recipients, workdir, remote,
                                       threads, progress)
        src.catalog.record_event(_EVENT, checkpoint_id=ck.id, detail={
            "remote": remote, "tier": dst_tier.name, "copy": envelope.copy_id,
            "recipients": fingerprints})
        report.copies.append({"checkpoint": ck.id, "copy": envelope.copy_id, "bytes": sent})
        logger.info("%s: sealed %s (%s) as copy %s, %d bytes", remote, ck.ref, ck.id,
                    envelope.copy_id, sent)
    return report


def _remove_abandoned(src: StoreCore, ck: Checkpoint, remote: str, tier: Tier) -> None:
    """Remove the objects of copies of ``ck`` this store began on ``tier`` and never
    finished (a killed push: a ``sealing`` event, no ``pushed_sealed`` one, no envelope)."""
    events = src.catalog.events(ck.id, limit=1000)
    done = {str(dict(e.detail).get("copy")) for e in events if e.kind == _EVENT}
    for event in events:
        detail = dict(event.detail)
        copy_id = str(detail.get("copy", ""))
        if event.kind != _BEGUN_EVENT or copy_id in done or not copy_id.isalnum() or \
                detail.get("remote") != remote or detail.get("tier") != tier.name:
            continue
        prefix = f"{SEALED_DIR}/{copy_id}/"
        if tier.exists(prefix + ENVELOPE_NAME) or not tier.list_prefix(prefix):
            continue
        removed = tier.delete_prefix(prefix)
        logger.info("%s: removed %d objects of unfinished sealed copy %s of %s", remote,
                    removed, copy_id, ck.id)


def _push_one(src: StoreCore, ck: Checkpoint, dst_tier: Tier, recipients: list[Any],
              workdir: Path, remote: str, threads: int,
              progress: Progress | None) -> tuple[Envelope, int]:
    """Seal ``ck`` onto ``dst_tier``: the envelope and the bytes written."""
    contents = bundle_contents(src, ck.id, workdir=workdir)
    announce_total(progress, sum(size for _, size in contents.members()))
    copy_id = uuid.uuid4().hex
    prefix = f"{SEALED_DIR}/{copy_id}/"
    # Recorded before the first object: a killed push's objects are found and removed by
    # the next push of the same checkpoint (_remove_abandoned).
    src.catalog.record_event(_BEGUN_EVENT, checkpoint_id=ck.id, detail={
        "remote": remote, "tier": dst_tier.name, "copy": copy_id})
    written: list[int] = []

    def put(name: str, data: bytes) -> None:
        dst_tier.put_bytes(prefix + name, data)
        written.append(len(data))

    try:
        envelope = seal_objects(contents, recipients, put, copy_id, threads=threads,
                         progress=progress, put_in_workers=True)
    except BaseException:
        try:
            dst_tier.delete_prefix(prefix)  # a fresh prefix: everything under it is ours
        except CkptError:
            logger.warning("could not remove the unfinished sealed copy %s on %s",
                           prefix, remote, exc_info=True)
        raise
    return envelope, sum(written)


def _tier_getter(tier: Tier, prefix: str) -> Getter:
    def get(name: str, limit: int) -> bytes:
        key = prefix + name
        try:
            size = tier.size(key)
        except CkptError as exc:
            raise DecryptionError(f"sealed copy {prefix} lacks {name} ({exc}); the copy is "
                                  "damaged or unfinished") from exc
        if size > limit:
            raise DecryptionError(f"sealed copy {prefix}: {name} is {size} bytes, more than "
                                  f"its index allows ({limit})")
        return tier.get_bytes(key)
    return get


def sealed_copies(store: StoreCore) -> int:
    """How many finished sealed copies the tiers of ``store`` hold (for hints)."""
    return sum(1 for _ in _sealed_copies(store))


def _sealed_copies(store: StoreCore) -> Iterable[tuple[Tier, str]]:
    """Every finished sealed copy on every tier of ``store``: (tier, prefix)."""
    for name in store.settings.tier_urls():
        tier = store.tier(name)
        if not tier.readable:
            continue
        keys = tier.list_prefix(f"{SEALED_DIR}/")
        for key in sorted(keys):
            parts = key.split("/")
            if len(parts) == 3 and parts[2] == ENVELOPE_NAME:
                yield tier, f"{parts[0]}/{parts[1]}/"


def _signed_by(opened: OpenedCopy, public: Any) -> bool:
    """Whether the copy's ``SIGNATURE`` verifies, by ``public``, for the checkpoint id and
    manifest digest its header names."""
    name = "checkpoint/" + SIGNATURE_NAME
    where = [i for i, m in enumerate(opened.members) if m.path == name]
    if not where or opened.members[where[0]].size > 64 * 1024:
        return False
    try:
        doc = SignatureDoc.parse(opened.member(where[0]))
        check_signature(doc, str(opened.header["checkpoint_id"]),
                        str(opened.header.get("manifest_digest")), public)
    except CkptError as exc:
        logger.info("%s: signature refused: %s", opened.what, exc)
        return False
    return True


def _recency(opened: OpenedCopy) -> tuple[int, str]:
    """Order for ``run@latest``: step, then creation time (header values of any type)."""
    step = opened.header.get("step")
    return (step if isinstance(step, int) and not isinstance(step, bool) else -1,
            str(opened.header.get("created_at", "")))


def _matches(ref: str, header: dict[str, Any]) -> bool:
    parsed = parse_ref(ref)
    if parsed.kind == "id":
        return header.get("checkpoint_id") == parsed.id
    if parsed.kind in ("latest", "step"):
        return header.get("run") == parsed.run and (
            parsed.kind == "latest" or header.get("step") == parsed.step)
    raise InvalidNameError(
        f"reference {ref!r}: sealed copies are found by id, run@latest or run@<step> only "
        "(the remote's catalog knows nothing of them)")


def _open_all(src: StoreCore, private: Any, remote: str) -> tuple[list[OpenedCopy], int,
                                                                  list[str]]:
    """The remote's sealed copies ``private`` opens, how many it does not, and the tiers
    the opened ones are on."""
    opened: list[OpenedCopy] = []
    others = 0
    tiers: set[str] = set()
    for tier, prefix in _sealed_copies(src):
        what = f"sealed copy {prefix} on {remote}'s {tier.name} tier"
        try:
            opened.append(open_copy(_tier_getter(tier, prefix), private, what))
            tiers.add(tier.name)
        except DecryptionError as exc:
            others += 1
            logger.debug("%s: %s", what, exc)
    return opened, others, sorted(tiers)


def sealed_for(src: StoreCore, refs: Sequence[str], *, remote: str,
               key: str | os.PathLike[str]) -> bool:
    """Whether every reference names a sealed copy on remote ``src`` that ``key`` opens.

    For a key that comes from the environment or the config rather than ``--key``: a pull
    decrypts when this holds, and otherwise looks for plain checkpoints.

    Raises:
        ConfigError: If ``key`` is not an X25519 private key.
        InvalidNameError: If a reference is malformed.
    """
    opened, _, _ = _open_all(src, load_decryption_key(key), remote)
    return bool(opened) and all(any(_matches(ref, o.header) for o in opened) for ref in refs)


def pull_sealed(dst: StoreCore, src: StoreCore, refs: Sequence[str], *, remote: str,
                key: str | os.PathLike[str],
                require_signature: str | os.PathLike[str] | None = None,
                progress: Progress | None = None) -> SealedReport:
    """Pull sealed copies from remote ``src`` that ``key`` opens, and import them here.

    The remote's sealed copies are opened with ``key`` (those encrypted to other keys are
    passed over); each reference (id, ``run@latest``, ``run@<step>``) picks among the
    opened copies by their encrypted headers (the newest step for ``run@latest``). The copy
    is decrypted into a private plaintext bundle and imported
    (:func:`~ckptstore.ops.sharing.bundle.import_bundle`: every chunk checked against the
    manifest's blake3, the signature with ``require_signature``).

    Args:
        dst: This store.
        src: The remote store.
        refs: References to what the copies hold: id, ``run@latest`` or ``run@<step>``.
        remote: The remote's name.
        key: This recipient's X25519 private key (PEM file).
        require_signature: A trusted Ed25519 public key: only copies carrying a valid
            signature by it are considered (the others are counted as ``refused``).
        progress: Called with the size of each file written to the hot tier.

    Returns:
        The :class:`SealedReport`.

    Raises:
        DecryptionError: If no sealed copy on the remote opens with ``key``, or the chosen
            one does not decrypt (nothing is written).
        CheckpointNotFoundError: If the remote holds no finished sealed copy, or copies
            open but none matches a reference.
        IntegrityError: If copies match a reference but none is validly signed by
            ``require_signature``.
        ConfigError: If ``key`` is not an X25519 private key.
        As :func:`~ckptstore.ops.sharing.bundle.import_bundle`.
    """
    private = load_decryption_key(key)
    _check_apart(dst, src, remote)
    opened, others, tiers = _open_all(src, private, remote)
    report = SealedReport(remote=remote, direction="pull", tier=",".join(tiers) or "-")
    if not opened and not others:
        raise CheckpointNotFoundError(f"remote {remote!r} holds no finished sealed copies")
    if not opened:
        raise DecryptionError(
            f"none of the {others} sealed copies on remote {remote!r} opens with the key "
            f"{encryption_fingerprint(private.public_key())[:16]}...: they were encrypted to "
            "other keys (or are damaged); use the private key they were encrypted to")
    public = load_public_key(require_signature) if require_signature is not None else None
    for ref in refs:
        found = [o for o in opened if _matches(ref, o.header)]
        if not found:
            raise CheckpointNotFoundError(
                f"no sealed copy on remote {remote!r} that opens with this key is {ref!r} "
                f"({len(opened)} open with it, {others} do not)")
        if public is not None:
            # Anyone who can write to the remote can leave a copy for this key: only those
            # signed by the trusted key count (import_bundle checks the signature again,
            # against the decrypted manifest, and every chunk against it).
            signed = [o for o in found if _signed_by(o, public)]
            report.refused += len(found) - len(signed)
            if not signed:
                raise IntegrityError(
                    f"{len(found)} sealed cop{'y' if len(found) == 1 else 'ies'} on remote "
                    f"{remote!r} match {ref!r}, but none carries a valid signature by the "
                    f"trusted key {key_fingerprint(public)[:16]}...: refused as unsigned or "
                    "forged; nothing was written")
            found = signed
        best = max(found, key=_recency)
        ckpt_id = str(best.header["checkpoint_id"])
        try:
            there: Checkpoint | None = dst.catalog.get(ckpt_id)
        except CheckpointNotFoundError:
            there = None
        if there is not None and there.manifest_digest == best.header.get("manifest_digest") \
                and require_signature is None:
            report.present.append(ckpt_id)
            continue
        # Imported (or, when present, checked again: a signature is required) in full.
        ck = unseal_import(dst, best, run=None, require_signature=require_signature,
                            progress=progress)
        if there is not None:
            report.present.append(ck.id)
            continue
        report.copies.append({"checkpoint": ck.id, "copy": best.envelope.copy_id,
                              "bytes": sum(m.size + TAG_BYTES for m in best.members)})
        dst.catalog.record_event("received", checkpoint_id=ck.id, detail={
            "remote": remote, "encrypted": True, "copy": best.envelope.copy_id})
    return report
