"""A tier that remembers what one operation wrote, so a failure removes exactly that.

Cleaning up after a failed copy by listing the destination prefix and deleting what is there
trusts that nothing else lives under that prefix. When it is not so (another store's files,
a copy a dead attempt left, a destination that turns out to be the source itself), such a
clean-up destroys data the operation never wrote. :class:`WriteLog` wraps the destination
tier for one operation: every key it creates is recorded (with, on a local tier, every
directory the write had to create), and :meth:`WriteLog.undo` deletes those keys, marker
first, then those directories when they are empty, and nothing else.
"""

from __future__ import annotations

import errno
import logging
import os
import threading
from collections.abc import Callable, Iterable
from pathlib import Path

from ckptstore.storage.base import COMMIT_NAME, Tier
from ckptstore.storage.local import LocalTier

__all__ = ["WriteLog"]

logger = logging.getLogger(__name__)


class WriteLog(Tier):
    """``tier`` for one operation, recording every key it writes (thread-safe).

    Call order: pass the log where the destination tier goes; on failure call :meth:`undo`
    (it removes what was written and is idempotent); on success drop it. Reads, listings and
    deletes go straight to the wrapped tier.
    """

    def __init__(self, tier: Tier) -> None:
        """Wrap ``tier``; nothing is recorded yet."""
        super().__init__(tier.name)
        self.tier = tier
        self._lock = threading.Lock()
        self._keys: set[str] = set()
        self._dirs: set[Path] = set()
        self._root = tier.root if isinstance(tier, LocalTier) else None

    # ------------------------------------------------------------------ recording
    @property
    def written(self) -> set[str]:
        """The keys this operation created (a copy)."""
        with self._lock:
            return set(self._keys)

    def _missing_dirs(self, key: str) -> list[Path]:
        """The directories between the tier's root and ``key`` that do not exist yet."""
        if self._root is None:
            return []
        missing: list[Path] = []
        path = (self._root / key).parent
        while path != self._root and self._root in path.parents and not path.exists():
            missing.append(path)
            path = path.parent
        return missing

    def _record(self, key: str, dirs: list[Path]) -> None:
        with self._lock:
            self._keys.add(key)
            self._dirs.update(dirs)

    def _recorded(self, key: str, write: Callable[[], int]) -> int:
        dirs = self._missing_dirs(key)
        try:
            written = write()
        except BaseException:
            self._forget_dirs(dirs)
            raise
        self._record(key, dirs)
        return written

    def put_bytes(self, key: str, data: bytes) -> int:
        """As the wrapped tier's; the key (and the directories it created) are recorded."""
        return self._recorded(key, lambda: self.tier.put_bytes(key, data))

    def put_file(self, local: Path, key: str) -> int:
        """As the wrapped tier's; the key (and the directories it created) are recorded."""
        return self._recorded(key, lambda: self.tier.put_file(local, key))

    def _forget_dirs(self, dirs: list[Path]) -> None:
        # A failed write may still have created its directories: remove them with the rest.
        with self._lock:
            self._dirs.update(d for d in dirs if d.is_dir())

    def undo(self) -> int:
        """Delete every key this operation wrote (markers first), then the directories its
        writes created, deepest first, if they are empty; best effort per key.

        Returns:
            The number of keys deleted.
        """
        with self._lock:
            keys, dirs = sorted(self._keys), sorted(self._dirs, key=lambda p: -len(p.parts))
            self._keys.clear()
            self._dirs.clear()
        markers = [k for k in keys if k.rsplit("/", 1)[-1] == COMMIT_NAME]
        rest = [k for k in keys if k.rsplit("/", 1)[-1] != COMMIT_NAME]
        count = self.tier.delete_keys(markers)
        count += self.tier.delete_keys(rest)
        for directory in dirs:
            try:
                os.rmdir(directory)
            except FileNotFoundError:
                pass
            except OSError as exc:
                if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                    logger.warning("could not remove directory %s (%s)", directory, exc)
        return count

    # ------------------------------------------------------------------ delegated
    @property
    def url(self) -> str:
        """The wrapped tier's."""
        return self.tier.url

    @property
    def readable(self) -> bool:
        """The wrapped tier's."""
        return self.tier.readable

    def prefix_for(self, run: str, ckpt_id: str) -> str:
        """The wrapped tier's."""
        return self.tier.prefix_for(run, ckpt_id)

    def key_for(self, run: str, ckpt_id: str, rel: str) -> str:
        """The wrapped tier's."""
        return self.tier.key_for(run, ckpt_id, rel)

    def uri_for(self, run: str, ckpt_id: str) -> str:
        """The wrapped tier's."""
        return self.tier.uri_for(run, ckpt_id)

    def get_file(self, key: str, local: Path) -> int:
        """The wrapped tier's."""
        return self.tier.get_file(key, local)

    def get_bytes(self, key: str) -> bytes:
        """The wrapped tier's."""
        return self.tier.get_bytes(key)

    def exists(self, key: str) -> bool:
        """The wrapped tier's."""
        return self.tier.exists(key)

    def size(self, key: str) -> int:
        """The wrapped tier's."""
        return self.tier.size(key)

    def list_prefix(self, prefix: str) -> list[str]:
        """The wrapped tier's."""
        return self.tier.list_prefix(prefix)

    def delete(self, key: str) -> bool:
        """The wrapped tier's; a deleted key is no longer this operation's."""
        with self._lock:
            self._keys.discard(key)
        return self.tier.delete(key)

    def delete_keys(self, keys: Iterable[str]) -> int:
        """The wrapped tier's (one :meth:`delete` per key)."""
        return sum(1 for k in keys if self.delete(k))

    def local_dir(self, run: str, ckpt_id: str) -> Path | None:
        """The wrapped tier's."""
        return self.tier.local_dir(run, ckpt_id)

    def free_bytes(self) -> int | None:
        """The wrapped tier's."""
        return self.tier.free_bytes()

    def abort_multipart_uploads(self, prefix: str) -> int:
        """The wrapped tier's."""
        return self.tier.abort_multipart_uploads(prefix)
