"""Sealed copies: a checkpoint encrypted so that only chosen recipients can read it.

A sealed copy holds exactly what a bundle (:mod:`ckptstore.ops.sharing.bundle`) holds, the
header (run, step, metrics, file list), ``manifest.json`` with every chunk's blake3,
``COMMITTED``, ``SIGNATURE`` and the chunk files, but every one of them encrypted with
AES-256-GCM under a fresh data key (:mod:`ckptstore.ops.sharing.crypt`), stored as numbered
objects whose names say nothing::

    envelope.json   cleartext: format, copy id, the data key wrapped per recipient, the
                    index's nonce and the number of objects (on a tier written last: the
                    copy's commit point; in a tar first: what the file is)
    index           encrypted: each object's member path, plaintext size and nonce
    o/<n>           encrypted: member n of the bundle (n = 0 is the bundle header)

Each object's associated data binds it to the copy id and its member path, the index's to
the copy id, so objects cannot be swapped, moved between copies or renamed. Whoever holds
the copy without a recipient's private key learns the number of objects, their sizes (the
plaintext's plus 16 bytes) and the number of recipients; nothing else (docs/SHARING.md).

A sealed copy lives in two places: a remote's tier under ``.sealed/<copy id>/``, written
by ``push --encrypt-to`` and read by ``pull --key``
(:mod:`ckptstore.ops.sharing.sealed_remote`; the remote's catalog records nothing of it),
and a tar file with the envelope as ``ckptstore-sealed.json``, written by ``export
--encrypt-to`` and read by ``import-bundle --key``. Reading one decrypts it, object by
object, into a plaintext bundle in a private temporary directory of this store's hot tier
and imports that with :func:`~ckptstore.ops.sharing.bundle.import_bundle`: every check an
import makes (each chunk's decoded content against the manifest's blake3, the manifest
against ``COMMITTED``, the signature with ``require_signature``) holds for sealed copies
too, on the plaintext. A failure removes the temporary bundle and leaves the store as it was.
This module is the format (:func:`seal_objects`, :func:`open_copy`) and the encrypted tar.
"""

from __future__ import annotations

import io
import json
import logging
import os
import shutil
import tarfile
import tempfile
import uuid
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from ckptstore.core import StoreCore
from ckptstore.durable import rename_into_place
from ckptstore.errors import (
    CkptError,
    DecryptionError,
    IntegrityError,
    InvalidNameError,
    StorageError,
)
from ckptstore.faultpoints import fault_point
from ckptstore.format.constants import MAX_CHUNK_BYTES, MAX_MANIFEST_BYTES
from ckptstore.format.tarball import bounded_json, open_hostile, read_member, scan_members
from ckptstore.ops.sharing.bundle import BUNDLE_HEADER, BundleContents, bundle_contents
from ckptstore.ops.sharing.crypt import (
    DATA_KEY_BYTES,
    NONCE_BYTES,
    TAG_BYTES,
    WrappedKey,
    b64,
    decrypt,
    encrypt,
    encryption_fingerprint,
    load_decryption_key,
    load_encryption_key,
    new_data_key,
    new_nonce,
    object_aad,
    unb64,
    unwrap_data_key,
    wrap_data_key,
)
from ckptstore.progress import Progress, announce_total
from ckptstore.records import Checkpoint

__all__ = [
    "DECRYPT_KEY_ENV",
    "ENVELOPE_NAME",
    "SEALED_DIR",
    "SEALED_HEADER",
    "Envelope",
    "Getter",
    "OpenedCopy",
    "Putter",
    "decryption_key_path",
    "export_sealed",
    "import_sealed",
    "is_sealed_bundle",
    "open_copy",
    "private_workdir",
    "recipient_keys",
    "seal_objects",
    "unseal_import",
]

logger = logging.getLogger(__name__)

