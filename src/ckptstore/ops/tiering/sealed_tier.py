"""Encrypted tiers: archive and demote write sealed copies only (``[tiers] encrypt_to``).

With ``encrypt_to`` set, every copy archive or demote writes to the warm or cold tier is a
sealed copy in the format pushes and bundles use (:mod:`ckptstore.format.sealed`): the
checkpoint's files (a self-contained copy of it: a delta or dedup'd save is re-encoded
first, like a bundle) and a bundle header, each encrypted with AES-256-GCM under a data key
wrapped for every recipient, stored under ``.sealed/<copy id>/`` on the tier, envelope last.
The replica row's URI names that prefix (:attr:`~ckptstore.records.Replica.sealed`) and its
``manifest_digest`` the plaintext manifest inside (always set: a sealed copy reads no other
checkpoint's files, so :mod:`ckptstore.ops.tiering.replicas` counts no chunk references for
it). The tier learns sizes and counts, nothing else (docs/SHARING.md, "Encrypted tiers").

Reading one back (restore, a load that restores, a progressive load that streams it,
``verify`` with a key) takes a recipient's private key: ``--key``, else
``$CKPT_DECRYPT_KEY``, else ``decrypt_key``
(:func:`~ckptstore.format.sealed.decryption_key_path`). The copy is decrypted object by
object into a private (0700) directory of the hot tier, its manifest checked against the
catalog's digest and its marker, every chunk decoded and checked against the manifest's
plaintext blake3; only then are its files copied into the hot tier. A missing or wrong
key, or an altered, truncated or swapped object, is a :class:`~ckptstore.errors.DecryptionError`
and the hot tier is left as it was. A progressive load
(:mod:`ckptstore.ops.reading.progressive`) uses the same steps one object at a time
(:func:`member_files`, :func:`unseal_file`, :func:`read_unsealed_manifest`,
:func:`install_unsealed`), checking each chunk before its group is read.

In an archival S3 class (GLACIER, DEEP_ARCHIVE) a sealed copy is thawed like a plain one
(:mod:`ckptstore.ops.tiering.thaw`): the objects to restore are those under its prefix,
known without a key; its envelope stays in the default class (``storage/s3.py``), so
:func:`check_recipient` tells a missing or wrong key before a thaw is asked for, and
``verify`` checks the envelope, objects and sizes without one.

Demoting a sealed warm copy copies its ciphertext objects as they are (no key needed):
the cold copy is encrypted to the recipients the warm one was.

A checkpoint saved across hosts (parts on several hosts' disks,
:mod:`ckptstore.ops.tiering.parts`) is sealed part by part, like the plain part-by-part
archive (:mod:`ckptstore.ops.tiering.parts_archive`): one copy id for the whole copy, chosen
by whichever host begins it (the others read it from the catalog's replica row); each host
seals the part its disk holds as a sealed sub-copy of its own under ``p/<k>/`` (``k`` the
part's place among the checkpoint's hosts, so the tier learns how many parts there are and
nothing of their hosts), with its own data key wrapped for the same recipients
(:func:`seal_part`); whichever host comes last seals the shared documents, manifest and
marker as the copy's top-level sealed object, whose header names every part's sub-copy
(:func:`seal_shared`); its envelope, written last, is the whole copy's commit point. A
reader opens the top object, then every part it names, and checks the result as a whole
(:func:`_unseal_into`). A plain copy of such a checkpoint is never sealed whole
(:func:`check_sealable`).
"""

from __future__ import annotations

import io
import json
import logging
import os
import shutil
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import IO, Any

import blake3

from ckptstore.core import StoreCore
from ckptstore.errors import (
    CkptError,
    ConfigError,
    DecryptionError,
    IntegrityError,
    StorageError,
)
from ckptstore.format import Manifest, verify_checkpoint
from ckptstore.format.constants import (
    BUNDLE_FILES,
    BUNDLE_HEADER,
    COMMIT_NAME,
    MANIFEST_NAME,
    SIGNATURE_NAME,
)
from ckptstore.format.crypt import TAG_BYTES, unwrap_data_key
from ckptstore.format.dcp.verify import verify_dcp
from ckptstore.format.sealed import (
    ENVELOPE_NAME,
    INDEX_NAME,
    MAX_ENVELOPE,
    SEALED_DIR,
    DirectoryContents,
    Envelope,
    Getter,
    OpenedCopy,
    decryption_key_path,
    open_copy,
    private_dir,
    recipient_keys,
    seal_objects,
)
from ckptstore.keyfiles import encryption_fingerprint, load_decryption_key
from ckptstore.ops.leases import acquire_lease
from ckptstore.ops.tiering.parts import of_ranks, part_files
from ckptstore.ops.tiering.reencode import read_copy_manifest, reencode_copy, why_not_reencode
from ckptstore.ops.tiering.replicas import manifest_on, record_parts_deleted, run_resolver
from ckptstore.progress import Progress
from ckptstore.records import Checkpoint, ReplicaState, expected_digest
from ckptstore.storage import LocalTier, Tier, copy_checkpoint
from ckptstore.storage.transfer import owned_files

__all__ = [
    "SealedCopy",
    "check_recipient",
    "check_sealable",
    "copy_sealed",
    "drop_unfinished",
    "gc_sealed",
    "install_unsealed",
    "is_sealed_on",
    "member_files",
    "new_copy_id",
    "open_sealed",
    "part_prefix",
    "parts_missing",
    "read_unsealed_manifest",
    "recipients_of",
    "restore_sealed",
    "seal_copy",
    "seal_part",
    "seal_shared",
    "sealed_prefix",
    "sealed_uri",
    "seals_tier",
    "unseal_file",
    "unseal_parts",
    "verify_sealed",
]

logger = logging.getLogger(__name__)

