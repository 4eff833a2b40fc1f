"""The sealed-copy format: a checkpoint encrypted so that only chosen recipients can read it.

A sealed copy holds exactly what a bundle (:mod:`ckptstore.ops.sharing.bundle`) holds, the
header (run, step, metrics, file list), ``manifest.json`` with every chunk's blake3,
``COMMITTED``, ``SIGNATURE`` and the chunk files, but every one of them encrypted with
AES-256-GCM under a fresh data key (:mod:`ckptstore.format.crypt`), stored as numbered
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

This module is the format only (:func:`seal_objects` writes one through a ``put``,
:func:`open_copy` opens one through a ``get``), in the format layer because three places
write and read it: encrypted pushes to a remote's tier and encrypted bundles
(:mod:`ckptstore.ops.sharing.sealed`, :mod:`ckptstore.ops.sharing.sealed_remote`) and this
store's own encrypted tiers (:mod:`ckptstore.ops.tiering.sealed_tier`, ``[tiers]
encrypt_to``). On a tier a copy lives under ``.sealed/<copy id>/``.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import tempfile
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Protocol

from ckptstore.errors import DecryptionError, IntegrityError, InvalidNameError
from ckptstore.faultpoints import fault_point
from ckptstore.format.constants import (
    BUNDLE_FILES,
    BUNDLE_HEADER,
    MAX_CHUNK_BYTES,
    MAX_MANIFEST_BYTES,
)
from ckptstore.format.crypt import (
    DATA_KEY_BYTES,
    NONCE_BYTES,
    TAG_BYTES,
    WrappedKey,
    b64,
    decrypt,
    encrypt,
    new_data_key,
    new_nonce,
    object_aad,
    unb64,
    unwrap_data_key,
    wrap_data_key,
)
from ckptstore.format.tarball import bounded_json
from ckptstore.keyfiles import encryption_fingerprint, load_encryption_key
from ckptstore.progress import Progress
from ckptstore.records import SEALED_DIR

__all__ = [
    "DECRYPT_KEY_ENV",
    "ENVELOPE_NAME",
    "INDEX_NAME",
    "MAX_ENVELOPE",
    "MAX_OBJECTS",
    "SEALED_DIR",
    "DirectoryContents",
    "Envelope",
    "Getter",
    "Member",
    "OpenedCopy",
    "Putter",
    "SealContents",
    "decryption_key_path",
    "open_copy",
    "private_dir",
    "recipient_keys",
    "seal_objects",
]

#: Environment variable naming the private key that opens sealed copies.
DECRYPT_KEY_ENV = "CKPT_DECRYPT_KEY"
ENVELOPE_NAME = "envelope.json"
INDEX_NAME = "index"
_INDEX = INDEX_NAME
_FORMAT = "ckptstore-sealed"
_VERSION = 1
_MAX_RECIPIENTS = 256
#: Most objects a copy may have (a checkpoint's files and the header).
MAX_OBJECTS = 200_000
_MAX_OBJECTS = MAX_OBJECTS
#: Largest envelope a reader accepts.
MAX_ENVELOPE = 256 * 1024
_MAX_ENVELOPE = MAX_ENVELOPE
# Every object is decrypted in memory, and anyone with a recipient's public key can make a
# copy it opens: bound each by the largest file a checkpoint can hold (a chunk).
_MAX_MEMBER = max(MAX_CHUNK_BYTES, MAX_MANIFEST_BYTES) + 4096


class SealContents(Protocol):
    """What :func:`seal_objects` encrypts: named members, the bundle header first."""

    def members(self) -> list[tuple[str, int]]:
        """Every member's name and size, :data:`BUNDLE_HEADER` first."""

    def open_member(self, name: str) -> IO[bytes]:
        """A binary stream of member ``name``."""


@dataclass(frozen=True)
class DirectoryContents:
    """A checkpoint directory as :class:`SealContents`: the header, then each file under
    :data:`~ckptstore.format.constants.BUNDLE_FILES` (what a bundle and a sealed copy hold).

    Attributes:
        header: The header member's bytes (:data:`BUNDLE_HEADER`).
        directory: The checkpoint's directory, where the files are read from.
        files: The checkpoint's files (paths relative to ``directory``), in member order.
        sizes: Each file's size.
    """

    header: bytes
    directory: Path
    files: list[str]
    sizes: dict[str, int]

    def members(self) -> list[tuple[str, int]]:
        """Every member's name and size, header first."""
        return [(BUNDLE_HEADER, len(self.header))] + [
            (BUNDLE_FILES + rel, self.sizes[rel]) for rel in self.files]

    def open_member(self, name: str) -> IO[bytes]:
        """A binary stream of member ``name``."""
        if name == BUNDLE_HEADER:
            return io.BytesIO(self.header)
        return open(self.directory / name[len(BUNDLE_FILES):], "rb")


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
class Member:
    path: str
    size: int
    nonce: bytes


def _index_bytes(copy_id: str, members: list[Member]) -> bytes:
    return json.dumps({"copy_id": copy_id, "members": [
        {"path": m.path, "size": m.size, "nonce": b64(m.nonce)} for m in members]},
        separators=(",", ":")).encode("utf-8")


def _parse_index(data: bytes, envelope: Envelope, what: str) -> list[Member]:
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
        members.append(Member(path, size, unb64(entry.get("nonce"), NONCE_BYTES,
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


def seal_objects(contents: SealContents, recipients: Sequence[Any], put: Putter,
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
    members = [Member(name, size, new_nonce()) for name, size in listed]
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


#: ``get(name, limit)`` returns one object of the copy, refusing one over ``limit`` bytes.
Getter = Callable[[str, int], bytes]


@dataclass
class OpenedCopy:
    """A sealed copy whose data key this reader holds.

    ``parts``: for a tier copy of a checkpoint saved across hosts, the part sub-copies its
    header names, opened too (:mod:`ckptstore.ops.tiering.sealed_tier`); empty otherwise.
    """

    what: str
    get: Getter
    envelope: Envelope
    data_key: bytes
    members: list[Member]
    header: dict[str, Any] = field(default_factory=dict)
    parts: list[OpenedCopy] = field(default_factory=list)

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


def decryption_key_path(key: str | os.PathLike[str] | None,
                        configured: str | None = None) -> str | os.PathLike[str] | None:
    """The private key to open sealed copies with: ``key``, else ``$CKPT_DECRYPT_KEY``,
    else the config's ``decrypt_key``."""
    if key is not None:
        return key
    return os.environ.get(DECRYPT_KEY_ENV) or configured


@contextmanager
def private_dir(parent: Path) -> Iterator[Path]:
    """A private (0700) temporary directory under ``parent``, removed afterwards.

    Where a sealed copy is decrypted (or a plaintext copy is prepared for sealing): the
    plaintext never sits anywhere others can read. A dot name, so doctor and gc never take
    it for a run.
    """
    parent.mkdir(parents=True, exist_ok=True)
    path = Path(tempfile.mkdtemp(prefix=".sealed-work-", dir=parent))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)
