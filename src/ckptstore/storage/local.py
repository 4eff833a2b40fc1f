"""A tier on a local (or locally mounted) file system: the hot tier, or a shared mount.

Writes go to a hidden temporary file in the target directory, are fsynced, and are then
published with ``link()``, which fails if the name exists: that gives atomic, write-once
files without a check-then-write race. The directory is fsynced afterwards so the new name
survives a crash.

Reads and writes refuse symlinks (a key must name a plain file inside the root). Deletes never
follow one either, but they do not refuse it: a symlink planted in a checkpoint directory (in
a file's place, a directory's, or the checkpoint directory's itself) is unlinked as the link it
is, so that deleting the checkpoint can always finish.
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import ClassVar

from ckptstore.durable import FSYNC_UNSUPPORTED, TEMP_PREFIX, fsync_dir, fsync_fd
from ckptstore.errors import ConflictError, InvalidNameError, StorageError
from ckptstore.names import validate_name
from ckptstore.storage.base import Tier, check_checkpoint_id, check_key

__all__ = ["LocalTier"]

logger = logging.getLogger(__name__)

_COPY_BLOCK = 4 * 1024 * 1024

_HINTS = {
    errno.ENOSPC: "the disk is full: free space or prune old checkpoints",
    errno.EDQUOT: "the disk quota is exhausted: free space or prune old checkpoints",
    errno.EACCES: "permission denied: check the directory's owner and mode",
    errno.EPERM: "permission denied: check the directory's owner and mode",
    errno.EROFS: "the file system is read-only: remount it or use another directory",
    errno.ENOENT: "the file does not exist: check the tier root and the catalog",
}


class LocalTier(Tier):
    """Checkpoint files under a local directory ``root`` (``<root>/<run>/<id>/<file>``).

    Example:
        >>> tier = LocalTier("/nvme/ckpt/hot", name="hot")          # doctest: +SKIP
        >>> tier.put_bytes("run-a/0123/manifest.json", b"{}")      # doctest: +SKIP
    """

    supports_rename: ClassVar[bool] = True
    is_local: ClassVar[bool] = True

    def __init__(self, root: str | os.PathLike[str], name: str = "hot") -> None:
        """Create the tier (the directory is created on first write).

        Args:
            root: The tier's root directory; ``file://`` URLs are accepted.
            name: The tier's name in the catalog.
        """
        super().__init__(name)
        text = os.fspath(root)
        if text.startswith("file://"):
            text = text[len("file://") :]
        self.root = Path(text).expanduser().resolve()

    @property
    def url(self) -> str:
        """The root directory as a plain path."""
        return str(self.root)

    def uri_for(self, run: str, ckpt_id: str) -> str:
        """The checkpoint's directory path (what the catalog records for local replicas)."""
        return str(self.root / validate_name(run) / check_checkpoint_id(ckpt_id))

    def local_dir(self, run: str, ckpt_id: str) -> Path:
        """The checkpoint's directory (it may not exist yet)."""
        return self.root / validate_name(run) / check_checkpoint_id(ckpt_id)

    # ------------------------------------------------------------------ helpers
    def _error(self, action: str, key: str, exc: OSError) -> StorageError:
        hint = _HINTS.get(exc.errno or 0, "check the path and retry")
        err = StorageError(
            exc.errno or errno.EIO,
            f"{self.name} tier: cannot {action} {key!r} under {self.root}: "
            f"{exc.strerror or exc}; {hint}",
        )
        err.filename = str(self.root / key) if key else str(self.root)
        return err

    @contextmanager
    def _wrap(self, action: str, key: str) -> Iterator[None]:
        try:
            yield
        except (StorageError, ConflictError, InvalidNameError):
            raise
        except OSError as exc:
            raise self._error(action, key, exc) from exc

    def _path(self, key: str) -> Path:
        """Map a key to a path under the root, refusing anything that escapes it."""
        check_key(key)
        path = self.root / key
        # A symlinked directory inside the root could point anywhere; resolve what exists
        # and require it to stay under the (resolved) root.
        parent = path.parent
        while not parent.exists() and parent != self.root and self.root in parent.parents:
            parent = parent.parent
        real_parent = Path(os.path.realpath(parent))
        if real_parent != self.root and self.root not in real_parent.parents:
            raise InvalidNameError(
                f"{self.name} tier: key {key!r} resolves outside {self.root} "
                "(a symlink points elsewhere); remove the link"
            )
        if path.is_symlink():
            raise InvalidNameError(
                f"{self.name} tier: {path} is a symlink; checkpoint files must be plain files"
            )
        return path

    def _publish(self, key: str, write: Callable[[int], int]) -> int:
        """Write through a temp file in the target directory, then link it into place."""
        path = self._path(key)
        with self._wrap("write", key):
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.parent / f"{TEMP_PREFIX}{uuid.uuid4().hex}"
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
            try:
                try:
                    written = write(fd)
                    fsync_fd(fd, tmp)
                finally:
                    os.close(fd)
                self._link_into_place(tmp, path, key)
            finally:
                if tmp.exists():
                    tmp.unlink()
            _fsync_dir_if_supported(path.parent)
        return written

    def _link_into_place(self, tmp: Path, path: Path, key: str) -> None:
        try:
            os.link(tmp, path)
        except FileExistsError as exc:
            raise ConflictError(
                f"{self.name} tier: {key!r} already exists and files are written once; "
                "delete the incomplete copy first (or let the archive flow redo it)"
            ) from exc
        except OSError as exc:
            if exc.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV,
                                 errno.EMLINK):
                raise
            # No hard links on this file system (some FUSE/SMB mounts): check, then rename.
            # Two writers racing on the same key could both pass the check; the catalog
            # lease around every copy is what prevents that in practice.
            if os.path.lexists(path):
                raise ConflictError(
                    f"{self.name} tier: {key!r} already exists and files are written once"
                ) from exc
            os.replace(tmp, path)

    # ------------------------------------------------------------------ Tier API
    def put_bytes(self, key: str, data: bytes) -> int:
        """Store ``data`` under ``key`` (atomic, durable, write-once)."""

        def write(fd: int) -> int:
            view = memoryview(data)
            total = 0
            while total < len(view):
                total += os.write(fd, view[total:])
            return total

        return self._publish(key, write)

    def put_file(self, local: Path, key: str) -> int:
        """Store a copy of local file ``local`` under ``key`` (atomic, durable, write-once)."""

        def write(fd: int) -> int:
            total = 0
            with open(local, "rb") as src:
                while block := src.read(_COPY_BLOCK):
                    view = memoryview(block)
                    done = 0
                    while done < len(view):
                        done += os.write(fd, view[done:])
                    total += done
            return total

        return self._publish(key, write)

    def get_bytes(self, key: str) -> bytes:
        """Read ``key`` whole."""
        path = self._path(key)
        with self._wrap("read", key):
            return path.read_bytes()

    def get_file(self, key: str, local: Path) -> int:
        """Copy ``key`` to ``local`` via a temp file and an atomic rename."""
        path = self._path(key)
        with self._wrap("read", key):
            local.parent.mkdir(parents=True, exist_ok=True)
            tmp = local.parent / f"{TEMP_PREFIX}{uuid.uuid4().hex}"
            try:
                shutil.copyfile(path, tmp)
                os.replace(tmp, local)
            finally:
                if tmp.exists():
                    tmp.unlink()
            return local.stat().st_size

    def exists(self, key: str) -> bool:
        """Whether ``key`` is a file."""
        path = self._path(key)
        with self._wrap("stat", key):
            return path.is_file()

    def size(self, key: str) -> int:
        """Size of ``key`` in bytes."""
        path = self._path(key)
        with self._wrap("stat", key):
            return path.stat().st_size

    def list_prefix(self, prefix: str) -> list[str]:
        """All files whose key starts with ``prefix`` (temp files excluded), sorted."""
        check_key(prefix, prefix=True)
        # Walk only the deepest directory the prefix names; filter the rest by string.
        head = prefix.rsplit("/", 1)[0] if "/" in prefix else ""
        base = self.root / head if head else self.root
        keys: list[str] = []
        with self._wrap("list", prefix):
            if not base.is_dir():
                return []
            for dirpath, dirnames, filenames in os.walk(base):
                dirnames.sort()
                rel_dir = os.path.relpath(dirpath, self.root)
                for fname in filenames:
                    if fname.startswith(TEMP_PREFIX):
                        continue
                    key = fname if rel_dir == "." else f"{rel_dir}/{fname}".replace(os.sep, "/")
                    if key.startswith(prefix):
                        keys.append(key)
        return sorted(keys)

    def _link_above(self, key: str) -> Path | None:
        """The first symlink among the directories between the root and ``key``, if any."""
        path = self.root
        for part in key.rstrip("/").split("/")[:-1]:
            path = path / part
            if path.is_symlink():
                return path
        return None

    def delete(self, key: str) -> bool:
        """Delete one file; False if it did not exist.

        A symlink in the file's place is unlinked itself (never its target). Under a
        symlinked directory the key names nothing inside the tier: False, nothing touched
        (:meth:`delete_prefix` removes such a link).
        """
        check_key(key)
        path = self.root / key
        with self._wrap("delete", key):
            if self._link_above(key) is not None:
                return False
            try:
                path.unlink()  # unlink() never follows a final symlink
            except FileNotFoundError:
                return False
            _fsync_dir_if_supported(path.parent, gone_ok=True)
            return True

    def delete_prefix(self, prefix: str) -> int:
        """Delete a checkpoint directory's files (marker first), then its empty folders.

        Symlinks are unlinked, never followed: a checkpoint directory that is itself a link
        is removed as a link, and links to directories inside it are removed with the files.
        """
        if not prefix or not prefix.endswith("/"):
            return super().delete_prefix(prefix)  # refuses it
        check_key(prefix, prefix=True)
        base = self.root / prefix.rstrip("/")
        with self._wrap("delete", prefix):
            above = self._link_above(prefix.rstrip("/") + "/x")
            if above is not None and above != base:
                # A symlinked run directory: its checkpoints are not inside this tier.
                logger.warning("%s tier: %s is a symlink; not deleting through it",
                               self.name, above)
                return 0
            if base.is_symlink():
                base.unlink()
                _fsync_dir_if_supported(base.parent, gone_ok=True)
                return 1
        count = super().delete_prefix(prefix)
        with self._wrap("delete", prefix):
            if base.is_dir() and not base.is_symlink():
                # Leftover temp files of dead writers, links to directories (os.walk lists
                # them with the directories and never descends into them), then the now
                # empty folders.
                for dirpath, dirs, files in os.walk(base, topdown=False):
                    for name in dirs:
                        link = os.path.join(dirpath, name)
                        if os.path.islink(link):
                            os.unlink(link)
                            count += 1
                    for fname in files:
                        if fname.startswith(TEMP_PREFIX):
                            os.unlink(os.path.join(dirpath, fname))
                    try:
                        os.rmdir(dirpath)
                    except OSError as exc:
                        if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                            raise
        return count

    def free_bytes(self) -> int:
        """Free bytes on the file system holding the root (or its nearest existing parent)."""
        probe = self.root
        while not probe.exists() and probe != probe.parent:
            probe = probe.parent
        with self._wrap("stat", ""):
            return shutil.disk_usage(probe).free


def _fsync_dir_if_supported(path: Path, *, gone_ok: bool = False) -> None:
    """Flush a directory after a name was created (or, ``gone_ok``, removed) in it."""
    try:
        fsync_dir(path)
    except StorageError as exc:
        if exc.errno in FSYNC_UNSUPPORTED:
            # Some mounts (network, FUSE) cannot fsync a directory at all. The file itself
            # was flushed, so only the new name is less durable there; refusing every write
            # would make such a tier unusable for no gain.
            logger.debug("fsync of directory %s not supported: %s", path, exc)
            return
        if gone_ok and exc.errno == errno.ENOENT:
            # After a removal: a concurrent delete of the whole prefix removed the directory
            # too, so there is no entry left whose removal could be lost.
            return
        raise