_PREFIX = BUNDLE_FILES
#: Codec of the self-contained copy a delta is sealed as (what bundles use).
_SELF_CONTAINED_CODEC = "zstd-1"
_HEADER_FORMAT = "ckptstore-bundle"
_HEADER_VERSION = 1
#: Where the parts of a copy sealed part by part live, under the copy's prefix.
PARTS_DIR = "p"
_PART_FORMAT = "ckptstore-sealed-part"


@dataclass(frozen=True)
class SealedCopy:
    """A sealed copy written to a tier.

    Attributes:
        copy_id: Its random id (``.sealed/<copy id>/`` on the tier).
        bytes: Ciphertext bytes written.
        digest: Digest of the plaintext manifest it holds (what the replica row records).
        recipients: sha256 fingerprints of the recipients' public keys.
    """

    copy_id: str
    bytes: int
    digest: str
    recipients: list[str]


def seals_tier(store: StoreCore, tier: str) -> bool:
    """Whether copies written to ``tier`` are sealed: ``encrypt_to`` is set and the tier is
    not the hot one (the hot tier is where the store reads and writes plaintext)."""
    return bool(store.settings.encrypt_to) and tier != "hot"


def is_sealed_on(ck: Checkpoint, tier: str) -> bool:
    """Whether the copy of ``ck`` on ``tier`` is a sealed one."""
    replica = ck.replica(tier)
    return replica is not None and replica.sealed is not None


def sealed_prefix(copy_id: str) -> str:
    """The tier prefix of sealed copy ``copy_id``."""
    return f"{SEALED_DIR}/{copy_id}/"


def sealed_uri(tier: Tier, copy_id: str) -> str:
    """The URI a replica row records for sealed copy ``copy_id`` on ``tier``."""
    base = str(tier.root) if isinstance(tier, LocalTier) else tier.url
    return f"{base.rstrip('/')}/{SEALED_DIR}/{copy_id}"


def part_prefix(copy_id: str, index: int) -> str:
    """The tier prefix of the ``index``-th part of sealed copy ``copy_id`` (a checkpoint
    saved across hosts: ``index`` is the part's place among :attr:`Checkpoint.hosts`)."""
    return f"{sealed_prefix(copy_id)}{PARTS_DIR}/{index}/"


def check_sealable(ck: Checkpoint) -> None:
    """Refuse sealing a whole plain copy of ``ck`` when it was saved across hosts.

    Such a checkpoint is sealed part by part as each host archives its own part
    (:func:`seal_part`, :func:`seal_shared`); a plain copy of it already on a shared tier
    (archived before ``encrypt_to`` was set) would become one sealed object of another
    layout than the one its readers expect.

    Raises:
        ConfigError: For a checkpoint saved across hosts.
    """
    if ck.parted:
        raise ConfigError(
            f"{ck.ref} ({ck.id}) was saved across hosts ({', '.join(ck.hosts)}): its encrypted "
            "copies are sealed part by part, each host sealing its own part when it archives "
            "from its node-local hot tier; a copy of it on a shared tier (a plain warm copy, "
            "or a hot tier in object storage) is not sealed whole. Archive or demote it "
            "without encrypt_to")


# ---------------------------------------------------------------------- writing
def _plaintext(store: StoreCore, ck: Checkpoint, src: Tier, workdir: Path,
               reencode: str | None, deep: bool) -> tuple[Path, Manifest]:
    """A complete, self-contained plaintext copy of ``ck`` from ``src``: its directory and
    the manifest its files follow.

    The hot copy itself when it is self-contained and no codec was asked for; otherwise a
    copy re-encoded into ``workdir`` (every chunk read, decoded and checked against its
    blake3), which also brings the chunks a delta reads from other checkpoints along.
    """
    if ck.manifest_digest is None:
        raise IntegrityError(f"checkpoint {ck.ref} has no manifest digest in the catalog")
    manifest = manifest_on(src, ck)
    local = src.local_dir(ck.run, ck.id)
    codec = reencode or (_SELF_CONTAINED_CODEC if manifest.referenced_checkpoints() else None)
    if codec is not None and why_not_reencode(manifest, codec) is None:
        tier = LocalTier(workdir, name="seal-work")
        result = reencode_copy(src, tier, ck.run, manifest, codec,
                               run_of=run_resolver(store, ck), own_digest=ck.manifest_digest,
                               threads=store.settings.threads, deep=True)
        directory = tier.local_dir(ck.run, ck.id)
        if local is not None and (local / SIGNATURE_NAME).is_file():
            shutil.copyfile(local / SIGNATURE_NAME, directory / SIGNATURE_NAME)
        return directory, result.manifest
    if manifest.referenced_checkpoints():
        raise ConfigError(
            f"{ck.ref} ({ck.id}) reads chunks of other checkpoints and holds files of another "
            "layout (DCP), which cannot be re-encoded into a self-contained copy: encrypted "
            "tiers cannot hold it. Save it in full (`ckpt compact REF`) and archive again")
    if local is None:
        # A plain copy on object storage (archived before encrypt_to was set): fetch it.
        tier = LocalTier(workdir, name="seal-work")
        copy_checkpoint(src, tier, ck.run, ck.id, manifest, threads=store.settings.threads,
                        deep=True)
        local = tier.local_dir(ck.run, ck.id)
    problems = verify_checkpoint(local, manifest, deep=deep)
    if problems:
        raise IntegrityError(f"cannot seal {ck.ref}: its {src.name} copy is damaged: "
                             + "; ".join(problems[:3]) + "; run `ckpt verify` to repair it")
    return local, manifest


