"""Reading a committed checkpoint's manifest: the commit marker, the manifest file (bounded,
never through a link or a FIFO) and the digest that ties them together.

Its own module so that reading a manifest (``ckpt show``, the catalog views) does not import
the tensor reader, and with it torch (tests/cli/test_startup.py).
"""

from __future__ import annotations

import os
import re
import stat
from pathlib import Path

from ckptstore.durable import storage_error
from ckptstore.errors import CheckpointNotFoundError, IncompleteCheckpointError, IntegrityError
from ckptstore.format.constants import COMMIT_NAME, MANIFEST_NAME, MAX_MANIFEST_BYTES
from ckptstore.format.manifest import Manifest, manifest_digest, parse_verified

__all__ = ["read_manifest"]

_DIGEST = re.compile(r"^[0-9a-f]{64}$")
_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)


def read_manifest(directory: Path, expected_digest: str | None = None) -> Manifest:
    """Read and validate the manifest of a committed checkpoint.

    Args:
        directory: The checkpoint directory.
        expected_digest: The digest the catalog recorded, if known.

    Raises:
        CheckpointNotFoundError: If ``directory`` does not exist.
        IncompleteCheckpointError: If the ``COMMITTED`` marker is absent.
        IntegrityError: If the manifest is missing, too large, invalid, or its digest differs
            from the marker's or ``expected_digest``.
        StorageError: On other OS errors.
    """
    directory = Path(directory)
    if not directory.is_dir():
        raise CheckpointNotFoundError(f"no checkpoint directory at {directory}")
    marker = directory / COMMIT_NAME
    try:
        text = _read_regular(marker, 256)
    except FileNotFoundError:
        raise IncompleteCheckpointError(
            f"{directory} has no {COMMIT_NAME} marker: the save that wrote it died or is still "
            "running; it cannot be loaded (ckpt gc removes dead ones)"
        ) from None
    except OSError as exc:
        raise storage_error(marker, "read", exc) from exc
    committed = text.decode("ascii", "replace").strip()
    if not _DIGEST.match(committed):
        raise IntegrityError(f"{marker} does not hold a manifest digest")
    data = _read_bounded(directory / MANIFEST_NAME)
    actual = manifest_digest(data)
    if actual != committed:
        raise IntegrityError(
            f"{directory / MANIFEST_NAME} has digest {actual}, but {COMMIT_NAME} records "
            f"{committed}: the manifest was modified or damaged"
        )
    if expected_digest is not None and actual != expected_digest:
        raise IntegrityError(
            f"{directory / MANIFEST_NAME} has digest {actual}, but {expected_digest} was "
            "expected: this is not the checkpoint the catalog recorded"
        )
    return parse_verified(data, actual)


def _open_regular(path: Path) -> int:
    """Open a checkpoint file read-only without blocking (FIFO) or following a link."""
    fd = os.open(path, os.O_RDONLY | _O_CLOEXEC | os.O_NONBLOCK | os.O_NOFOLLOW)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise IntegrityError(f"{path} is not a regular file; the checkpoint was tampered with")
    return fd


def _read_regular(path: Path, limit: int) -> bytes:
    fd = _open_regular(path)
    try:
        with os.fdopen(os.dup(fd), "rb") as fh:
            return fh.read(limit)
    finally:
        os.close(fd)


def _read_bounded(path: Path) -> bytes:
    try:
        fd = _open_regular(path)
    except FileNotFoundError:
        raise IntegrityError(f"{path} is missing from a committed checkpoint") from None
    except OSError as exc:
        raise storage_error(path, "open", exc) from exc
    try:
        size = os.fstat(fd).st_size
        # Checked before reading so a hostile file cannot make us allocate unbounded memory.
        if size > MAX_MANIFEST_BYTES:
            raise IntegrityError(f"{path} is {size} bytes, over the {MAX_MANIFEST_BYTES} limit")
        with os.fdopen(os.dup(fd), "rb") as fh:
            return fh.read(MAX_MANIFEST_BYTES + 1)
    except OSError as exc:
        raise storage_error(path, "read", exc) from exc
    finally:
        os.close(fd)
