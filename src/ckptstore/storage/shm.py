"""The shared-memory area of a store's memory tier: directories, locking, inventory, space.

Pure file-system mechanics under ``<base>/<area id>/<run>/<checkpoint id>/`` on a
shared-memory file system (``/dev/shm`` by default): where a copy lives, how its replica URI
is written and parsed, which copies exist and how much they take, how much room is left, and
how a copy is removed (commit marker first, so a half-deleted copy is never read). Which
copies the catalog still wants, staging and eviction decisions live in the memory tier
operation (:mod:`ckptstore.ops.writing.memory`).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import shutil
import urllib.parse
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from ckptstore.errors import StorageError
from ckptstore.format.constants import COMMIT_NAME
from ckptstore.identity import pid_alive
from ckptstore.numeric import decimal_or_none

__all__ = [
    "DEFAULT_MEMORY_ROOT",
    "MemoryCopy",
    "MemoryLocation",
    "SharedMemoryArea",
    "parse_memory_uri",
    "dir_bytes",
    "remove_copy",
]

#: Where stores keep their memory tiers unless ``memory_tier_dir`` says otherwise.
DEFAULT_MEMORY_ROOT = Path("/dev/shm/ckptstore")

_SCHEME = "shm"
_STAGING_PREFIX = ".staging-"
_LOCK_NAME = ".lock"


@dataclass(frozen=True)
class MemoryLocation:
    """Where a memory replica lives, parsed from its catalog URI.

    Attributes:
        host: Host name of the machine whose shared memory holds the copy.
        path: The copy's directory on that host.
        digest: blake3 digest of the copy's own ``manifest.json``.
    """

    host: str
    path: Path
    digest: str

    def uri(self) -> str:
        """The catalog URI: ``shm://<host><path>?digest=<digest>``."""
        return urllib.parse.urlunsplit(
            (_SCHEME, self.host, urllib.parse.quote(str(self.path)), f"digest={self.digest}", "")
        )


def parse_memory_uri(uri: str) -> MemoryLocation | None:
    """Parse a memory replica URI; None when it is not one (or is malformed)."""
    try:
        parts = urllib.parse.urlsplit(uri)
    except ValueError:
        return None
    if parts.scheme != _SCHEME or not parts.netloc or not parts.path.startswith("/"):
        return None
    digest = urllib.parse.parse_qs(parts.query).get("digest", [""])[0]
    if len(digest) != 64:
        return None
    return MemoryLocation(parts.netloc, Path(urllib.parse.unquote(parts.path)), digest)


@dataclass(frozen=True)
class MemoryCopy:
    """One committed copy in a memory area.

    Attributes:
        checkpoint_id: The checkpoint.
        run: Its run.
        path: Its directory.
        bytes: Bytes it occupies.
        staged_at: When it was staged (the commit marker's mtime, epoch seconds).
    """

    checkpoint_id: str
    run: str
    path: Path
    bytes: int
    staged_at: float


def dir_bytes(path: Path) -> int:
    """Bytes of every file under ``path`` (files removed meanwhile count as 0)."""
    total = 0
    for dirpath, _dirs, names in os.walk(path):
        for name in names:
            with contextlib.suppress(OSError):  # a concurrent eviction removed it
                total += os.lstat(os.path.join(dirpath, name)).st_size
    return total


def remove_copy(path: Path) -> None:
    """Delete a copy: the commit marker first, so a half-deleted copy is never loaded."""
    with contextlib.suppress(FileNotFoundError):
        (path / COMMIT_NAME).unlink()
    shutil.rmtree(path, ignore_errors=True)


