"""Reading a tar file treated as hostile: bounded headers, safe names, regular files only.

Python's ``tarfile`` reads a PAX extended header or a GNU long name whole, at whatever size
its header declares, and follows sparse maps of any length. :class:`HostileTarFile` refuses
extended headers over a few KiB, chains of them, global headers beyond a small total and
every sparse format *before* ``tarfile`` allocates anything for them (a 2 MB ``.tar.gz``
could otherwise inflate a 512 MiB header). :func:`scan_members` then lists the members,
refusing absolute paths, ``..``, backslashes, control characters, duplicates, anything but
regular files (links, devices, FIFOs) and more members than allowed; :func:`read_member`
reads one member with a size bound and :func:`bounded_json` parses JSON with a bound on its
values. Nothing here writes: extracting is the caller's (never ``tarfile.extract``).

The bundle format (:mod:`ckptstore.ops.sharing.bundle`) is the one user; every message
names the archive as the caller calls it (``what``, e.g. ``"bundle"``).
"""

from __future__ import annotations

import json
import os
import tarfile
from collections.abc import Callable
from pathlib import PurePosixPath
from typing import Any

from ckptstore.errors import IntegrityError, InvalidNameError
from ckptstore.numeric import float_or_none, is_decimal

__all__ = [
    "MAX_JSON_ITEMS",
    "HostileTarFile",
    "bounded_json",
    "open_hostile",
    "read_member",
    "safe_member_name",
    "scan_members",
]

#: A JSON document costs ~100 bytes of Python objects per value: bound the values before
#: json.loads builds them, so a small hostile document cannot take gigabytes.
MAX_JSON_ITEMS = 4_000_000
# Extended tar headers, bounded before tarfile reads them (it reads each one whole). Our
# bundle exporter writes at most one small PAX header per member (a name over 100
# characters); GNU tar writes a long-name header, and git-style tools a small global one.
_MAX_PAX_HEADER = 64 * 1024  # one PAX extended header
_MAX_LONG_NAME = 4096  # one GNU long name or long link (member names are at most 1024)
_MAX_HEADER_CHAIN = 8  # extended headers in front of one member
_MAX_GLOBAL_HEADERS = 64 * 1024  # all PAX global headers together (they accumulate)
# All extended headers of the archive together: what they carry (long names) stays in memory
# with every member until the reader ends. 8 MiB is ~30,000 names of 250 characters.
_MAX_EXTENDED_TOTAL = 8 * 1024 * 1024
_MAX_NAME = 1024


class HostileTarFile(tarfile.TarFile):
    """A read-only ``TarFile`` that counts what its extended headers cost (see the module).

    Open it with :func:`open_hostile`; ``what`` names the archive in messages.
    """

    def __init__(self, *args: Any, what: str = "tar file", **kwargs: Any) -> None:
        # Set before TarFile.__init__, which already reads the first member.
        self.what = what
        self.header_chain = 0
        self.global_header_bytes = 0
        self.extended_bytes = 0
        kwargs["tarinfo"] = _BoundedTarInfo
        super().__init__(*args, **kwargs)


class _BoundedTarInfo(tarfile.TarInfo):
    """``TarInfo`` that checks an extended header's declared size before it is read.

    ``TarInfo._proc_member`` is tarfile's documented extension point ("can be overridden in a
    subclass"); it runs once per header block, before ``_proc_pax``/``_proc_gnulong`` read the
    header's payload with a single ``read(size)``.
    """

    def _proc_member(self, tar: HostileTarFile) -> tarfile.TarInfo:  # type: ignore[override]
        size, what = self.size, tar.what
        if self.type == tarfile.GNUTYPE_SPARSE:
            raise IntegrityError(f"{what} member {self.name!r} is a sparse file; refusing it")
        if self.type in (tarfile.GNUTYPE_LONGNAME, tarfile.GNUTYPE_LONGLINK):
            if size > _MAX_LONG_NAME:
                raise InvalidNameError(
                    f"the {what} declares a {size}-byte GNU long name; member names are at "
                    f"most {_MAX_LONG_NAME} bytes, refusing the {what}"
                )
        elif self.type in (tarfile.XHDTYPE, tarfile.XGLTYPE, tarfile.SOLARIS_XHDTYPE):
            if size > _MAX_PAX_HEADER:
                raise IntegrityError(
                    f"the {what} declares a {size}-byte PAX extended header (at most "
                    f"{_MAX_PAX_HEADER} are allowed); refusing the {what}"
                )
            if self.type == tarfile.XGLTYPE:
                # Global headers stay in memory for the rest of the archive.
                tar.global_header_bytes += size
                if tar.global_header_bytes > _MAX_GLOBAL_HEADERS:
                    raise IntegrityError(
                        f"the {what}'s PAX global headers exceed {_MAX_GLOBAL_HEADERS} "
                        f"bytes; refusing the {what}"
                    )
        else:
            return super()._proc_member(tar)  # type: ignore[misc, no-any-return]
        tar.extended_bytes += size
        if tar.extended_bytes > _MAX_EXTENDED_TOTAL:
            raise IntegrityError(
                f"the {what}'s extended tar headers exceed {_MAX_EXTENDED_TOTAL} bytes in "
                f"total; refusing the {what}"
            )
        # An extended header applies to the next header, which tarfile reads recursively:
        # bound the chain (memory held per member, and the recursion depth).
        tar.header_chain += 1
        try:
            if tar.header_chain > _MAX_HEADER_CHAIN:
                raise IntegrityError(
                    f"the {what} has more than {_MAX_HEADER_CHAIN} extended headers in "
                    f"front of one member; refusing the {what}"
                )
            return super()._proc_member(tar)  # type: ignore[misc, no-any-return]
        finally:
            tar.header_chain -= 1

    def _apply_pax_info(self, pax_headers: dict[str, str], encoding: str,
                        errors: str) -> None:
        # tarfile converts these with int()/float(), which read non-ASCII digits, and turns
        # a value it cannot read into 0: a member's size must be plain ASCII digits.
        for key, value in pax_headers.items():
            if key in ("size", "uid", "gid") and not is_decimal(value):
                raise IntegrityError(f"a PAX header sets {key} to {value[:40]!r}, not a "
                                     "decimal number; refusing the archive")
            if key in ("mtime", "atime", "ctime") and float_or_none(value) is None:
                raise IntegrityError(f"a PAX header sets {key} to {value[:40]!r}, not a "
                                     "number; refusing the archive")
        super()._apply_pax_info(pax_headers, encoding, errors)  # type: ignore[misc]

    # PAX-encoded GNU sparse maps: version 1.0 is read from the member's data, number by
    # number, without bound. Our archives never hold sparse files, so none is even parsed.
    def _sparse(self, *_args: Any) -> None:
        raise IntegrityError("the archive holds a sparse file (GNU sparse PAX headers); "
                             "only regular files are accepted, refusing it")

    _proc_gnusparse_00 = _proc_gnusparse_01 = _proc_gnusparse_10 = _sparse


