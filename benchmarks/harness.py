"""Measurement helpers shared by the benchmarks: durability, page-cache eviction, peak memory,
disk usage and the "median (min-max)" summaries.

Everything here is Linux-specific where the kernel offers the right tool (``posix_fadvise``,
``mincore``, ``/proc/self/clear_refs``) and degrades to "not available" elsewhere instead of
reporting a wrong number.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import logging
import mmap
import os
import statistics
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "PeakMemory",
    "Summary",
    "can_evict",
    "dir_usage",
    "evict",
    "fmt_bytes",
    "fmt_summary",
    "fsync_dir",
    "fsync_file",
    "release_free_memory",
    "resident_fraction",
    "summarize",
]

logger = logging.getLogger(__name__)

_PAGE = mmap.PAGESIZE
_libc: ctypes.CDLL | None
try:
    _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
except OSError:
    _libc = None


# ---------------------------------------------------------------------------- durability
def fsync_file(path: Path) -> None:
    """Flush one file's data to the device.

    Args:
        path: File to flush.
    """
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: Path) -> None:
    """Flush a directory entry list, so a newly created file's name is durable too.

    Args:
        path: Directory to flush.
    """
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ---------------------------------------------------------------------------- page cache
def _files(root: Path) -> Iterator[Path]:
    if root.is_file():
        yield root
        return
    for dirpath, _dirs, names in os.walk(root):
        for name in names:
            yield Path(dirpath) / name


def can_evict() -> bool:
    """True when this platform has ``posix_fadvise`` (needed for cold-cache loads)."""
    return hasattr(os, "posix_fadvise") and hasattr(os, "POSIX_FADV_DONTNEED")


def evict(root: Path) -> int:
    """Drop the page-cache pages of every file under ``root``.

    Each file is fsynced first: the kernel only drops clean pages, so a dirty page would stay
    cached and make the following "cold" load look faster than it is.

    Args:
        root: A file or a directory tree.

    Returns:
        The number of files evicted.
    """
    count = 0
    for path in _files(root):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
        count += 1
    return count


def resident_fraction(root: Path) -> float | None:
    """Fraction of the pages of the files under ``root`` that are in the page cache.

    Used once per run to prove that :func:`evict` really empties the cache on this machine:
    ``mincore`` on a fresh read-only mapping (mapping a file does not fault its pages in).

    Args:
        root: A file or a directory tree.

    Returns:
        0.0 (nothing cached) to 1.0 (all cached), or None where ``mincore`` is unavailable.
    """
    if _libc is None or not hasattr(_libc, "mincore"):
        return None
    libc = _libc
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [
        ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long,
    ]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    resident = total = 0
    for path in _files(root):
        size = path.stat().st_size
        if size == 0:
            continue
        pages = (size + _PAGE - 1) // _PAGE
        vec = (ctypes.c_ubyte * pages)()
        fd = os.open(path, os.O_RDONLY)
        try:
            addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
            if addr is None or addr == ctypes.c_void_p(-1).value:
                return None
            try:
                if libc.mincore(addr, size, vec) != 0:
                    return None
            finally:
                libc.munmap(addr, size)
        finally:
            os.close(fd)
        resident += sum(b & 1 for b in vec)
        total += pages
    return resident / total if total else 0.0


def dir_usage(root: Path) -> tuple[int, int]:
    """Apparent size and file count of a file or directory tree.

    Args:
        root: A file or a directory tree.

    Returns:
        ``(bytes, files)``.
    """
    size = files = 0
    for path in _files(root):
        size += path.stat().st_size
        files += 1
    return size, files


# ---------------------------------------------------------------------------- memory
def release_free_memory() -> None:
    """Collect young garbage and return glibc's free heap pages to the kernel.

    Without ``malloc_trim`` memory freed by an earlier step (e.g. a fresh load) can stay
    resident inside glibc's arenas; a later allocation would then reuse it without raising the
    RSS, and a peak-RSS measurement would under-count. Loaded states are acyclic and freed by
    reference counting; a young-generation collection catches short-lived cycles. A full
    collection is avoided on purpose: with the store's imports loaded it scans ~340k objects
    and takes ~0.6 s on the project machine, which made the quick run miss its time budget.
    """
    gc.collect(1)
    if _libc is not None and hasattr(_libc, "malloc_trim"):
        _libc.malloc_trim(0)


def prefault(nbytes: int) -> None:
    """Make ``nbytes`` of free memory backed by the host again, just before a measurement.

    On a virtual machine that reports its free pages to the host (virtio-balloon free page
    reporting), memory freed more than ~2 s ago is given back to the host, and the next
    allocation of it (the page cache a save writes into, or the tensors a load creates)
    faults every page in through the host first. On the project machine a fresh process's
    first 1.5 GB save took 1.6-1.7 s wall and 2.1-2.4 s of kernel CPU without this, and
    0.9 s wall and 0.55 s of kernel CPU after touching 2 GB here (two runs each). Touching and
    freeing a buffer here hands the measurement host-backed pages, so two versions measured
    side by side pay the same, and only their own, costs.
    """
    buf = bytearray(nbytes)  # calloc'd: mapped, but not touched yet
    view = memoryview(buf)
    page = mmap.PAGESIZE
    for start in range(0, nbytes, 1 << 26):
        chunk = view[start:start + (1 << 26)]
        chunk[::page] = b"\x01" * len(range(0, len(chunk), page))
    del view, chunk, buf


def _status_kib(field: str) -> int | None:
    try:
        with open("/proc/self/status", encoding="ascii") as fh:
            for line in fh:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


class PeakMemory:
    """Peak extra resident memory of this process while the ``with`` body runs.

    Method: free memory is handed back to the kernel (:func:`release_free_memory`), the
    kernel's RSS high-water mark is reset to the current RSS (``echo 5 >
    /proc/self/clear_refs``, Linux >= 4.0), and after the body ``VmHWM - baseline`` is the
    exact peak of extra resident memory, counted by the kernel on every page fault in every
    thread: no sampling interval can miss a short spike. Page-cache pages of written files are
    not part of the RSS; pages of files the body maps into memory are.

    Attributes:
        baseline: RSS in bytes when the body started.
        peak_extra: Peak RSS above ``baseline`` in bytes, or None where unsupported.
    """

    def __init__(self) -> None:
        """Create an unstarted measurement."""
        self.baseline = 0
        self.peak_extra: int | None = None
        self._ok = False

    @staticmethod
    def available() -> bool:
        """True when the kernel high-water mark can be reset on this machine."""
        try:
            with open("/proc/self/clear_refs", "w", encoding="ascii") as fh:
                fh.write("5")
        except OSError:
            return False
        return _status_kib("VmHWM") is not None

    def __enter__(self) -> PeakMemory:
        release_free_memory()
        try:
            with open("/proc/self/clear_refs", "w", encoding="ascii") as fh:
                fh.write("5")
            rss = _status_kib("VmRSS")
            self._ok = rss is not None
            self.baseline = (rss or 0) * 1024
        except OSError:
            self._ok = False
        return self

    def __exit__(self, *exc: object) -> None:
        hwm = _status_kib("VmHWM") if self._ok else None
        if hwm is not None:
            self.peak_extra = max(0, hwm * 1024 - self.baseline)


# ---------------------------------------------------------------------------- statistics
@dataclass(frozen=True)
class Summary:
    """Median and range of repeated measurements."""

    median: float
    low: float
    high: float
    n: int


def summarize(values: Sequence[float]) -> Summary | None:
    """Summarize measurements; None when there are none."""
    if not values:
        return None
    return Summary(statistics.median(values), min(values), max(values), len(values))


def fmt_summary(values: Sequence[float], digits: int = 2) -> str:
    """Format as ``median (min-max)``, or ``-`` when there are no values."""
    s = summarize(values)
    if s is None:
        return "-"
    if s.n == 1:
        return f"{s.median:.{digits}f}"
    return f"{s.median:.{digits}f} ({s.low:.{digits}f}-{s.high:.{digits}f})"


def fmt_bytes(n: float) -> str:
    """Format a byte count in decimal units (1 GB = 1e9 B)."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.3f} {unit}"
    return f"{n:.0f} B"
