"""Read committed checkpoints: the manifest, the whole state, a subset, one tensor at a
time, or ranges of tensors (:class:`RangeReader`).

Loading parallelises over chunks. Uncompressed chunks are read with positional vectored
reads straight into the destination tensors; compressed ones are decoded straight into the
tensor when one tensor covers the whole chunk. Fresh loads allocate every tensor with
``torch.empty`` (numpy's single large allocation measured slower to page-fault); loading
``into`` a live state writes into its tensors in place, which avoids page faults entirely.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ckptstore.errors import (
    InvalidNameError,
)
from ckptstore.format.casts import cast_into
from ckptstore.format.chunkio import ByteBuffer, ChunkReader, Dest, Locate
from ckptstore.format.codecs import codec_spec
from ckptstore.format.dtypes import dtype_by_name
from ckptstore.format.flatten import rebuild_state
from ckptstore.format.fsio import populate_write
from ckptstore.format.gcpause import without_gc
from ckptstore.format.keys import render_path
from ckptstore.format.manifest import (
    ArrayEntry,
    Manifest,
    TensorEntry,
)
from ckptstore.format.pool import run_all
from ckptstore.format.tree import iter_tensor_refs, match_into, select_tree

__all__ = ["RangeReader", "iter_tensors", "iteration_order", "read_checkpoint",
           "read_tensors"]

logger = logging.getLogger(__name__)


#: Reads of raw chunks are I/O- and page-fault-bound, not CPU-bound: at least this many reader
#: threads keep the disk queue and the fault path busy even when the caller asks for fewer.
MIN_READ_THREADS = 4
#: Chunk files hinted (``POSIX_FADV_WILLNEED``) ahead of the ones being read, so a cold read
#: keeps the device queue full instead of waiting file by file.
PREFETCH_AHEAD = 8
#: Fresh tensors at least this large have their pages faulted in by a helper thread, ahead of
#: and in parallel with the reads that fill them.
PREFAULT_MIN_BYTES = 1024 * 1024


def _select(manifest: Manifest, keys: Sequence[str] | None) -> Any:
    if keys is None:
        return manifest.tree
    patterns = [keys] if isinstance(keys, str) else list(keys)
    tree, matched = select_tree(manifest.tree, patterns)
    missing = [p for p in patterns if p not in matched]
    if missing:
        some = ", ".join(render_path(k) for k in manifest.tensor_keys()[:8])
        raise InvalidNameError(
            f"key patterns {missing} match nothing in checkpoint {manifest.id}; "
            f"tensor keys look like: {some or '(none)'}"
        )
    return tree


def _accepts(entry: TensorEntry, live: Any) -> bool:
    info = dtype_by_name(entry.torch_dtype)
    if info is None:
        return False
    if isinstance(live, torch.Tensor):
        return live.dtype == info.torch_dtype and tuple(live.shape) == entry.shape
    if isinstance(live, np.ndarray):
        return (
            live.dtype == np.dtype(info.zarr_dtype)
            and info.native
            and live.dtype.isnative
            and tuple(live.shape) == entry.shape
            and live.flags.c_contiguous
            and live.flags.writeable
        )
    return False


def _writable_bytes(tensor: torch.Tensor) -> ByteBuffer:
    view: ByteBuffer = tensor.detach().reshape(-1).view(torch.uint8).numpy()
    return view


def _direct(tensor: torch.Tensor) -> bool:
    """Whether we may write a live tensor's memory directly."""
    return (
        tensor.device.type == "cpu"
        and tensor.is_contiguous()
        and not tensor.is_conj()
        and not tensor.is_neg()
    )


def _fresh(
    shape: tuple[int, ...], dtype: torch.dtype, prefault: list[tuple[int, int]] | None = None
) -> torch.Tensor:
    """An uninitialised tensor; large ones are queued on ``prefault`` as (address, bytes)."""
    tensor = torch.empty(shape, dtype=dtype)
    nbytes = tensor.numel() * tensor.element_size()
    if prefault is not None and nbytes >= PREFAULT_MIN_BYTES:
        prefault.append((tensor.data_ptr(), nbytes))
    return tensor