#: Environment variable naming the private key that opens sealed copies.
DECRYPT_KEY_ENV = "CKPT_DECRYPT_KEY"
#: Tier prefix of sealed copies (never a run name: run names do not start with a dot).
SEALED_DIR = ".sealed"
#: First member of an encrypted bundle: the envelope.
SEALED_HEADER = "ckptstore-sealed.json"
ENVELOPE_NAME = "envelope.json"
_INDEX = "index"
_FORMAT = "ckptstore-sealed"
_VERSION = 1
_MAX_RECIPIENTS = 256
_MAX_OBJECTS = 200_000
_MAX_ENVELOPE = 256 * 1024
# Every object is decrypted in memory, and anyone with a recipient's public key can make a
# copy it opens: bound each by the largest file a checkpoint can hold (a chunk).
_MAX_MEMBER = max(MAX_CHUNK_BYTES, MAX_MANIFEST_BYTES) + 4096
# Objects are in memory whole: copy them into a tar in large writes, not tarfile's 16 KiB.
_TAR_BUFFER = 4 * 1024 * 1024


# ---------------------------------------------------------------------- format
@dataclass(frozen=True)
class Envelope:
    copy_id: str
    recipients: list[WrappedKey]
    index_nonce: bytes
    objects: int

    def to_json(self) -> bytes:
        return json.dumps({
            "format": _FORMAT, "version": _VERSION, "cipher": "AES-256-GCM",
            "key_wrap": "X25519-HKDF-SHA256-AES-256-GCM", "copy_id": self.copy_id,
            "recipients": [r.to_dict() for r in self.recipients],
            "index_nonce": b64(self.index_nonce), "objects": self.objects,
        }, sort_keys=True, indent=1).encode("ascii")

    @classmethod
    def parse(cls, data: bytes, what: str) -> Envelope:
        doc = bounded_json(data, what, 16 * _MAX_RECIPIENTS + 64)
        if not isinstance(doc, dict) or (doc.get("format"), doc.get("version")) != (
                _FORMAT, _VERSION):
            raise DecryptionError(f"{what} is not a version {_VERSION} sealed-copy envelope")
        copy_id, recipients, objects = doc.get("copy_id"), doc.get("recipients"), \
            doc.get("objects")
        if not isinstance(copy_id, str) or len(copy_id) != 32 or not copy_id.isalnum():
            raise DecryptionError(f"{what}: its copy id is malformed")
        if not isinstance(recipients, list) or not 0 < len(recipients) <= _MAX_RECIPIENTS:
            raise DecryptionError(f"{what}: its recipient list is malformed")
        if isinstance(objects, bool) or not isinstance(objects, int) or \
                not 0 < objects <= _MAX_OBJECTS:
            raise DecryptionError(f"{what}: its object count is malformed")
        return cls(copy_id, [WrappedKey.parse(r) for r in recipients],
                   unb64(doc.get("index_nonce"), NONCE_BYTES, f"{what}: the index nonce"),
                   objects)


@dataclass(frozen=True)
class _Member:
    path: str
    size: int
    nonce: bytes


def _index_bytes(copy_id: str, members: list[_Member]) -> bytes:
    return json.dumps({"copy_id": copy_id, "members": [
        {"path": m.path, "size": m.size, "nonce": b64(m.nonce)} for m in members]},
        separators=(",", ":")).encode("utf-8")


def _parse_index(data: bytes, envelope: Envelope, what: str) -> list[_Member]:
    doc = bounded_json(data, f"{what}: its index", 8 * envelope.objects + 16)
    entries = doc.get("members") if isinstance(doc, dict) else None
    if not isinstance(entries, list) or doc.get("copy_id") != envelope.copy_id or \
            len(entries) != envelope.objects:
        raise DecryptionError(f"{what}: its index does not describe this copy")
    members = []
    for entry in entries:
        if not isinstance(entry, dict):
            raise DecryptionError(f"{what}: its index is malformed")
        path, size = entry.get("path"), entry.get("size")
        if not isinstance(path, str) or not 0 < len(path) <= 1024 or isinstance(size, bool) \
                or not isinstance(size, int) or not 0 <= size <= _MAX_MEMBER:
            raise DecryptionError(f"{what}: its index is malformed")
        members.append(_Member(path, size, unb64(entry.get("nonce"), NONCE_BYTES,
                                                 f"{what}: a nonce")))
    if members[0].path != BUNDLE_HEADER:
        raise DecryptionError(f"{what}: its first object is not a bundle header")
    return members


