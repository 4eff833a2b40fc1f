"""Memory fragmentation of the process: glibc malloc on CPU, the caching allocator on CUDA.

The ``memory_fragmentation`` metric is the share of memory an allocator holds but does not
hand out. What that means depends on the allocator:

* **CPU (glibc malloc)**: ``(arena - in_use) / arena`` from ``mallinfo2()``, read through
  ctypes: ``arena`` is the heap glibc obtained with brk/sbrk (all arenas), ``uordblks`` the part
  handed out. Large blocks that glibc maps directly (``hblkhd``) are not in the arena and are
  excluded, since unmapping them returns the memory at once. Staging buffers of async saves
  churn this heap; a high value means freed memory is stuck between live blocks.
* **CUDA (torch caching allocator)**: ``(reserved - allocated) / reserved`` from
  ``torch.cuda.memory_stats`` for each device: memory the allocator keeps cached but that
  no tensor uses.

Both return None when the figure is unavailable (not glibc, no CUDA, nothing allocated yet).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import sys
from collections.abc import Callable

__all__ = [
    "cuda_fragmentation",
    "fragmentation_sources",
    "malloc_arena",
    "malloc_fragmentation",
]

logger = logging.getLogger(__name__)


class _MallInfo2(ctypes.Structure):
    # Field order and types from glibc's <malloc.h> (struct mallinfo2, glibc >= 2.33).
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


def _load_mallinfo2() -> Callable[[], _MallInfo2] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        func = libc.mallinfo2
    except (OSError, AttributeError):
        # musl, or glibc older than 2.33: no mallinfo2 (mallinfo's int fields overflow at
        # 2 GiB, so it is not used as a fallback).
        logger.debug("mallinfo2 is not available; CPU memory fragmentation is not reported")
        return None
    func.restype = _MallInfo2
    func.argtypes = []
    return func  # type: ignore[no-any-return]


_MALLINFO2 = _load_mallinfo2()


def malloc_arena() -> tuple[int, int] | None:
    """glibc's heap as ``(arena bytes, in-use bytes)`` from ``mallinfo2``, or None."""
    if _MALLINFO2 is None:
        return None
    info = _MALLINFO2()
    return int(info.arena), int(info.uordblks)


def malloc_fragmentation() -> float | None:
    """Fragmentation of glibc's malloc heap: ``(arena - in_use) / arena``.

    Returns:
        A fraction in ``[0, 1]``, or None when glibc's ``mallinfo2`` is unavailable or the
        arena is empty.
    """
    figures = malloc_arena()
    if figures is None:
        return None
    arena, in_use = figures
    if arena <= 0:
        return None
    return min(max(arena - in_use, 0) / arena, 1.0)


def cuda_fragmentation() -> dict[str, float]:
    """Fragmentation of torch's CUDA caching allocator per device.

    Returns:
        ``{"cuda:0": (reserved - allocated) / reserved, ...}`` for devices with reserved
        memory; empty when torch was not imported, CUDA is unavailable or not initialised.
    """
    torch = sys.modules.get("torch")
    # Never import torch or initialise CUDA from a metrics scrape: both are expensive and a
    # scrape must not create a CUDA context in a process that has none.
    if torch is None or not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return {}
    out: dict[str, float] = {}
    for index in range(torch.cuda.device_count()):
        stats = torch.cuda.memory_stats(index)
        reserved = int(stats.get("reserved_bytes.all.current", 0))
        allocated = int(stats.get("allocated_bytes.all.current", 0))
        if reserved > 0:
            out[f"cuda:{index}"] = min(max(reserved - allocated, 0) / reserved, 1.0)
    return out


def fragmentation_sources() -> dict[str, float]:
    """Every available fragmentation figure, keyed by source.

    Returns:
        ``{"glibc_malloc": ..., "cuda:0": ...}``, omitting sources without a figure.
    """
    out: dict[str, float] = {}
    cpu = malloc_fragmentation()
    if cpu is not None:
        out["glibc_malloc"] = cpu
    out.update(cuda_fragmentation())
    return out