def _header(ck: Checkpoint, manifest: Manifest, files: list[str],
            sizes: dict[str, int], parts: list[dict[str, Any]] | None = None) -> bytes:
    """The bundle header of a tier copy (``ops/sharing/bundle.py``'s, without the run
    context: the catalog that reads it back has that already)."""
    header: dict[str, Any] = {
        "format": _HEADER_FORMAT, "version": _HEADER_VERSION, "checkpoint_id": ck.id,
        "run": ck.run, "step": ck.step, "manifest_digest": ck.manifest_digest,
        "metrics": dict(ck.metrics), "tags": list(ck.tags),
        "created_at": ck.created_at.isoformat(), "exported_at": datetime.now(UTC).isoformat(),
        "files": [{"path": rel, "size": sizes[rel]} for rel in files],
    }
    if manifest.digest != ck.manifest_digest:
        header["copy_digest"] = manifest.digest
    if parts is not None:
        header["parts"] = parts
    return json.dumps(header, sort_keys=True, indent=1).encode()


def seal_copy(store: StoreCore, ck: Checkpoint, src: Tier, dst: Tier, *, copy_id: str,
              reencode: str | None = None, threads: int = 4, deep: bool = False,
              progress: Progress | None = None) -> SealedCopy:
    """Write ``ck`` (read from ``src``) as sealed copy ``copy_id`` on ``dst``, then check
    that every object is there with the size (``deep``: the blake3) it was written with.

    Encrypted to the store's ``encrypt_to`` recipients. On any failure what was written
    under the copy's prefix is removed (a fresh random prefix: everything under it is ours).

    Raises:
        ConfigError: If ``encrypt_to`` is empty or names a key that is not an X25519 public
            key, or the checkpoint cannot be sealed (:func:`check_sealable`).
        IntegrityError: If the source copy is damaged or an object does not read back.
        StorageError: If a tier fails.
    """
    check_sealable(ck)
    if not store.settings.encrypt_to:
        raise ConfigError("no recipients: set [tiers] encrypt_to to seal tier copies")
    recipients = recipient_keys(store.settings.encrypt_to)
    prefix = sealed_prefix(copy_id)
    written: dict[str, tuple[int, str | None]] = {}

    def put(name: str, data: bytes) -> None:
        dst.put_bytes(prefix + name, data)
        written[name] = (len(data), blake3.blake3(data).hexdigest() if deep else None)

    try:
        with private_dir(store.hot) as workdir:
            directory, manifest = _plaintext(store, ck, src, workdir, reencode, deep)
            files = owned_files(manifest)
            if (directory / SIGNATURE_NAME).is_file():
                files.append(SIGNATURE_NAME)
            sizes = {rel: (directory / rel).stat().st_size for rel in files}
            contents = DirectoryContents(_header(ck, manifest, files, sizes), directory, files,
                                         sizes)
            seal_objects(contents, recipients, put, copy_id, threads=threads,
                         progress=progress, put_in_workers=True)
        _check_written(dst, prefix, written, deep)
    except BaseException:
        try:
            dst.delete_prefix(prefix)
        except CkptError:
            logger.warning("could not remove the unfinished sealed copy %s on %s", prefix,
                           dst.name, exc_info=True)
        raise
    return SealedCopy(copy_id, sum(size for size, _ in written.values()), manifest.digest,
                      [encryption_fingerprint(k) for k in recipients])


def _check_written(dst: Tier, prefix: str, written: dict[str, tuple[int, str | None]],
                   deep: bool) -> None:
    """Every object of a copy just written is on ``dst`` as written (copy → verify)."""
    for name, (size, digest) in written.items():
        key = prefix + name
        # An archival class (GLACIER) cannot be read back without a thaw: S3 checked the
        # upload, the size is what can be checked here (as storage/transfer.py does).
        if deep and dst.readable:
            data = dst.get_bytes(key)
            ok = len(data) == size and blake3.blake3(data).hexdigest() == digest
        else:
            ok = dst.size(key) == size
        if not ok:
            raise IntegrityError(f"sealed copy {prefix} on {dst.name}: {name} did not read "
                                 "back as written; rerun the archive")


def copy_sealed(src: Tier, dst: Tier, copy_id: str, *, deep: bool = False,
                progress: Progress | None = None) -> int:
    """Copy sealed copy ``copy_id`` from ``src`` to ``dst`` as it is (ciphertext, no key
    needed), envelope last, each object read back; returns the bytes copied.

    Raises:
        IntegrityError: If the source copy is unfinished (no envelope) or an object does
            not read back as written.
        StorageError: If a tier fails (what was written is removed).
    """
    prefix = sealed_prefix(copy_id)
    keys = sorted(src.list_prefix(prefix))
    envelope = prefix + ENVELOPE_NAME
    if envelope not in keys:
        raise IntegrityError(f"sealed copy {prefix} on {src.name} has no envelope: it is "
                             "unfinished; run `ckpt verify` to repair it")
    written: dict[str, tuple[int, str | None]] = {}
    try:
        for key in [k for k in keys if k != envelope] + [envelope]:
            data = src.get_bytes(key)
            dst.put_bytes(key, data)
            written[key[len(prefix):]] = (len(data), blake3.blake3(data).hexdigest()
                                          if deep else None)
            if progress is not None:
                progress(len(data))
        _check_written(dst, prefix, written, deep)
    except BaseException:
        try:
            dst.delete_prefix(prefix)
        except CkptError:
            logger.warning("could not remove the unfinished sealed copy %s on %s", prefix,
                           dst.name, exc_info=True)
        raise
    return sum(size for size, _ in written.values())


# ---------------------------------------------------------------------- parts
@dataclass(frozen=True)
class _MemoryContents:
    """Members held in memory (:class:`~ckptstore.format.sealed.SealContents`): the shared
    documents, manifest and marker of a copy sealed part by part."""

    header: bytes
    files: dict[str, bytes]

    def members(self) -> list[tuple[str, int]]:
        return [(BUNDLE_HEADER, len(self.header))] + [
            (BUNDLE_FILES + rel, len(data)) for rel, data in self.files.items()]

    def open_member(self, name: str) -> IO[bytes]:
        if name == BUNDLE_HEADER:
            return io.BytesIO(self.header)
        return io.BytesIO(self.files[name[len(BUNDLE_FILES):]])