class _Prefaulter:
    """Faults in fresh tensors' pages on a helper thread while the readers fill them.

    Filling fresh memory is bound by page faults (measured ~2 GB/s); taken
    one at a time inside each read they serialise with the copy. ``MADV_POPULATE_WRITE``
    faults a whole range per call, off the readers' path; a page a reader reaches first is
    simply faulted by the reader. A no-op where the kernel lacks it (Linux < 5.14).
    """

    def __init__(self, ranges: list[tuple[int, int]]) -> None:
        self._ranges = ranges
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ckpt-prefault", daemon=True)
        if ranges:
            self._thread.start()

    def _run(self) -> None:
        for address, nbytes in self._ranges:
            if self._stop.is_set():
                return
            if not populate_write(address, nbytes):
                return

    def close(self) -> None:
        """Stop and wait: no thread touches the tensors after the load returns."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()


def _chunk_dests(
    entry: TensorEntry,
    array: ArrayEntry,
    view: ByteBuffer,
    plan: dict[tuple[str, int], list[Dest]],
    first: int = 0,
    stop: int | None = None,
) -> None:
    """Add to ``plan`` where elements ``[first, stop)`` of ``entry`` (``view``) come from."""
    isz = array.itemsize
    start = entry.offset + first
    end = entry.offset + (entry.numel if stop is None else stop)
    if end <= start:
        return
    n = array.chunk_len
    for k in range(start // n, (end - 1) // n + 1):
        lo = max(k * n, start)
        hi = min((k + 1) * n, end)
        dest = view[(lo - start) * isz : (hi - start) * isz]
        plan.setdefault((array.name, k), []).append(((lo - k * n) * isz, dest))


class _Casts:
    """The tensors of one read stored as casts (format version 3), and where each one's wide
    elements come from: the same range read for its wide tensor in this read, else a scratch
    tensor of the array's dtype the read fills first."""

    def __init__(self, manifest: Manifest, keys: Sequence[str]) -> None:
        self._manifest = manifest
        self._wide: dict[tuple[str, int, int], str] = {}
        for key in keys:
            entry = manifest.tensors[key]
            if not entry.cast:
                self._wide.setdefault((entry.array, entry.offset, entry.numel), key)
        self._pending: list[tuple[torch.Tensor, str | torch.Tensor]] = []

    def plan(self, entry: TensorEntry, dest: torch.Tensor,
             plan: dict[tuple[str, int], list[Dest]]) -> None:
        """Arrange for ``dest`` (the cast tensor ``entry``) to be filled by :meth:`finish`."""
        wide = self._wide.get((entry.array, entry.offset, entry.numel))
        if wide is not None:
            self._pending.append((dest, wide))
            return
        array = self._manifest.arrays[entry.array]
        info = dtype_by_name(array.torch_dtype)
        assert info is not None  # the manifest was validated
        scratch = torch.empty(entry.numel, dtype=info.torch_dtype)
        _chunk_dests(entry, array, _writable_bytes(scratch), plan)
        self._pending.append((dest, scratch))

    def finish(self, filled: dict[str, torch.Tensor]) -> None:
        """Round the wide elements into each cast tensor, once the reads are done."""
        for dest, source in self._pending:
            cast_into(dest, filled[source] if isinstance(source, str) else source)