# ---------------------------------------------------------------------- writing
#: ``put(name, data)`` stores one object of the copy.
Putter = Callable[[str, bytes], None]


def _read_all(stream: IO[bytes], size: int, name: str) -> bytes:
    data = stream.read(size + 1)
    if len(data) != size:
        raise IntegrityError(f"{name} changed while it was sealed ({len(data)} bytes, "
                             f"expected {size}); retry")
    return data


def seal_objects(contents: BundleContents, recipients: Sequence[Any], put: Putter,
                 copy_id: str, *, threads: int, progress: Progress | None,
                 put_in_workers: bool, envelope_first: bool = False) -> Envelope:
    """Encrypt every member of ``contents`` to ``put``; the envelope goes last (on a tier,
    where it marks the copy complete) or first (in a tar, where it says what the file is).

    Members are read and encrypted by ``threads`` workers, at most twice that many in
    flight (memory: that many chunk files); ``put`` is called in order from this thread,
    or from the workers with ``put_in_workers`` (a tier takes objects in any order).
    """
    data_key = new_data_key()
    listed = contents.members()
    members = [_Member(name, size, new_nonce()) for name, size in listed]
    envelope = Envelope(copy_id, [wrap_data_key(data_key, r, copy_id) for r in recipients],
                         new_nonce(), len(members))
    if envelope_first:
        put(ENVELOPE_NAME, envelope.to_json())

    def work(i: int) -> tuple[int, bytes | None, int]:
        member = members[i]
        with contents.open_member(member.path) as stream:
            plain = _read_all(stream, member.size, member.path)
        sealed = encrypt(data_key, member.nonce, plain,
                         object_aad(copy_id, "object", member.path))
        if put_in_workers:
            put(f"o/{i}", sealed)
            fault_point("sealed.object")
            return i, None, member.size
        return i, sealed, member.size

    pending: deque[Future[tuple[int, bytes | None, int]]] = deque()
    with ThreadPoolExecutor(max(1, threads), thread_name_prefix="ckpt-seal") as pool:
        for i in range(len(members)):
            pending.append(pool.submit(work, i))
            while len(pending) >= 2 * max(1, threads) or (pending and i == len(members) - 1):
                index, sealed, size = pending.popleft().result()
                if sealed is not None:
                    put(f"o/{index}", sealed)
                    fault_point("sealed.object")
                if progress is not None:
                    progress(size)
    put(_INDEX, encrypt(data_key, envelope.index_nonce, _index_bytes(copy_id, members),
                        object_aad(copy_id, "index")))
    if not envelope_first:
        put(ENVELOPE_NAME, envelope.to_json())
    return envelope


def recipient_keys(paths: Sequence[str | os.PathLike[str]]) -> list[Any]:
    if not paths:
        raise InvalidNameError("no recipient: give at least one --encrypt-to PUBKEY (an "
                               "X25519 public key of `ckpt keygen --encryption --out DIR`)")
    keys = [load_encryption_key(p) for p in paths]
    unique = {encryption_fingerprint(k): k for k in keys}
    return list(unique.values())


def _tar_add(tar: tarfile.TarFile, name: str, data: bytes, mtime: int) -> None:
    info = tarfile.TarInfo(name)
    info.size, info.mode, info.mtime, info.type = len(data), 0o644, mtime, tarfile.REGTYPE
    tar.addfile(info, io.BytesIO(data))


def export_sealed(store: StoreCore, ref: str, out_tar: str | os.PathLike[str],
                  encrypt_to: Sequence[str | os.PathLike[str]], *, threads: int = 4,
                  progress: Progress | None = None) -> Path:
    """Write checkpoint ``ref`` as an encrypted bundle that only ``encrypt_to`` can open.

    The tar holds the envelope (``ckptstore-sealed.json``, first), the encrypted index and
    one encrypted object per bundle member; names and sizes say nothing of the content but
    its sizes. Written atomically (a temporary name, then a rename).

    Args:
        store: The open store.
        ref: Checkpoint reference.
        out_tar: Output path.
        encrypt_to: Recipients' X25519 public keys (PEM files).
        threads: Members encrypted in parallel.
        progress: Called with each member's plaintext size.

    Returns:
        The path written.

    Raises:
        ConfigError: If a recipient key is not an X25519 public key (a signing key, say).
        As :func:`~ckptstore.ops.sharing.bundle.export_bundle`.
    """
    recipients = recipient_keys(encrypt_to)
    with private_workdir(store) as workdir:
        return _export_sealed(store, ref, out_tar, recipients, workdir, threads, progress)