def _recipients(store: StoreCore) -> list[Any]:
    if not store.settings.encrypt_to:
        raise ConfigError("no recipients: set [tiers] encrypt_to to seal tier copies (on "
                          "every host that archives parts of a checkpoint saved across hosts)")
    return recipient_keys(store.settings.encrypt_to)


def _remove(dst: Tier, keys: list[str], what: str) -> None:
    """Best-effort removal of what a failed write left (a rerun rewrites it anyway)."""
    try:
        dst.delete_keys(keys)
    except CkptError:
        logger.warning("could not remove the unfinished %s on %s", what, dst.name,
                       exc_info=True)


def seal_part(store: StoreCore, ck: Checkpoint, dst: Tier, *, copy_id: str, part: str,
              directory: Path, manifest: Manifest, ranks: list[int], threads: int = 4,
              deep: bool = False, progress: Progress | None = None) -> tuple[int, int]:
    """Seal the part of host ``part`` of ``ck``, read from ``directory`` (this host's hot
    directory), as part sub-copy ``p/<k>/`` of sealed copy ``copy_id`` on ``dst``.

    The part's files are checked against the manifest first (sizes and every chunk's
    crc32c). The sub-copy has its own random copy id and data key, wrapped for the store's
    ``encrypt_to`` recipients; its bundle header names the checkpoint, the part and the
    whole copy. What an earlier, killed attempt left under the part's prefix is removed
    first, and what this one wrote is removed if it fails.

    Returns:
        ``(ciphertext bytes written, files of the part)``.

    Raises:
        ConfigError: If ``encrypt_to`` is empty or not X25519 public keys.
        IntegrityError: If a file of the part is damaged or an object does not read back.
        StorageError: If the tier fails.
    """
    recipients = _recipients(store)
    index = list(ck.hosts).index(part)
    prefix = part_prefix(copy_id, index)
    files = part_files(manifest, ranks)
    problems = verify_dcp(directory, manifest, deep=True, include=of_ranks(set(ranks)))
    if problems:
        raise IntegrityError(f"cannot seal the part of {part} of {ck.ref}: its hot copy is "
                             "damaged: " + "; ".join(problems[:3]) + "; run `ckpt verify` "
                             "on this host")
    sizes = dict(files)
    rels = [rel for rel, _ in files]
    header = json.dumps({
        "format": _PART_FORMAT, "version": _HEADER_VERSION, "checkpoint_id": ck.id,
        "run": ck.run, "part": part, "index": index, "copy": copy_id,
        "files": [{"path": rel, "size": sizes[rel]} for rel in rels],
    }, sort_keys=True, indent=1).encode()
    written: dict[str, tuple[int, str | None]] = {}

    def put(name: str, data: bytes) -> None:
        dst.put_bytes(prefix + name, data)
        written[name] = (len(data), blake3.blake3(data).hexdigest() if deep else None)

    dst.delete_prefix(prefix)  # a killed attempt's objects: this part is rewritten whole
    try:
        seal_objects(DirectoryContents(header, directory, rels, sizes), recipients, put,
                     new_copy_id(), threads=threads, progress=progress, put_in_workers=True)
        _check_written(dst, prefix, written, deep)
    except BaseException:
        _remove(dst, [prefix + name for name in written], f"part {prefix}")
        raise
    return sum(size for size, _ in written.values()), len(rels)


def parts_missing(ck: Checkpoint, dst: Tier, copy_id: str) -> list[str]:
    """The hosts whose sealed part of copy ``copy_id`` has no envelope on ``dst`` (lost, or
    removed by hand since it was recorded): those parts must be sealed again."""
    return [part for index, part in enumerate(ck.hosts)
            if not dst.exists(part_prefix(copy_id, index) + ENVELOPE_NAME)]