def open_hostile(path: str | os.PathLike[str], what: str) -> HostileTarFile:
    """Open the tar (optionally compressed) at ``path`` for reading, as hostile input.

    Raises:
        tarfile.TarError: If it is not a tar; IntegrityError / InvalidNameError if its first
            header breaks a bound.
    """
    # TarFile.open hands extra keyword arguments to the class; typeshed does not say so.
    return HostileTarFile.open(path, "r:*", what=what)  # type: ignore[call-overload, no-any-return]


def safe_member_name(info: tarfile.TarInfo, what: str) -> str:
    """The member's path, or InvalidNameError if it is absolute, climbs out or is odd."""
    name = info.name
    bad = (
        not name
        or name.startswith("/")
        or "\\" in name
        or "\x00" in name
        or any(ord(ch) < 32 for ch in name)
        or len(name) > _MAX_NAME
    )
    if bad or any(p in ("..", ".", "") for p in name.split("/")) \
            or not PurePosixPath(name).parts:
        raise InvalidNameError(
            f"{what} member {name!r} has an unsafe path (absolute, '..', backslash or control "
            f"characters); refusing the {what}"
        )
    return name


def _check_regular(info: tarfile.TarInfo, what: str) -> None:
    if info.type not in (tarfile.REGTYPE, tarfile.AREGTYPE):
        kind = ("link" if info.issym() or info.islnk() else
                "device" if info.isdev() else "directory" if info.isdir() else
                "FIFO" if info.isfifo() else f"type {info.type!r}")
        raise IntegrityError(
            f"{what} member {info.name!r} is a {kind}; a {what} holds regular files only, "
            f"refusing the {what}"
        )
    if info.sparse is not None:  # type: ignore[attr-defined]
        raise IntegrityError(f"{what} member {info.name!r} is a sparse file; refusing it")


def scan_members(tar: HostileTarFile, max_members: int,
                 check_name: Callable[[str], None] | None = None) -> dict[str, tarfile.TarInfo]:
    """Every member by name, after the checks of the module docstring.

    Args:
        tar: The open archive.
        max_members: Refuse archives with more members.
        check_name: Further checks of each (already safe) name; raises to refuse it.

    Raises:
        InvalidNameError: For an unsafe name.
        IntegrityError: For too many members, a duplicate, or a member that is not a
            regular file.
    """
    members: dict[str, tarfile.TarInfo] = {}
    count = 0
    while True:
        info = tar.next()
        if info is None:
            return members
        count += 1
        if count > max_members:
            raise IntegrityError(f"the {tar.what} has more than {max_members} members; "
                                 "refusing it")
        name = safe_member_name(info, tar.what)
        if check_name is not None:
            check_name(name)
        _check_regular(info, tar.what)
        if name in members:
            raise IntegrityError(f"{tar.what} member {name!r} appears twice; refusing the "
                                 f"{tar.what}")
        members[name] = info


def read_member(tar: HostileTarFile, info: tarfile.TarInfo, limit: int) -> bytes:
    """One member's bytes, refusing a member over ``limit`` bytes or shorter than declared.

    Raises:
        IntegrityError: If the member is too large, unreadable or truncated.
    """
    what = tar.what
    if info.size > limit:
        raise IntegrityError(
            f"{what} member {info.name!r} is {info.size} bytes, over the {limit} bytes such a "
            f"file may have; refusing the {what}"
        )
    handle = tar.extractfile(info)
    if handle is None:
        raise IntegrityError(f"{what} member {info.name!r} cannot be read")
    with handle:
        data = handle.read(limit + 1)
    if len(data) != info.size:
        raise IntegrityError(f"{what} member {info.name!r} is truncated")
    return data


def bounded_json(data: bytes, what: str, max_items: int = MAX_JSON_ITEMS) -> Any:
    """Parse JSON after counting its values (``,``, ``{``, ``[``) against ``max_items``.

    Raises:
        IntegrityError: If it holds too many values, nests too deeply or is not JSON.
    """
    items = data.count(b",") + data.count(b"{") + data.count(b"[")
    if items > max_items:
        raise IntegrityError(
            f"{what} holds over {max_items} JSON values ({items}); refusing to parse it"
        )
    try:
        return json.loads(data)
    except RecursionError:
        raise IntegrityError(f"{what} is nested too deeply") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise IntegrityError(f"{what} is not valid JSON: {exc}") from None