def _export_sealed(store: StoreCore, ref: str, out_tar: str | os.PathLike[str],
                   recipients: list[Any], workdir: Path, threads: int,
                   progress: Progress | None) -> Path:
    contents = bundle_contents(store, ref, workdir=workdir)
    ck = contents.checkpoint
    announce_total(progress, sum(size for _, size in contents.members()))
    out = Path(out_tar)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    mtime = int(ck.created_at.timestamp())
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        with tarfile.TarFile(tmp, "w", format=tarfile.PAX_FORMAT,
                             copybufsize=_TAR_BUFFER) as tar:
            def put(name: str, data: bytes) -> None:
                _tar_add(tar, SEALED_HEADER if name == ENVELOPE_NAME else name, data, mtime)

            seal_objects(contents, recipients, put, uuid.uuid4().hex, threads=threads,
                  progress=progress, put_in_workers=False, envelope_first=True)
        rename_into_place(tmp, out)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise StorageError(exc.errno or 5, f"cannot write bundle {out}: {exc.strerror or exc}; "
                                           "check the path and free space") from exc
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    store.catalog.record_event("exported", checkpoint_id=ck.id, detail={
        "bundle": str(out), "files": len(contents.files), "encrypted": True,
        "recipients": [encryption_fingerprint(k) for k in recipients]})
    logger.info("exported %s (%s) encrypted to %d recipient(s): %s", ck.ref, ck.id,
                len(recipients), out)
    return out


# ---------------------------------------------------------------------- reading
#: ``get(name, limit)`` returns one object of the copy, refusing one over ``limit`` bytes.
Getter = Callable[[str, int], bytes]


@dataclass
class OpenedCopy:
    """A sealed copy whose data key this reader holds."""

    what: str
    get: Getter
    envelope: Envelope
    data_key: bytes
    members: list[_Member]
    header: dict[str, Any] = field(default_factory=dict)

    def member(self, i: int) -> bytes:
        m = self.members[i]
        data = self.get(f"o/{i}", m.size + TAG_BYTES)
        if len(data) != m.size + TAG_BYTES:
            raise DecryptionError(f"{self.what}: object o/{i} is {len(data)} bytes, its index "
                                  f"records {m.size + TAG_BYTES} (truncated or replaced)")
        return decrypt(self.data_key, m.nonce, data,
                       object_aad(self.envelope.copy_id, "object", m.path),
                       f"{self.what}: object o/{i}")


def open_copy(get: Getter, key: Any, what: str) -> OpenedCopy:
    """Unwrap the data key, decrypt the index and the bundle header.

    Raises:
        DecryptionError: If the copy was not encrypted to ``key`` or is damaged.
    """
    envelope = Envelope.parse(get(ENVELOPE_NAME, _MAX_ENVELOPE), what)
    data_key = unwrap_data_key(envelope.recipients, key, envelope.copy_id, what)
    assert len(data_key) == DATA_KEY_BYTES
    index = decrypt(data_key, envelope.index_nonce,
                    get(_INDEX, 1024 * envelope.objects + 4096),
                    object_aad(envelope.copy_id, "index"), f"{what}: its index")
    opened = OpenedCopy(what, get, envelope, data_key, _parse_index(index, envelope, what))
    header = bounded_json(opened.member(0), f"{what}: its bundle header", 1 << 20)
    if not isinstance(header, dict) or not isinstance(header.get("checkpoint_id"), str) \
            or not isinstance(header.get("run"), str):
        raise DecryptionError(f"{what}: its bundle header is malformed")
    opened.header = header
    return opened


