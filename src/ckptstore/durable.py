"""Durable file writes: the one place that creates, flushes and publishes files for keeps.

Everything ckptstore writes to stay (chunk files, zarr metadata, manifests, commit markers,
signatures, key pairs, bundles, converted checkpoints, local tier objects) reaches stable
storage through the primitives here, so "written" means the same thing everywhere:

* :func:`write_new_file`: exclusive create (never overwrites, never follows a link), write,
  fsync the file. The caller fsyncs the directory once it has created all its names.
* :func:`replace_file`: temporary file in the same directory, fsync, rename over the
  target, fsync the directory: a reader sees the old content or the new, never a mix.
* :func:`rename_into_place`: the same publication for a file another library produced
  under a temporary name (``torch.save``, ``tarfile``).
* :func:`fsync_file`, :func:`fsync_fd`, :func:`fsync_dir`, :func:`fsync_tree`: flushes;
  :func:`fsync_many` flushes many files and directories at once (a checkpoint's hundreds
  of ``zarr.json`` documents and directories).

Every failure raises :class:`~ckptstore.errors.StorageError` (an ``OSError``: ``errno`` and
``filename`` are kept and the cause is chained) naming the path, what failed and, for the
errors a user can fix, what to do. Nothing here swallows an error: a caller that may go on
without durability (a best-effort cleanup, a file system that refuses to fsync directories)
catches the error itself and says why at the call site.
"""

from __future__ import annotations

import errno
import logging
import os
import uuid
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from ckptstore.errors import StorageError

__all__ = [
    "FLUSH_THREADS",
    "FSYNC_UNSUPPORTED",
    "TEMP_PREFIX",
    "fsync_dir",
    "fsync_fd",
    "fsync_file",
    "fsync_many",
    "fsync_tree",
    "rename_into_place",
    "replace_file",
    "storage_error",
    "write_new_file",
]

logger = logging.getLogger(__name__)

#: Name prefix of the temporary files :func:`replace_file` and the local tier publish from.
#: Listings skip such names and ``ckpt doctor`` reports old ones as debris of killed writes.
TEMP_PREFIX = ".ckpt-tmp-"

#: errno values with which a file system says it cannot fsync a directory at all (some
#: network and FUSE mounts), as opposed to failing to. Callers that accept weaker
#: durability of new names on such mounts test ``exc.errno`` against this set.
FSYNC_UNSUPPORTED = frozenset({errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP})

#: Flushes :func:`fsync_many` has in flight at once. A flush waits on the device, not on the
#: CPU (the GIL is released), and the file system commits the journal once for all the
#: flushes waiting together: one after the other, 150 small files took ~0.6 s on the
#: reference machine's disk (~4 ms each), about the time of writing 300 MB of chunks.
FLUSH_THREADS = 16

_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_O_DIRECTORY = getattr(os, "O_DIRECTORY", 0)
_O_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)


def storage_error(path: Path | str, action: str, exc: OSError) -> StorageError:
    """Build the StorageError for an OSError hit while ``action``-ing ``path``.

    The message names the path and, for the errors a user can fix, what to do; ``errno``
    and ``filename`` are set. The caller chains ``exc`` (``raise ... from exc``).

    Args:
        path: The file or directory the operation was on.
        action: What was being done, as a verb phrase (``"write"``, ``"fsync directory"``).
        exc: The error the operating system raised.
    """
    hint = ""
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        hint = ": disk full: free space or prune old checkpoints"
    elif exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        hint = ": permission denied: check the store directory's owner and mode"
    elif exc.errno == errno.EEXIST:
        hint = ": file exists: checkpoint directories are written once, use a new directory"
    elif exc.errno == errno.EIO:
        hint = ": the device reported an I/O error: check the disk before retrying"
    err = StorageError(exc.errno or 0, f"cannot {action} {path}{hint} ({exc.strerror or exc})")
    err.filename = str(path)
    return err


def fsync_fd(fd: int, path: Path | str) -> None:
    """Flush an open file to stable storage.

    Args:
        fd: The open file descriptor.
        path: The file's path (only to name it in the error).

    Raises:
        StorageError: If the flush fails.
    """
    try:
        os.fsync(fd)
    except OSError as exc:
        raise storage_error(path, "fsync", exc) from exc


def fsync_file(path: Path | str) -> None:
    """Flush a file that was written (and possibly closed) earlier to stable storage.

    Raises:
        StorageError: If the file cannot be opened or flushed.
    """
    try:
        fd = os.open(path, os.O_RDONLY | _O_CLOEXEC)
    except OSError as exc:
        raise storage_error(path, "open for fsync", exc) from exc
    try:
        fsync_fd(fd, path)
    finally:
        os.close(fd)


def fsync_dir(path: Path | str) -> None:
    """Flush a directory's entries (the names created or removed in it) to stable storage.

    Raises:
        StorageError: If the directory cannot be opened (missing, not a directory) or
            flushed; ``errno`` in :data:`FSYNC_UNSUPPORTED` means the file system refuses
            directory flushes altogether.
    """
    try:
        fd = os.open(path, os.O_RDONLY | _O_DIRECTORY | _O_CLOEXEC)
    except OSError as exc:
        raise storage_error(path, "open directory for fsync", exc) from exc
    try:
        os.fsync(fd)
    except OSError as exc:
        raise storage_error(path, "fsync directory", exc) from exc
    finally:
        os.close(fd)