def seal_shared(store: StoreCore, ck: Checkpoint, dst: Tier, *, copy_id: str,
                manifest: Manifest, data: bytes, deep: bool = False) -> int:
    """Complete sealed copy ``copy_id`` of ``ck`` once every part is sealed on ``dst``: seal
    the shared documents, ``manifest.json`` (``data``) and the marker as the copy's top-level
    object, whose header lists every part's sub-copy id and object count (read from their
    cleartext envelopes); its envelope, written last, makes the copy complete.

    Returns:
        Ciphertext bytes written.

    Raises:
        ConfigError: If ``encrypt_to`` is empty.
        IntegrityError: If a part's envelope is missing or malformed, the parts do not
            cover the manifest, or an object does not read back.
        StorageError: If the tier fails.
    """
    # Here: the commit module pulls in torch.distributed.checkpoint, which the processes
    # that import this module to list, prune or gc copies never need.
    from ckptstore.format.dcp.zarrdocs import shared_docs

    recipients = _recipients(store)
    ranks = store.catalog.part_ranks(ck.id)
    parts: list[dict[str, Any]] = []
    covered: set[str] = set()
    for index, part in enumerate(ck.hosts):
        where = f"the sealed part {part_prefix(copy_id, index)} on {dst.name}"
        try:
            raw = dst.get_bytes(part_prefix(copy_id, index) + ENVELOPE_NAME)
            if len(raw) > MAX_ENVELOPE:
                raise DecryptionError(f"{where}: its envelope is too large")
            envelope = Envelope.parse(raw, where)
        except (DecryptionError, StorageError) as exc:
            raise IntegrityError(f"cannot complete the {dst.name} copy of {ck.ref}: {exc}; "
                                 f"archive the part of {part} again on that host") from exc
        parts.append({"index": index, "part": part, "copy": envelope.copy_id,
                      "objects": envelope.objects, "ranks": sorted(ranks.get(part, []))})
        covered |= {rel for rel, _ in part_files(manifest, ranks.get(part, []))}
    shared = dict(shared_docs(manifest))
    shared[MANIFEST_NAME] = data
    shared[COMMIT_NAME] = (manifest.digest + "\n").encode("ascii")
    owned = owned_files(manifest)
    if set(owned) != covered | set(shared):
        odd = sorted(set(owned) ^ (covered | set(shared)))
        raise IntegrityError(f"the parts of {ck.ref} do not make up its manifest's files "
                             f"({', '.join(odd[:3])}); the catalog's part ranks are damaged")
    files = {rel: shared[rel] for rel in owned if rel in shared}  # the marker last
    header = _header(ck, manifest, list(files), {k: len(v) for k, v in files.items()}, parts)
    top = sealed_prefix(copy_id)
    below = top + PARTS_DIR + "/"
    # An interrupted completion's objects (never the parts'): this one rewrites them all.
    dst.delete_keys([k for k in dst.list_prefix(top) if not k.startswith(below)])
    written: dict[str, tuple[int, str | None]] = {}

    def put(name: str, blob: bytes) -> None:
        dst.put_bytes(top + name, blob)
        written[name] = (len(blob), blake3.blake3(blob).hexdigest() if deep else None)

    try:
        seal_objects(_MemoryContents(header, files), recipients, put, copy_id, threads=1,
                     progress=None, put_in_workers=False)
        _check_written(dst, top, written, deep)
    except BaseException:
        names = [top + n for n in written if n != ENVELOPE_NAME]
        _remove(dst, [top + ENVELOPE_NAME, *names], f"sealed copy {top}")
        raise
    return sum(size for size, _ in written.values())


# ---------------------------------------------------------------------- reading
def _getter(tier: Tier, prefix: str, what: str) -> Getter:
    def get(name: str, limit: int) -> bytes:
        key = prefix + name
        try:
            size = tier.size(key)
        except CkptError as exc:
            raise DecryptionError(f"{what} lacks {name} ({exc}): it is damaged or unfinished; "
                                  "run `ckpt verify` to repair it") from exc
        if size > limit:
            raise DecryptionError(f"{what}: {name} is {size} bytes, more than its index "
                                  f"allows ({limit}): the copy is damaged")
        return tier.get_bytes(key)
    return get


def _what(ck: Checkpoint, tier: Tier) -> str:
    return f"the encrypted {tier.name} copy of {ck.ref} ({ck.id})"


def _copy_and_key(store: StoreCore, ck: Checkpoint, tier: Tier,
                  key: str | os.PathLike[str] | None) -> tuple[str, Any]:
    """The sealed copy id of ``ck`` on ``tier`` and the private key that should open it
    (``key``, else ``$CKPT_DECRYPT_KEY``, else ``decrypt_key``).

    Raises:
        DecryptionError: If the copy is not sealed, or no key is given anywhere.
        ConfigError: If the key file is not an X25519 private key.
    """
    replica = ck.replica(tier.name)
    copy_id = replica.sealed if replica is not None else None
    what = _what(ck, tier)
    if copy_id is None:
        raise DecryptionError(f"{what} is not a sealed copy")
    path = decryption_key_path(key, store.settings.decrypt_key)
    if path is None:
        raise DecryptionError(
            f"{what} is encrypted (tiers.encrypt_to): give the private key of one of its "
            "recipients with --key, $CKPT_DECRYPT_KEY or `decrypt_key` in the config")
    return copy_id, load_decryption_key(path)


def open_sealed(store: StoreCore, ck: Checkpoint, tier: Tier,
                key: str | os.PathLike[str] | None = None) -> OpenedCopy:
    """Open the sealed copy of ``ck`` on ``tier`` with a recipient's private key.

    Args:
        store: The open store.
        ck: The checkpoint.
        tier: The tier holding the sealed copy.
        key: Private key file; default ``$CKPT_DECRYPT_KEY``, else ``decrypt_key``.

    Raises:
        DecryptionError: Without a key, with a key the copy was not encrypted to, if the
            copy is damaged, or if it holds another checkpoint.
        ConfigError: If the key file is not an X25519 private key.
    """
    what = _what(ck, tier)
    copy_id, private = _copy_and_key(store, ck, tier, key)
    opened = open_copy(_getter(tier, sealed_prefix(copy_id), what), private, what)
    if opened.envelope.copy_id != copy_id:
        raise DecryptionError(f"{what}: its envelope names copy {opened.envelope.copy_id}, "
                              f"not {copy_id}: the copy was swapped")
    if opened.header.get("checkpoint_id") != ck.id or opened.header.get("run") != ck.run:
        raise DecryptionError(f"{what} holds another checkpoint "
                              f"({opened.header.get('checkpoint_id')}): the copy was swapped")
    if ck.parted:
        opened.parts = _open_parts(ck, tier, copy_id, opened, private)
    return opened


