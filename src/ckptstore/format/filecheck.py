"""Checking one file of a checkpoint against its recorded size and crc32c trailer: a regular
file only (a planted symlink or FIFO is a problem, never followed or waited on).

Shared by the regular layout's verifier (:mod:`ckptstore.format.verify`, for the files a
manifest lists besides its arrays) and the DCP layout's (:mod:`ckptstore.format.dcp.verify`).
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from ckptstore.format.codecs import TRAILER, crc32c_update

__all__ = ["check_file", "not_regular"]


def not_regular(path: Path) -> str | None:
    """Why ``path`` is not a plain file (a symlink counts as not), or None when it is one."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return "missing"
    except OSError as exc:
        return f"cannot stat: {exc}"
    if stat.S_ISLNK(mode):
        return "is a symlink"
    return None if stat.S_ISREG(mode) else "is not a regular file"


def check_file(directory: Path, deep: bool, entry: tuple[str, int, int | None]) -> str | None:
    """One problem line for file ``rel`` of ``entry = (rel, nbytes, crc)``, or None when it
    is a regular file of ``nbytes`` bytes whose crc32c body and trailer are ``crc`` (sizes
    only unless ``deep``, or when no crc is recorded)."""
    rel, nbytes, crc = entry
    path = directory / rel
    try:
        if not deep or crc is None:
            # lstat: a symlink planted in the file's place must not pass on its target's size.
            problem = not_regular(path)
            if problem is not None:
                return f"{rel}: {problem}"
            size = os.lstat(path).st_size
            return None if size == nbytes else f"{rel}: is {size} bytes, expected {nbytes}"
        # Non-blocking, no link following: a planted FIFO must not hang verification.
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW)
        with os.fdopen(fd, "rb") as fh:
            if not stat.S_ISREG(os.fstat(fh.fileno()).st_mode):
                return f"{rel}: is not a regular file"
            data = fh.read(nbytes + 1)
    except FileNotFoundError:
        return f"{rel}: missing"
    except OSError as exc:
        return f"{rel}: cannot read: {exc}"
    if len(data) != nbytes:
        return f"{rel}: is {len(data)} bytes, expected {nbytes}"
    got = crc32c_update(memoryview(data)[: -TRAILER.size], 0)
    trailer = TRAILER.unpack(data[-TRAILER.size :])[0]
    if got != trailer or got != crc:
        return f"{rel}: crc32c {got:#010x} differs from the recorded {crc:#010x}"
    return None