def fsync_many(files: Iterable[Path | str], dirs: Iterable[Path | str] = (), *,
               threads: int = FLUSH_THREADS) -> None:
    """Flush ``files`` and the entries of ``dirs``, up to ``threads`` flushes at a time.

    Returns once every one of them is on stable storage; the order among them is not
    defined, so whatever must follow all of them (a commit marker) is written after.

    Raises:
        StorageError: If a flush failed (raised once all the others have finished).
    """
    jobs = [(fsync_file, p) for p in files] + [(fsync_dir, p) for p in dirs]
    if len(jobs) <= 1 or threads <= 1:
        for flush, path in jobs:
            flush(path)
        return
    with ThreadPoolExecutor(min(threads, len(jobs)), thread_name_prefix="ckpt-flush") as pool:
        for _ in pool.map(lambda job: job[0](job[1]), jobs):
            pass


def fsync_tree(directory: Path | str) -> None:
    """Flush ``directory`` and every directory below it, deepest first.

    Files are not flushed: whoever wrote a file flushed it (:func:`write_new_file`); this
    makes the names of a freshly extracted or copied tree durable.

    Raises:
        StorageError: If a directory cannot be listed, opened or flushed.
    """

    def fail(exc: OSError) -> None:
        raise storage_error(exc.filename or directory, "list directory", exc) from exc

    for dirpath, _dirs, _files in os.walk(directory, topdown=False, onerror=fail):
        fsync_dir(dirpath)


def _write_all(fd: int, data: bytes | bytearray | memoryview) -> None:
    # writev, not write: one syscall for the whole buffer, and the same call the chunk
    # writers use (format/fsio.py), so fault injection on writev covers every durable file.
    view = memoryview(data).cast("B")
    while view.nbytes:
        written = os.writev(fd, [view])
        if written <= 0:
            raise OSError(errno.EIO, "writev wrote nothing")
        view = view[written:]


def write_new_file(path: Path | str, data: bytes | bytearray | memoryview, *,
                   mode: int = 0o644, sync: bool = True) -> None:
    """Create ``path`` (it must not exist), write ``data`` and fsync the file.

    The create is exclusive and does not follow a link planted under the name. The
    directory is not flushed: a writer creating many names flushes it once, after the last.
    A failed write may leave a partial file under ``path``; a later call then fails with
    ``EEXIST`` rather than trust it.

    Args:
        path: The new file.
        data: Its whole content.
        mode: Permission bits of the new file (before the umask).
        sync: False leaves the flush to the caller, who writes many files and flushes
            them together with :func:`fsync_many` before anything refers to them.

    Raises:
        StorageError: If the file exists or cannot be created, written or flushed.
    """
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _O_NOFOLLOW | _O_CLOEXEC,
                     mode)
    except OSError as exc:
        raise storage_error(path, "create", exc) from exc
    try:
        try:
            _write_all(fd, data)
        except OSError as exc:
            raise storage_error(path, "write", exc) from exc
        if sync:
            fsync_fd(fd, path)
    finally:
        os.close(fd)


def rename_into_place(tmp: Path | str, path: Path | str) -> None:
    """Publish a finished temporary file under its final name, durably.

    ``tmp`` is flushed, renamed over ``path`` (replacing it atomically if it exists) and the
    directory is flushed, so after a crash ``path`` holds the old content or the new.
    ``tmp`` must be in the same directory as ``path``. On failure ``tmp`` is left for the
    caller to remove.

    Raises:
        StorageError: If the flushes or the rename fail.
    """
    fsync_file(tmp)
    try:
        os.replace(tmp, path)
    except OSError as exc:
        raise storage_error(path, f"rename {tmp} to", exc) from exc
    fsync_dir(Path(path).parent)


def replace_file(path: Path | str, data: bytes | bytearray | memoryview, *,
                 mode: int = 0o644) -> None:
    """Write ``path`` atomically and durably, replacing what it held.

    The content goes to a new temporary file (:data:`TEMP_PREFIX`) in the same directory,
    is flushed, renamed over ``path`` and the directory flushed: readers and crashes see the
    old content or the new, never a mix. A link at ``path`` is replaced, not followed.

    Args:
        path: The file to (re)write.
        data: Its new content.
        mode: Permission bits of the new file (before the umask).

    Raises:
        StorageError: If any step fails. A failure before the rename leaves ``path`` with
            its old content; only the final directory flush can fail after it.
    """
    path = Path(path)
    tmp = path.parent / f"{TEMP_PREFIX}{uuid.uuid4().hex}"
    try:
        write_new_file(tmp, data, mode=mode)
        rename_into_place(tmp, path)
    except BaseException:
        try:
            tmp.unlink(missing_ok=True)
        except OSError as exc:
            # The original error is what the caller must see; a leftover temp file is only
            # debris, which `ckpt doctor` reports and removes.
            logger.warning("cannot remove temporary file %s: %s", tmp, exc)
        raise