class SharedMemoryArea:
    """One store's directory on a shared-memory file system.

    Call order: create (nothing is written) → :meth:`locked` around every change (staging,
    eviction, sweeping; an exclusive ``flock``, so processes of one host take turns) →
    :meth:`copies` / :meth:`usage` / :meth:`free_bytes` to decide, :meth:`remove_copy` to
    delete. Readers take no lock: a copy removed under a reader makes its read fail.

    Attributes:
        base: Parent directory shared by every store's area (``/dev/shm/ckptstore``).
        root: This store's area: ``<base>/<area id>``.
    """

    def __init__(self, base: Path, area_id: str) -> None:
        """Name the area ``<base>/<area_id>`` (nothing is created yet)."""
        self.base = base
        self.root = base / area_id

    def path_for(self, run: str, ckpt_id: str) -> Path:
        """Directory of a checkpoint's copy in this area."""
        return self.root / run / ckpt_id

    def staging_path(self, run: str, ckpt_id: str) -> Path:
        """Where this process writes a copy before renaming it into place."""
        return self.root / run / f"{_STAGING_PREFIX}{ckpt_id}-{os.getpid()}"

    def owns(self, path: Path) -> bool:
        """Whether ``path`` is a checkpoint directory inside this area (safe to delete)."""
        try:
            rel = Path(os.path.abspath(path)).relative_to(os.path.abspath(self.root))
        except ValueError:
            return False
        return len(rel.parts) == 2 and not any(p.startswith(".") for p in rel.parts)

    def ensure_root(self) -> None:
        """Create the area (and the shared base, sticky and world-writable like /tmp).

        Raises:
            StorageError: If the shared-memory file system cannot be written.
        """
        try:
            if not self.base.exists():
                self.base.mkdir(parents=True, exist_ok=True)
                # Shared by every user's stores, like /tmp: sticky and world-writable.
                with contextlib.suppress(OSError):
                    self.base.chmod(0o1777)
            self.root.mkdir(mode=0o700, exist_ok=True)
        except OSError as exc:
            raise StorageError(
                exc.errno or errno.EIO,
                f"cannot create the memory tier directory {self.root}: {exc.strerror}; "
                "check that the shared-memory file system is mounted and writable, or set "
                "memory_tier_dir",
            ) from exc

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        """Hold the area's exclusive lock (creates the area first)."""
        self.ensure_root()
        fd = os.open(self.root / _LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # closing releases the lock

    def copies(self) -> list[MemoryCopy]:
        """Committed copies in this area, oldest first."""
        found: list[MemoryCopy] = []
        if not self.root.is_dir():
            return found
        for run_dir in self.root.iterdir():
            if not run_dir.is_dir() or run_dir.name.startswith("."):
                continue
            for ck_dir in run_dir.iterdir():
                if ck_dir.name.startswith("."):
                    continue
                try:
                    staged_at = (ck_dir / COMMIT_NAME).stat().st_mtime
                except OSError:
                    continue
                found.append(
                    MemoryCopy(ck_dir.name, run_dir.name, ck_dir, dir_bytes(ck_dir), staged_at)
                )
        found.sort(key=lambda c: (c.staged_at, c.checkpoint_id))
        return found

    def entries(self) -> Iterator[tuple[Path, bool]]:
        """Every ``<run>/<entry>`` directory: ``(path, is a dead process's staging dir)``.

        Live staging directories of other processes are skipped; so are hidden names.
        """
        if not self.root.is_dir():
            return
        for run_dir in list(self.root.iterdir()):
            if not run_dir.is_dir() or run_dir.name.startswith("."):
                continue
            for ck_dir in list(run_dir.iterdir()):
                if ck_dir.name.startswith(_STAGING_PREFIX):
                    pid = decimal_or_none(ck_dir.name.rsplit("-", 1)[-1])
                    if pid is not None and pid > 0 and not pid_alive(pid):
                        yield ck_dir, True
                    continue
                if not ck_dir.name.startswith("."):
                    yield ck_dir, False

    def prune_empty_runs(self) -> None:
        """Remove run directories left empty."""
        if not self.root.is_dir():
            return
        for run_dir in list(self.root.iterdir()):
            if run_dir.is_dir() and not run_dir.name.startswith("."):
                with contextlib.suppress(OSError):
                    run_dir.rmdir()  # only succeeds when empty

    def usage(self) -> int:
        """Bytes the area occupies now (copies and unfinished staging directories)."""
        return dir_bytes(self.root) if self.root.is_dir() else 0

    def free_bytes(self) -> int | None:
        """Free space on the shared-memory file system, or None if unknown."""
        try:
            st = os.statvfs(self.root if self.root.exists() else self.base.parent)
        except OSError:
            return None
        return st.f_bavail * st.f_frsize
