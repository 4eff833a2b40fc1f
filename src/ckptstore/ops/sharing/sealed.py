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
import logging
import os
import tarfile
import uuid
from collections.abc import Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

from ckptstore.core import StoreCore
from ckptstore.durable import rename_into_place
from ckptstore.errors import CkptError, DecryptionError, StorageError
from ckptstore.format.sealed import (
    DECRYPT_KEY_ENV,
    ENVELOPE_NAME,
    MAX_OBJECTS,
    Getter,
    OpenedCopy,
    open_copy,
    private_dir,
    recipient_keys,
    seal_objects,
)
from ckptstore.format.tarball import open_hostile, read_member, scan_members
from ckptstore.keyfiles import encryption_fingerprint, load_decryption_key
from ckptstore.ops.sharing.bundle import bundle_contents
from ckptstore.progress import Progress, announce_total
from ckptstore.records import Checkpoint

__all__ = [
    "SEALED_HEADER",
    "export_sealed",
    "import_sealed",
    "is_sealed_bundle",
    "private_workdir",
    "unseal_import",
]

logger = logging.getLogger(__name__)

#: First member of an encrypted bundle: the envelope.
SEALED_HEADER = "ckptstore-sealed.json"
# Objects are in memory whole: copy them into a tar in large writes, not tarfile's 16 KiB.
_TAR_BUFFER = 4 * 1024 * 1024


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
def private_workdir(store: StoreCore) -> AbstractContextManager[Path]:
    """A private (0700) temporary directory in the store's hot tier, removed afterwards
    (:func:`~ckptstore.format.sealed.private_dir`).

    In the hot tier because what goes there is a checkpoint's worth of data that belongs
    to the store anyway; a dot name, so doctor and gc never take it for a run.
    """
    return private_dir(store.hot)


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
            members = scan_members(tar, MAX_OBJECTS + 2, lambda name: None)
            opened = open_copy(_tar_getter(tar, members), private, f"encrypted bundle {path}")
            return unseal_import(store, opened, run=run, require_signature=require_signature,
                                  progress=progress)
    except tarfile.TarError as exc:
        raise DecryptionError(f"{path} is not a valid tar bundle ({exc})") from exc
    except EOFError as exc:
        raise DecryptionError(f"{path} is truncated ({exc})") from exc