@without_gc
def read_checkpoint(
    directory: Path,
    manifest: Manifest,
    *,
    keys: Sequence[str] | None = None,
    into: Any | None = None,
    locate: Locate | None = None,
    threads: int = 2,
) -> Any:
    """Load a checkpoint's state (or part of it).

    Args:
        directory: The checkpoint directory.
        manifest: Its manifest (from :func:`~ckptstore.format.committed.read_manifest`).
        keys: fnmatch patterns over tensor keys (see :mod:`ckptstore.format.keys`); a pattern
            also selects everything under a matching container path (``"model"`` ==
            ``"model/*"``). Only the selected leaves are returned, inside the containers
            that hold them (see :func:`ckptstore.format.tree.select_tree`), and only chunks
            holding selected tensors are read.
        into: A live state of the same structure. Tensors (and ndarrays) found at the same
            path with the same shape and dtype are filled in place and returned as those
            objects; others are allocated fresh. Non-tensor values always come from the
            manifest. If loading fails, ``into`` may be partly overwritten.
        locate: Finds other checkpoints' directories by id (needed for deltas).
        threads: Reader threads.

    Returns:
        The state: CPU tensors, bit-identical, ``requires_grad`` False (unless they are the
        ``into`` tensors).

    Raises:
        IntegrityError: On a damaged, missing or truncated chunk (names tensor and chunk).
        MissingBaseError: If a chunk's base checkpoint cannot be found.
        InvalidNameError: If a key pattern matches nothing.
    """
    started = time.perf_counter()
    if not isinstance(threads, int) or threads < 1:
        raise InvalidNameError(f"threads must be a positive int, got {threads!r}")
    tree = _select(manifest, keys)
    needed: dict[str, None] = {}
    for _, _, key in iter_tensor_refs(tree):
        needed.setdefault(key)
    # Pair with the full tree: selection compacts lists, which would shift positions.
    live = (
        match_into(
            manifest.tree, into, lambda k, obj: k in needed and _accepts(manifest.tensors[k], obj)
        )
        if into is not None
        else {}
    )

    tensors: dict[str, torch.Tensor] = {}
    filled: dict[str, torch.Tensor] = {}
    arrays_out: dict[str, np.ndarray[Any, Any]] = {}
    copy_back: list[tuple[torch.Tensor, torch.Tensor]] = []
    plan: dict[tuple[str, int], list[Dest]] = {}
    prefault: list[tuple[int, int]] = []
    casts = _Casts(manifest, list(needed))
    for key in needed:
        entry = manifest.tensors[key]
        info = dtype_by_name(entry.torch_dtype)
        assert info is not None  # the manifest was validated
        target = live.get(key)
        if isinstance(target, np.ndarray):
            arrays_out[key] = target
            target = torch.from_numpy(target)
        if isinstance(target, torch.Tensor) and _direct(target):
            dest = target
            tensors[key] = target
        else:
            dest = _fresh(entry.shape, info.torch_dtype, prefault)
            if isinstance(target, torch.Tensor):
                copy_back.append((target, dest))
                tensors[key] = target
            else:
                tensors[key] = dest
        filled[key] = dest
        if not entry.numel:
            continue
        if entry.cast:
            casts.plan(entry, dest, plan)
        else:
            _chunk_dests(entry, manifest.arrays[entry.array], _writable_bytes(dest), plan)

    reader = ChunkReader(Path(directory), manifest, locate)
    _run_reads(reader, manifest, plan, threads, prefault)
    casts.finish(filled)
    if copy_back:
        with torch.no_grad():
            for target, fresh in copy_back:
                target.copy_(fresh)
    state = rebuild_state(tree, tensors, arrays_out)
    logger.debug(
        "read checkpoint %s: %d tensors from %d chunks in %.3fs",
        manifest.id,
        len(tensors),
        len(plan),
        time.perf_counter() - started,
    )
    return state


def read_tensors(
    directory: Path,
    manifest: Manifest,
    keys: Sequence[str],
    *,
    locate: Locate | None = None,
    threads: int = 2,
) -> dict[str, torch.Tensor]:
    """Read the tensors with exactly these keys into fresh tensors, by key.

    Unlike :func:`read_checkpoint` there is no pattern matching and no state tree: the
    result is flat, which suits tools that compare or convert tensor by tensor.

    Raises:
        InvalidNameError: If a key is not a tensor of the checkpoint.
        IntegrityError: On a damaged chunk, as :func:`read_checkpoint`.
        MissingBaseError: If a chunk's base checkpoint cannot be found.
    """
    unknown = [k for k in keys if k not in manifest.tensors]
    if unknown:
        raise InvalidNameError(
            f"checkpoint {manifest.id} has no tensor {render_path(unknown[0])}"
            + (f" (and {len(unknown) - 1} more unknown keys)" if len(unknown) > 1 else "")
        )
    out: dict[str, torch.Tensor] = {}
    plan: dict[tuple[str, int], list[Dest]] = {}
    prefault: list[tuple[int, int]] = []
    casts = _Casts(manifest, keys)
    for key in keys:
        entry = manifest.tensors[key]
        info = dtype_by_name(entry.torch_dtype)
        assert info is not None  # the manifest was validated
        out[key] = dest = _fresh(entry.shape, info.torch_dtype, prefault)
        if entry.numel and entry.cast:
            casts.plan(entry, dest, plan)
        elif entry.numel:
            _chunk_dests(entry, manifest.arrays[entry.array], _writable_bytes(dest), plan)
    reader = ChunkReader(Path(directory), manifest, locate)
    _run_reads(reader, manifest, plan, threads, prefault)
    casts.finish(out)
    return out