def _open_parts(ck: Checkpoint, tier: Tier, copy_id: str, top: OpenedCopy,
                private: Any) -> list[OpenedCopy]:
    """Open every part sub-copy the top-level header of a copy sealed part by part names,
    each checked to be that part of this checkpoint in this copy."""
    what = _what(ck, tier)
    entries = top.header.get("parts")
    if not isinstance(entries, list) or len(entries) != len(ck.hosts):
        raise DecryptionError(f"{what} does not list the {len(ck.hosts)} parts of a "
                              "checkpoint saved across hosts: the copy is damaged or swapped")
    opened: list[OpenedCopy] = []
    for index, (entry, part) in enumerate(zip(entries, ck.hosts, strict=True)):
        if not isinstance(entry, dict) or entry.get("index") != index or \
                entry.get("part") != part or not isinstance(entry.get("copy"), str):
            raise DecryptionError(f"{what}: its entry of part {index} is malformed")
        where = f"{what}, part {index} ({part})"
        sub = open_copy(_getter(tier, part_prefix(copy_id, index), where), private, where)
        header = sub.header
        if sub.envelope.copy_id != entry["copy"] or header.get("copy") != copy_id or \
                header.get("format") != _PART_FORMAT or header.get("part") != part or \
                header.get("index") != index or header.get("checkpoint_id") != ck.id or \
                header.get("run") != ck.run:
            raise DecryptionError(f"{where} is not the part the copy names (sub-copy "
                                  f"{sub.envelope.copy_id}): the part was swapped")
        opened.append(sub)
    return opened


def check_recipient(store: StoreCore, ck: Checkpoint, tier: Tier,
                    key: str | os.PathLike[str] | None = None) -> None:
    """Check that ``key`` opens the sealed copy of ``ck`` on ``tier``, reading only its
    envelope (which stays readable in an archival class): what a thaw checks before asking
    S3 for hours of work that only a recipient's key could use.

    Raises:
        DecryptionError: Without a key, with a key the copy was not encrypted to, or if the
            envelope is missing, malformed or names another copy.
        ConfigError: If the key file is not an X25519 private key.
    """
    what = _what(ck, tier)
    copy_id, private = _copy_and_key(store, ck, tier, key)
    get = _getter(tier, sealed_prefix(copy_id), what)
    envelope = Envelope.parse(get(ENVELOPE_NAME, MAX_ENVELOPE), what)
    if envelope.copy_id != copy_id:
        raise DecryptionError(f"{what}: its envelope names copy {envelope.copy_id}, "
                              f"not {copy_id}: the copy was swapped")
    unwrap_data_key(envelope.recipients, private, copy_id, what)


def _safe_rel(path: str, what: str) -> str:
    """The checkpoint-relative path of member ``path``, refused unless it is a plain
    relative path inside the checkpoint (anyone with a public key can make a copy)."""
    rel = path[len(_PREFIX):] if path.startswith(_PREFIX) else ""
    parts = rel.split("/")
    if not rel or "\\" in rel or "\0" in rel or any(p in ("", ".", "..") for p in parts):
        raise DecryptionError(f"{what}: member {path!r} is not a checkpoint file")
    return rel


def member_files(opened: OpenedCopy, what: str) -> dict[str, int]:
    """Each checkpoint file an opened sealed copy holds (its path relative to the
    checkpoint) and the number of the object holding it.

    Raises:
        DecryptionError: If a member is not a plain relative path inside the checkpoint or
            appears twice (anyone with a recipient's public key can make a copy).
    """
    files: dict[str, int] = {}
    for i, member in enumerate(opened.members[1:], start=1):
        rel = _safe_rel(member.path, what)
        if rel in files:
            raise DecryptionError(f"{what}: member {member.path!r} appears twice")
        files[rel] = i
    return files


def unseal_file(opened: OpenedCopy, index: int, target: Path) -> int:
    """Decrypt object ``index`` into the new file ``target``; return its size.

    Raises:
        DecryptionError: If the object is missing, truncated or altered.
    """
    data = opened.member(index)
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target, "xb") as fh:
        fh.write(data)
    return len(data)


def read_unsealed_manifest(ck: Checkpoint, tier: Tier, directory: Path,
                           names: set[str]) -> Manifest:
    """The manifest decrypted into ``directory``, checked as a restore checks any copy's
    (against the catalog's digest and the marker; a re-encoded copy's original too), and
    ``names`` (the copy's files) against the files it lists.

    Raises:
        IntegrityError: If a check fails.
    """
    if ck.manifest_digest is None:
        raise IntegrityError(f"checkpoint {ck.ref} has no manifest digest in the catalog")
    manifest = read_copy_manifest(directory, ck.manifest_digest, expected_digest(ck, tier.name))
    expected = set(owned_files(manifest)) | ({SIGNATURE_NAME} & names)
    if names != expected:
        extra, missing = sorted(names - expected), sorted(expected - names)
        raise IntegrityError(f"{_what(ck, tier)} does not hold what its manifest lists "
                             f"(extra: {extra[:3]}, missing: {missing[:3]}); run `ckpt verify`")
    return manifest


def _unseal_into(store: StoreCore, ck: Checkpoint, tier: Tier, opened: OpenedCopy,
                 workdir: Path) -> tuple[Path, Manifest]:
    """Decrypt every object into ``workdir/<run>/<id>/`` and check it as a restore checks
    any copy: the manifest against the catalog's digest, every chunk against its blake3."""
    what = _what(ck, tier)
    directory = workdir / ck.run / ck.id
    directory.mkdir(parents=True)
    names: set[str] = set()
    by_part: list[set[str]] = []
    for copy in [opened, *opened.parts]:  # a copy sealed part by part: every part's files
        files = member_files(copy, what)
        twice = names & files.keys()
        if twice:
            raise DecryptionError(f"{what}: member {sorted(twice)[0]!r} appears twice")
        for rel, i in files.items():
            unseal_file(copy, i, directory / rel)
        names.update(files)
        by_part.append(set(files))
    manifest = read_unsealed_manifest(ck, tier, directory, names)
    if ck.parted:
        # Each part holds exactly the files its ranks wrote (the catalog says which).
        ranks = store.catalog.part_ranks(ck.id)
        for part, these in zip(ck.hosts, by_part[1:], strict=True):
            wanted = {rel for rel, _ in part_files(manifest, ranks.get(part, []))}
            if these != wanted:
                raise IntegrityError(f"{what}: its part of {part} does not hold the files "
                                     "that host's ranks wrote; run `ckpt verify`")
        problems = verify_dcp(directory, manifest, deep=True)
    else:
        problems = verify_checkpoint(directory, manifest, deep=True)
    if problems:
        raise IntegrityError(f"{what} decrypts, but fails verification: "
                             + "; ".join(problems[:5]) + "; run `ckpt verify` to repair it")
    return directory, manifest


