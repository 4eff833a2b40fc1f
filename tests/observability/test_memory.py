"""Memory fragmentation figures: glibc malloc on CPU, the CUDA allocator when present."""

from __future__ import annotations

import sys

import pytest

from ckptstore.observability import cuda_fragmentation, fragmentation_sources
from ckptstore.observability.memory import malloc_fragmentation

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux") or malloc_fragmentation() is None,
    reason="needs glibc >= 2.33 (mallinfo2)",
)


def test_fraction_is_in_range() -> None:
    value = malloc_fragmentation()
    assert value is not None and 0.0 <= value <= 1.0
    assert fragmentation_sources()["glibc_malloc"] == pytest.approx(value, abs=0.05)


_FRAGMENT_SCRIPT = """
import ctypes, ctypes.util
from ckptstore.observability.memory import malloc_arena, malloc_fragmentation
libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
before = malloc_arena()
# 24 MiB in 8 KiB blocks (below the mmap threshold, so they live in the arena).
blocks = [libc.malloc(8192) for _ in range(3072)]
assert all(blocks)
for ptr in blocks[::2]:
    libc.free(ptr)
after = malloc_arena()
print(before[0], before[1], after[0], after[1], malloc_fragmentation())
"""


def test_freeing_every_other_block_fragments_the_heap() -> None:
    # A fresh interpreter: in the test process the heap already holds free space that the
    # new blocks would be carved from, which hides the effect being measured.
    import subprocess

    out = subprocess.run(
        [sys.executable, "-c", _FRAGMENT_SCRIPT], capture_output=True, text=True, check=True,
        timeout=120,
    ).stdout.split()
    b_arena, b_used, a_arena, a_used = (int(x) for x in out[:4])
    fraction = float(out[4])
    # The freed half (12 MiB) is trapped between live blocks: the arena cannot shrink, so
    # its free part grows by about that much.
    grown = (a_arena - a_used) - (b_arena - b_used)
    assert grown >= 0.8 * 12 * 2**20, out
    assert fraction == pytest.approx((a_arena - a_used) / a_arena, abs=0.05)


def test_cuda_figures_need_an_initialised_device() -> None:
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        assert all(0.0 <= v <= 1.0 for v in cuda_fragmentation().values())
    else:
        assert cuda_fragmentation() == {}


def test_cuda_fragmentation_reflects_the_caching_allocator() -> None:
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    torch.cuda.init()
    torch.cuda.empty_cache()
    # 64 blocks of 4 MiB, every other one freed: the allocator keeps them cached (reserved)
    # but no tensor uses them.
    blocks = [torch.empty(2**20, dtype=torch.float32, device="cuda") for _ in range(64)]
    del blocks[::2]
    torch.cuda.synchronize()
    figures = cuda_fragmentation()
    stats = torch.cuda.memory_stats(0)
    reserved = stats["reserved_bytes.all.current"]
    allocated = stats["allocated_bytes.all.current"]
    assert figures["cuda:0"] == pytest.approx((reserved - allocated) / reserved)
    assert figures["cuda:0"] >= 0.4
    assert "cuda:0" in fragmentation_sources()
    del blocks
    torch.cuda.empty_cache()