@contextmanager
def private_workdir(store: StoreCore) -> Iterator[Path]:
    """A private (0700) temporary directory in the store's hot tier, removed afterwards.

    In the hot tier because what goes there is a checkpoint's worth of data that belongs
    to the store anyway; a dot name, so doctor and gc never take it for a run.
    """
    store.hot.mkdir(parents=True, exist_ok=True)
    path = Path(tempfile.mkdtemp(prefix=".sealed-work-", dir=store.hot))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def unseal_import(store: StoreCore, opened: OpenedCopy, *, run: str | None,
                   require_signature: str | os.PathLike[str] | None,
                   progress: Progress | None) -> Checkpoint:
    """Decrypt every object into a private plaintext bundle and import it."""
    from ckptstore.ops.sharing.bundle import import_bundle

    with private_workdir(store) as workdir:
        plain = workdir / "bundle.tar"
        with tarfile.TarFile(plain, "w", format=tarfile.PAX_FORMAT,
                             copybufsize=_TAR_BUFFER) as tar:
            for i, member in enumerate(opened.members):
                data = opened.member(i)
                info = tarfile.TarInfo(member.path)
                info.size, info.mode, info.type = len(data), 0o600, tarfile.REGTYPE
                tar.addfile(info, io.BytesIO(data))
        return import_bundle(store, plain, run=run, require_signature=require_signature,
                             progress=progress)


def _tar_getter(tar: Any, members: dict[str, tarfile.TarInfo]) -> Getter:
    def get(name: str, limit: int) -> bytes:
        info = members.get(SEALED_HEADER if name == ENVELOPE_NAME else name)
        if info is None:
            raise DecryptionError(f"the encrypted bundle has no {name} (truncated?)")
        if info.size > limit:
            raise DecryptionError(f"the encrypted bundle's {name} is {info.size} bytes, more "
                                  f"than its index allows ({limit})")
        return read_member(tar, info, limit)
    return get


def is_sealed_bundle(path: str | os.PathLike[str]) -> bool:
    """Whether the tar at ``path`` is an encrypted bundle (its first member the envelope)."""
    try:
        with open_hostile(Path(path), "bundle") as tar:
            first = tar.next()
            return first is not None and first.name == SEALED_HEADER
    except (OSError, tarfile.TarError, EOFError, CkptError):
        return False


def decryption_key_path(key: str | os.PathLike[str] | None,
                        configured: str | None = None) -> str | os.PathLike[str] | None:
    """The private key to open sealed copies with: ``key``, else ``$CKPT_DECRYPT_KEY``,
    else the config's ``decrypt_key``."""
    if key is not None:
        return key
    return os.environ.get(DECRYPT_KEY_ENV) or configured


def import_sealed(store: StoreCore, tar_path: str | os.PathLike[str],
                  key: str | os.PathLike[str] | None, *, run: str | None = None,
                  require_signature: str | os.PathLike[str] | None = None,
                  progress: Progress | None = None) -> Checkpoint:
    """Import an encrypted bundle (``export_sealed``) with a recipient's private key.

    Raises:
        DecryptionError: Without a key, with a key it was not encrypted to, or when an
            object does not decrypt (altered, truncated, moved): nothing is written.
        ConfigError: If ``key`` is not an X25519 private key.
        As :func:`~ckptstore.ops.sharing.bundle.import_bundle` for the decrypted content.
    """
    path = Path(tar_path)
    if key is None:
        raise DecryptionError(f"{path} is an encrypted bundle: give the private key it was "
                              f"encrypted to (--key, ${DECRYPT_KEY_ENV} or `decrypt_key` in "
                              "the config)")
    private = load_decryption_key(key)
    if not path.is_file():
        raise StorageError(2, f"bundle {path} does not exist or is not a file")
    try:
        with open_hostile(path, "encrypted bundle") as tar:
            members = scan_members(tar, _MAX_OBJECTS + 2, lambda name: None)
            opened = open_copy(_tar_getter(tar, members), private, f"encrypted bundle {path}")
            return unseal_import(store, opened, run=run, require_signature=require_signature,
                                  progress=progress)
    except tarfile.TarError as exc:
        raise DecryptionError(f"{path} is not a valid tar bundle ({exc})") from exc
    except EOFError as exc:
        raise DecryptionError(f"{path} is truncated ({exc})") from exc