def restore_sealed(store: StoreCore, ck: Checkpoint, src: Tier, target: Tier, *,
                   key: str | os.PathLike[str] | None = None, threads: int = 4,
                   progress: Progress | None = None) -> tuple[Path, int, Manifest]:
    """Decrypt the sealed copy of ``ck`` on ``src`` and copy it into ``target``.

    The copy is decrypted and checked in full in a private directory of the hot tier
    (:func:`_unseal_into`) before the first file is written to ``target``; ``target`` then
    receives it through the ordinary verified copy, marker last.

    Returns:
        ``(directory on target, bytes written, the plaintext manifest)``.

    Raises:
        DecryptionError: As :func:`open_sealed`, or for an altered or truncated object.
        IntegrityError: If the decrypted content does not match its manifest.
        StorageError: If a tier fails.
    """
    opened = open_sealed(store, ck, src, key)
    with private_dir(store.hot) as workdir:
        _, manifest = _unseal_into(store, ck, src, opened, workdir)
        directory, nbytes = install_unsealed(ck, workdir, manifest, target, threads=threads,
                                             progress=progress)
    return directory, nbytes, manifest


def install_unsealed(ck: Checkpoint, workdir: Path, manifest: Manifest, target: Tier, *,
                     threads: int = 4, progress: Progress | None = None) -> tuple[Path, int]:
    """Copy a decrypted and checked copy (``workdir/<run>/<id>/``) into ``target`` through
    the ordinary verified copy, marker last, its signature along.

    Returns:
        ``(directory on target, bytes written)``.
    """
    nbytes = copy_checkpoint(LocalTier(workdir, name="unsealed"), target, ck.run, ck.id,
                             manifest, threads=threads, progress=progress)
    directory = target.local_dir(ck.run, ck.id)
    assert directory is not None  # restore targets are local
    signature = workdir / ck.run / ck.id / SIGNATURE_NAME
    if signature.is_file() and not (directory / SIGNATURE_NAME).exists():
        shutil.copyfile(signature, directory / SIGNATURE_NAME)
    return directory, nbytes


def unseal_parts(store: StoreCore, ck: Checkpoint, src: Tier, directory: Path, *,
                 key: str | os.PathLike[str] | None = None,
                 before_write: Callable[[Manifest], None] | None = None) -> tuple[int, Manifest]:
    """Decrypt the sealed copy on ``src`` of ``ck``, a checkpoint saved across hosts, into
    ``directory`` (this host's hot directory of it, or a directory of one's choosing).

    Everything is decrypted and checked whole in a private directory first
    (:func:`_unseal_into`); only then is ``before_write`` called and the files written,
    marker last. Files already in ``directory`` with the same bytes (this host's own part)
    are kept.

    Returns:
        ``(bytes written, the manifest)``.

    Raises:
        DecryptionError: As :func:`open_sealed`, or for an altered, missing or swapped
            object or part (nothing is written).
        IntegrityError: If the decrypted content does not match its manifest.
    """
    opened = open_sealed(store, ck, src, key)
    with private_dir(store.hot) as workdir:
        staged, manifest = _unseal_into(store, ck, src, opened, workdir)
        if before_write is not None:
            before_write(manifest)
        total = 0
        for rel in owned_files(manifest):  # the marker last
            data = (staged / rel).read_bytes()
            target = directory / rel
            if target.is_file() and target.stat().st_size == len(data) and \
                    target.read_bytes() == data:
                continue
            target.parent.mkdir(parents=True, exist_ok=True)
            target.unlink(missing_ok=True)
            shutil.copyfile(staged / rel, target)
            total += len(data)
    problems = verify_dcp(directory, manifest, deep=True)
    if problems:
        raise IntegrityError(f"the copy of {ck.ref} decrypted into {directory} fails "
                             "verification: " + "; ".join(problems[:5]))
    return total, manifest


# ---------------------------------------------------------------------- verify
def verify_sealed(store: StoreCore, ck: Checkpoint, tier: Tier,
                  key: str | os.PathLike[str] | None = None, *,
                  full: bool = True) -> tuple[list[str], bool]:
    """Check the sealed copy of ``ck`` on ``tier``.

    With a key (``key``, ``$CKPT_DECRYPT_KEY`` or ``decrypt_key``): in full, every object
    decrypted and every chunk checked against the manifest's blake3, in a private directory
    removed afterwards. Without one: what can be checked without reading the content, the
    envelope, that every object it counts is there, and their total size against the
    catalog's (also with a key when ``full`` is False: a quick check).

    Returns:
        ``(problems, full)``: what is wrong (empty: intact) and whether the check was full.
    """
    replica = ck.replica(tier.name)
    copy_id = replica.sealed if replica is not None else None
    if copy_id is None:
        return [f"{tier.name} copy is not a sealed copy"], False
    parts = len(ck.hosts) if ck.parted else 0
    if not full or not tier.readable or decryption_key_path(key, store.settings.decrypt_key) \
            is None:
        # Without a key, or in an archival class (GLACIER: its objects need a thaw first),
        # what can be checked without reading the content.
        return _verify_envelope(tier, copy_id, replica.bytes if replica else 0, parts), False
    try:
        opened = open_sealed(store, ck, tier, key)
        with private_dir(store.hot) as workdir:
            _unseal_into(store, ck, tier, opened, workdir)
    except DecryptionError as exc:
        if "was not encrypted to the key" in str(exc):
            # The key is not a recipient's: that says nothing of the copy; check what can
            # be checked without one.
            logger.warning("%s", exc)
            return _verify_envelope(tier, copy_id, replica.bytes if replica else 0,
                                    parts), False
        return [str(exc)], True
    except IntegrityError as exc:
        return [str(exc)], True
    return [], True