def _run_reads(
    reader: ChunkReader,
    manifest: Manifest,
    plan: dict[tuple[str, int], list[Dest]],
    threads: int,
    prefault: list[tuple[int, int]] | None = None,
) -> None:
    jobs = [
        (manifest.arrays[name], index, sorted(dests, key=lambda d: d[0]))
        for (name, index), dests in plan.items()
    ]
    if threads == 1 or len(jobs) <= 1:
        for array, index, dests in jobs:
            reader.read(array, index, dests)
        return
    prefaulter = _Prefaulter(prefault or [])
    try:
        _parallel_reads(reader, jobs, threads)
    finally:
        prefaulter.close()


def _parallel_reads(
    reader: ChunkReader, jobs: list[tuple[ArrayEntry, int, list[Dest]]], threads: int
) -> None:
    ahead = min(PREFETCH_AHEAD, len(jobs))
    for array, index, _ in jobs[:ahead]:
        reader.prefetch(array, index)

    def read(position: int) -> None:
        # Keep the read-ahead window moving: the file PREFETCH_AHEAD places later starts
        # loading now, while this one is copied.
        if position + ahead < len(jobs):
            later = jobs[position + ahead]
            reader.prefetch(later[0], later[1])
        array, index, dests = jobs[position]
        reader.read(array, index, dests)

    # Raw chunks are read straight into the tensors: I/O- and page-fault-bound work that
    # more threads overlap. Decoding is CPU-bound and each thread holds two chunk-sized
    # scratch buffers, so compressed reads keep the caller's thread count.
    decoding = any(
        codec_spec(array.codec).compressed or array.chunks[index].enc != "raw"
        for array, index, _ in jobs
    )
    workers = threads if decoding else max(threads, MIN_READ_THREADS)
    with ThreadPoolExecutor(workers, thread_name_prefix="ckpt-read") as pool:
        run_all(pool, [partial(read, i) for i in range(len(jobs))])


class RangeReader:
    """Reads ranges of a checkpoint's tensors into caller buffers, one call per chunk group.

    For tools that stream a checkpoint in pieces smaller than a tensor (merging reads the
    same ranges of several checkpoints, chunk by chunk). Thread-safe: each call reads on
    the calling thread.
    """

    def __init__(self, directory: Path, manifest: Manifest, *,
                 locate: Locate | None = None) -> None:
        """Read from ``directory`` (a committed checkpoint with this ``manifest``).

        Raises:
            InvalidNameError: If the checkpoint was saved through torch.distributed.checkpoint
                (its tensors are not in packed arrays).
        """
        if manifest.dcp is not None:
            raise InvalidNameError(
                f"checkpoint {manifest.id} was saved through torch.distributed.checkpoint; "
                "read it whole with store.load (ranges are read from the packed layout only)"
            )
        self.manifest = manifest
        self._reader = ChunkReader(Path(directory), manifest, locate)

    def read(self, ranges: Sequence[tuple[str, int, int, ByteBuffer]]) -> None:
        """Fill each buffer with elements ``[first, stop)`` of tensor ``key``.

        Every chunk involved is read once, whatever number of ranges it serves, and is
        verified whole (crc32c) like any load.

        Args:
            ranges: ``(key, first, stop, buffer)``: ``buffer`` holds exactly
                ``(stop - first) * itemsize`` bytes.

        Raises:
            IntegrityError: On a damaged, missing or truncated chunk (names it).
            MissingBaseError: If a chunk's base checkpoint cannot be found.
        """
        plan: dict[tuple[str, int], list[Dest]] = {}
        casts: list[tuple[ByteBuffer, torch.dtype, torch.Tensor]] = []
        for key, first, stop, buf in ranges:
            entry = self.manifest.tensors[key]
            array = self.manifest.arrays[entry.array]
            if entry.cast:
                # The wide elements into a scratch buffer, rounded into ``buf`` below.
                wide, narrow = dtype_by_name(array.torch_dtype), dtype_by_name(entry.torch_dtype)
                assert wide is not None and narrow is not None  # the manifest was validated
                scratch = torch.empty(max(stop - first, 0), dtype=wide.torch_dtype)
                casts.append((buf, narrow.torch_dtype, scratch))
                buf = _writable_bytes(scratch)
            _chunk_dests(entry, array, buf, plan, first, stop)
        for (name, index), dests in sorted(plan.items()):
            self._reader.read(self.manifest.arrays[name], index, sorted(dests, key=lambda d: d[0]))
        for buf, dtype, scratch in casts:
            cast_into(torch.from_numpy(buf).view(dtype), scratch)


