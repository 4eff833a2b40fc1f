"""The hot tier's store marker: ``<hot>/.ckptstore.json`` names the store the tier belongs to.

The catalog records the same store id (:mod:`ckptstore.catalog.identity`); a store whose
catalog and hot tier disagree refuses to open (see :meth:`ckptstore.core.StoreCore.open`). The
marker also records the catalog's URL, password masked, so the refusal can say where the hot
tier's own catalog is. Its name starts with a dot: run names never do, and every scan of the
hot tier skips hidden entries.

The marker is written once: to a temporary file, fsynced, then linked into place (``link``
fails if the name exists), so a reader never sees half a marker and two processes creating a
store at once end up with one.

A marker anywhere below a hot tier's root is another store's (ours is at the root): a
directory holding one is that store's, never this one's to remove (:func:`foreign_marker`).
"""

from __future__ import annotations

import errno
import json
import os
import stat
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from ckptstore.durable import (
    TEMP_PREFIX,
    fsync_dir,
    rename_into_place,
    storage_error,
    write_new_file,
)
from ckptstore.errors import ConfigError, StorageError

__all__ = [
    "MARKER_NAME",
    "StoreMarker",
    "foreign_marker",
    "read_store_marker",
    "write_store_marker",
]

#: File name of the marker at the hot tier's root.
MARKER_NAME = ".ckptstore.json"
_MAX_MARKER_BYTES = 64 * 1024


@dataclass(frozen=True)
class StoreMarker:
    """What a hot tier says about the store it belongs to.

    Attributes:
        store_id: The store's id (a uuid).
        catalog: The store's catalog URL (password masked), if recorded.
    """

    store_id: str
    catalog: str | None = None

    def to_json(self) -> bytes:
        """The marker file's contents."""
        doc = {"store_id": self.store_id, "catalog": self.catalog,
               "written_at": datetime.now(UTC).isoformat()}
        return (json.dumps(doc, indent=1) + "\n").encode()


def read_store_marker(hot: Path) -> StoreMarker | None:
    """The marker of the hot tier at ``hot``, or None if it has none.

    Raises:
        ConfigError: If the marker is not a regular file, too large, or malformed.
        StorageError: If it cannot be read.
    """
    path = hot / MARKER_NAME
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise ConfigError(f"{path} is a symlink; the store marker must be a plain file: "
                              "remove the link") from exc
        raise StorageError(exc.errno or errno.EIO,
                           f"cannot read the store marker {path}: {exc.strerror}") from exc
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ConfigError(f"{path} is not a regular file; remove it")
        data = os.read(fd, _MAX_MARKER_BYTES + 1)
    finally:
        os.close(fd)
    try:
        if len(data) > _MAX_MARKER_BYTES:
            raise ValueError(f"over {_MAX_MARKER_BYTES} bytes")
        doc = json.loads(data)
        if not isinstance(doc, dict):
            raise TypeError("not a JSON object")
        store_id = str(uuid.UUID(doc["store_id"]))
        catalog = doc.get("catalog")
        if catalog is not None and not isinstance(catalog, str):
            raise TypeError("catalog")
    except (ValueError, TypeError, KeyError) as exc:
        raise ConfigError(
            f"the store marker {path} is malformed ({type(exc).__name__}: {exc}); it names the "
            "store this hot tier belongs to: restore it, or delete it to let the store adopt "
            "this hot tier again"
        ) from None
    return StoreMarker(store_id, catalog)


def write_store_marker(hot: Path, marker: StoreMarker) -> StoreMarker:
    """Write the marker unless the hot tier has one already.

    Returns:
        The marker now in place: ``marker``, or the one found there.

    The hot tier's directory is created if it does not exist yet.

    Raises:
        ConfigError: If a marker there is malformed.
        StorageError: If the marker (or the directory) cannot be written.
    """
    path = hot / MARKER_NAME
    tmp = hot / f"{TEMP_PREFIX}{uuid.uuid4().hex}"
    try:
        try:
            hot.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise storage_error(hot, "create the hot tier directory", exc) from exc
        write_new_file(tmp, marker.to_json())
        try:
            # Link, not rename: the name is claimed only if no other process claimed it.
            os.link(tmp, path)
        except FileExistsError:
            found = read_store_marker(hot)
            assert found is not None
            return found
        except OSError as exc:
            if exc.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV):
                raise storage_error(path, "write the store marker", exc) from exc
            # No hard links on this file system (some FUSE/SMB mounts): check, then rename.
            found = read_store_marker(hot)
            if found is not None:
                return found
            rename_into_place(tmp, path)
            return marker
        fsync_dir(hot)
        return marker
    finally:
        tmp.unlink(missing_ok=True)


def foreign_marker(directory: Path, root: Path) -> Path | None:
    """Another store's marker in ``directory`` (at any depth) or in a directory between
    ``root`` (excluded: this store's own marker is there) and ``directory``, or None.

    What must be true before anything under ``root`` removes ``directory``: a store rooted
    inside this one's tier (or this tier inside it) owns the files there. Links are not
    followed (what a link points at is not removed through it either).
    """
    directory, root = Path(directory), Path(root)
    for parent in directory.parents:
        if parent == root or root not in parent.parents:
            break
        if os.path.lexists(parent / MARKER_NAME):
            return parent / MARKER_NAME
    for dirpath, _dirs, files in os.walk(directory):
        if MARKER_NAME in files:
            return Path(dirpath) / MARKER_NAME
    return None