def _verify_envelope(tier: Tier, copy_id: str, recorded: int, parts: int = 0) -> list[str]:
    """The checks a sealed copy allows without a key (``parts``: the number of part
    sub-copies of a copy sealed part by part, each checked the same way)."""
    prefix = sealed_prefix(copy_id)
    where = f"sealed copy {prefix} on {tier.name}"
    wanted: set[str] = set()
    problems = []
    try:
        keys = set(tier.list_prefix(prefix))
        for sub in [prefix] + [part_prefix(copy_id, i) for i in range(parts)]:
            what = where if sub == prefix else f"{where}, part {sub[len(prefix):]}"
            if sub + ENVELOPE_NAME not in keys:
                return [f"{what} has no envelope (lost or unfinished)"]
            data = tier.get_bytes(sub + ENVELOPE_NAME)
            if len(data) > MAX_ENVELOPE:
                return [f"{what}: its envelope is too large"]
            envelope = Envelope.parse(data, what)
            if sub == prefix and envelope.copy_id != copy_id:
                problems.append(f"{where}: its envelope names copy {envelope.copy_id}")
            wanted |= {sub + ENVELOPE_NAME, sub + INDEX_NAME} | {
                f"{sub}o/{i}" for i in range(envelope.objects)}
    except DecryptionError as exc:
        return [str(exc)]
    except StorageError as exc:
        return [f"{where}: {exc}"]
    missing = sorted(wanted - keys)
    if missing:
        problems.append(f"{where}: {len(missing)} objects missing ({', '.join(missing[:3])})")
    extra = sorted(keys - wanted)
    if extra:
        problems.append(f"{where}: unexpected objects ({', '.join(extra[:3])})")
    if not problems and recorded:
        total = sum(tier.size(k) for k in wanted)
        if total != recorded:
            problems.append(f"{where} holds {total} bytes, the catalog recorded {recorded}")
        small = [k for k in wanted if not k.endswith(ENVELOPE_NAME)
                 and tier.size(k) < TAG_BYTES]
        if small:
            problems.append(f"{where}: {len(small)} objects are truncated")
    return problems


def recipients_of(tier: Tier, copy_id: str) -> int:
    """How many recipients sealed copy ``copy_id`` on ``tier`` was encrypted to."""
    prefix = sealed_prefix(copy_id)
    return len(Envelope.parse(tier.get_bytes(prefix + ENVELOPE_NAME), prefix).recipients)


def new_copy_id() -> str:
    """A fresh random copy id."""
    return uuid.uuid4().hex


def drop_unfinished(store: StoreCore, ck: Checkpoint, dst: Tier) -> None:
    """Remove what an earlier, unfinished sealed copy of ``ck`` left on ``dst`` (a row that
    names a sealed prefix but is not PRESENT), before a new copy with a new id is begun:
    otherwise the old prefix would be named by no row and left behind."""
    replica = ck.replica(dst.name)
    if replica is None or not replica.sealed or replica.state == ReplicaState.PRESENT:
        return
    removed = dst.delete_prefix(sealed_prefix(replica.sealed))
    if removed:
        logger.info("removed %d objects of the unfinished sealed copy %s of %s on %s",
                    removed, replica.sealed, ck.ref, dst.name)


def gc_sealed(store: StoreCore, *, dry_run: bool = False) -> list[str]:
    """Remove sealed copies this store began or deleted and did not finish.

    A replica row that names a sealed prefix and is DELETED or DELETING (a delete that
    stopped half way), or COPYING while no archive holds the checkpoint's ``archive:<tier>``
    lease (a killed archive; a lease of a dead process is taken over), has its objects
    removed and the row set DELETED. Sealed prefixes no row of this catalog names are left
    alone: a tier of this store may be another store's remote, and ``.sealed/`` is where
    encrypted pushes land (docs/SHARING.md); ``ckpt doctor`` lists them.

    Returns:
        ``<tier>:.sealed/<copy id>`` of every copy removed (or, with ``dry_run``, to remove).
    """
    removed: list[str] = []
    tiers = {name: store.tier(name) for name in store.settings.tier_urls() if name != "hot"}
    for ck in store.catalog.list(state=None):
        for replica in ck.replicas:
            tier = tiers.get(replica.tier)
            if tier is None or not replica.sealed or replica.state == ReplicaState.PRESENT \
                    or replica.state == ReplicaState.DAMAGED:
                continue
            if ck.parted and replica.state == ReplicaState.COPYING:
                # Assembled part by part: hosts upload their parts hours apart, under
                # leases of their own; a part whose upload died is rewritten whole by
                # that host's next archive (seal_part).
                continue
            prefix = sealed_prefix(replica.sealed)
            if not tier.list_prefix(prefix):
                continue
            purpose = f"archive:{tier.name}"
            owner = f"gc-{uuid.uuid4().hex[:8]}"
            if replica.state == ReplicaState.COPYING and not acquire_lease(
                    store, ck.id, purpose, owner, 600.0):
                continue  # an archive is writing it now
            try:
                removed.append(f"{tier.name}:{prefix.rstrip('/')}")
                if not dry_run:
                    tier.delete_prefix(prefix)
                    tier.abort_multipart_uploads(prefix)
                    record_parts_deleted(store, ck, tier.name)
                    store.catalog.set_replica(ck.id, tier.name, state=ReplicaState.DELETED,
                                              bytes=0)
            finally:
                if replica.state == ReplicaState.COPYING:
                    store.catalog.release_lease(ck.id, purpose, owner)
    return removed