def iter_tensors(
    directory: Path, manifest: Manifest, *, locate: Locate | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(key, tensor)`` one tensor at a time, for memory-bounded conversion.

    Tensors come grouped by array (dtype) in packing order, not in flatten order
    (:func:`iteration_order`), each tensor stored as a cast right after the tensor whose
    elements it rounds; ndarray leaves come as tensors. Memory holds one tensor and its casts
    plus at most one chunk.

    Raises:
        IntegrityError: On a damaged chunk, as :func:`read_checkpoint`.
    """
    reader = ChunkReader(Path(directory), manifest, locate)
    by_array, followers, orphans = _iteration_plan(manifest)
    for name, entries in by_array.items():
        array = manifest.arrays[name]
        held_index = -1
        held = np.empty(array.chunk_nbytes, dtype=np.uint8)
        for entry in entries:
            info = dtype_by_name(entry.torch_dtype)
            assert info is not None
            tensor = torch.empty(entry.shape, dtype=info.torch_dtype)
            view = _writable_bytes(tensor)
            isz = array.itemsize
            end = entry.offset + entry.numel
            for k in range(entry.chunk_start, entry.chunk_stop):
                chunk_lo = k * array.chunk_len
                lo, hi = max(chunk_lo, entry.offset), min(chunk_lo + array.chunk_len, end)
                dest = view[(lo - entry.offset) * isz : (hi - entry.offset) * isz]
                at = (lo - chunk_lo) * isz
                if k != held_index and (
                    hi < min(chunk_lo + array.chunk_len, array.length) or lo > chunk_lo
                ):
                    # The chunk is shared with other tensors: keep it for them.
                    reader.read(array, k, [(0, held)])
                    held_index = k
                if k == held_index:
                    np.copyto(dest, held[at : at + len(dest)])
                else:
                    reader.read(array, k, [(at, dest)])
            # The tensors stored as casts of these elements, rounded from them: no read of
            # their own.
            rounded = []
            for key in followers.get((entry.array, entry.offset, entry.numel), ()):
                cast = manifest.tensors[key]
                narrow = dtype_by_name(cast.torch_dtype)
                assert narrow is not None
                out = torch.empty(cast.shape, dtype=narrow.torch_dtype)
                cast_into(out, tensor)
                rounded.append((key, out))
            yield entry.key, tensor
            yield from rounded
    # Casts of elements no other tensor of the manifest holds (another writer's manifest may
    # say so): each from its own read of those elements.
    for key in orphans:
        yield key, read_tensors(directory, manifest, [key], locate=locate, threads=1)[key]


def _iteration_plan(manifest: Manifest) -> tuple[
        dict[str, list[TensorEntry]], dict[tuple[str, int, int], list[str]], list[str]]:
    """:func:`iter_tensors`' order: the stored tensors by array, each array's by offset; the
    casts that follow each of them (by its array, offset and length); the casts no stored
    tensor holds the elements of, last."""
    by_array: dict[str, list[TensorEntry]] = {}
    casts: dict[tuple[str, int, int], list[str]] = {}
    for entry in manifest.tensors.values():
        if entry.cast:
            casts.setdefault((entry.array, entry.offset, entry.numel), []).append(entry.key)
        else:
            by_array.setdefault(entry.array, []).append(entry)
    followers: dict[tuple[str, int, int], list[str]] = {}
    for entries in by_array.values():
        entries.sort(key=lambda e: e.offset)
        for entry in entries:
            span = (entry.array, entry.offset, entry.numel)
            if span in casts:
                followers[span] = casts.pop(span)
    return by_array, followers, [key for keys in casts.values() for key in keys]


def iteration_order(manifest: Manifest) -> list[str]:
    """The keys in the order :func:`iter_tensors` yields them."""
    by_array, followers, orphans = _iteration_plan(manifest)
    order: list[str] = []
    for entries in by_array.values():
        for entry in entries:
            order.append(entry.key)
            order += followers.get((entry.array, entry.offset, entry.numel), ())
    return order + orphans
