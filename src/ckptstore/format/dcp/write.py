"""One rank's part of a DCP save: chunk files, pack arrays and ``zarr.json`` documents.

Each chunk is encoded by this module (``bytes`` [+ Blosc] + crc32c trailer, the bytes zarr's
codec chain produces) and written whole, with exclusive create, straight from the shard's
memory when the chunk is a contiguous slice of it; edge chunks are padded as zarr pads them.
No chunk is ever shared between ranks, so there is no read-modify-write and no lock. Files
are written on a small thread pool with early writeback, then fsynced on a wide pool (the
filesystem batches concurrent fsyncs into one journal commit; one at a time costs ~6 ms
each on the reference machine), then their directories. Only then does ``write_data``
return, so when the coordinator's ``finish`` runs every rank's data is durable.

With a :class:`ChunkSink` (a hot tier in object storage) every file goes to the sink instead,
whole, one request each, from the writer threads: the rank uploads its own shards in
parallel, holding at most one encoded chunk per thread; the sink's ``put`` returns once the
object is stored, which is S3's durability point.
"""

from __future__ import annotations

import io
import logging
import math
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult

from ckptstore.durable import fsync_dir, fsync_file, storage_error, write_new_file
from ckptstore.errors import CkptError
from ckptstore.format.chunkwriter import write_chunk_file
from ckptstore.format.codecs import (
    TRAILER,
    CodecSpec,
    codec_spec,
    crc32c_update,
    encode_into,
    max_encoded_size,
)
from ckptstore.format.constants import ZARR_JSON
from ckptstore.format.dcp.layout import (
    ArrayInfo,
    BlobItem,
    Piece,
    chunk_file,
    chunk_key,
    chunks_of_piece,
    pack_path,
    rank_group,
)
from ckptstore.format.dcp.plan import ArraySpec, RankTask, Slot
from ckptstore.format.dcp.zarrdocs import array_doc, group_doc
from ckptstore.format.layout import ArrayPlan, plan_layout
from ckptstore.format.pool import run_all

__all__ = ["FSYNC_THREADS", "ChunkSink", "RankReport", "Stored", "write_rank"]

logger = logging.getLogger(__name__)

#: Concurrent fsyncs: the filesystem merges them into few journal commits.
FSYNC_THREADS = 16

ByteView = np.ndarray[Any, np.dtype[np.uint8]]


class ChunkSink(Protocol):
    """Where a rank's files go when they are not local files (a hot tier in object storage)."""

    def put(self, rel: str, data: bytes) -> None:
        """Store ``data`` as the new file ``rel`` (relative to the checkpoint), durably.

        Raises:
            StorageError: If it cannot be stored; ConflictError if it exists.
        """


@dataclass(frozen=True)
class RankReport:
    """What a rank wrote beyond its items' own chunks (sent with its first write result).

    Attributes:
        packs: The rank's pack arrays, complete with chunk records.
        meta_files: ``(relative path, size)`` of every ``zarr.json`` the rank wrote.
    """

    packs: tuple[ArrayInfo, ...]
    meta_files: tuple[tuple[str, int], ...]


@dataclass(frozen=True)
class Stored:
    """``WriteResult.storage_data``: where one item went.

    Attributes:
        piece: For a tensor item, its piece.
        blob: For a non-tensor item, its place in the byte pack.
        chunks: Chunk key -> (size, crc32c) of the chunk files written for this item (items
            in their own array only; pack chunks are in the rank report).
        report: The rank report, on the rank's first result only.
    """

    piece: Piece | None = None
    blob: BlobItem | None = None
    chunks: dict[str, tuple[int, int]] = field(default_factory=dict)
    report: RankReport | None = None


def _cpu_contiguous(tensor: torch.Tensor) -> torch.Tensor:
    t = tensor.detach()
    if t.device.type != "cpu":
        t = t.to("cpu")
    if t.is_conj():
        t = t.resolve_conj()
    if t.is_neg():
        t = t.resolve_neg()
    return t if t.is_contiguous() else t.contiguous()


def _bytes_of(tensor: torch.Tensor) -> ByteView:
    view: ByteView = tensor.reshape(-1).view(torch.uint8).numpy()
    return view


@dataclass
class _Written:
    array: str
    key: str
    path: Path
    nbytes: int
    crc: int


class _RankWriter:
    """Writes one rank's plan; see the module docstring."""

    def __init__(
        self,
        task: RankTask,
        fault: Callable[[str], None] | None,
        sink: ChunkSink | None = None,
    ) -> None:
        self.task = task
        self.sink = sink
        self.dir = Path(task.directory)
        self.spec: CodecSpec = codec_spec(task.codec)
        self.fault = fault
        self.local = threading.local()
        self.made_dirs: set[Path] = set()
        self.dir_lock = threading.Lock()

    # -- buffers and files --------------------------------------------------------------
    def buffer(self, name: str, size: int) -> ByteView:
        """A per-thread scratch buffer reused across chunks (fresh pages fault slowly)."""
        buf: ByteView | None = getattr(self.local, name, None)
        if buf is None or len(buf) < size:
            buf = np.empty(size, dtype=np.uint8)
            setattr(self.local, name, buf)
        return buf[:size]

    def ensure_dir(self, rel: str) -> None:
        """Create an array directory (another rank may create it at the same time)."""
        if self.sink is not None:
            return  # object stores have no directories
        path = self.dir / rel
        with self.dir_lock:
            if path in self.made_dirs:
                return
            self.made_dirs.add(path)
        try:
            # parents: a rank's group of the per-rank layout is made with its first array.
            path.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise storage_error(path, "create directory", exc) from exc

    def write_chunk(self, array: str, key: str, segments: list[Any], itemsize: int) -> _Written:
        """Encode ``segments`` (the chunk's unencoded bytes, in order) and write the file."""
        payload = segments
        if self.spec.compressed:
            if len(segments) == 1:
                data = segments[0]
            else:
                total = sum(len(s) for s in segments)
                data = self.buffer("gather", total)
                pos = 0
                for seg in segments:
                    np.copyto(data[pos : pos + len(seg)], seg)
                    pos += len(seg)
            out = self.buffer("encoded", max_encoded_size(len(data)))
            payload = [encode_into(self.spec, data, itemsize, out)]
        rel = chunk_file(array, key)
        path = self.dir / rel
        if self.sink is not None:
            crc = 0
            for part in payload:
                crc = crc32c_update(part, crc)
            data = b"".join([*payload, TRAILER.pack(crc)])
            self.sink.put(rel, data)
            nbytes = len(data)
        else:
            crc, nbytes = write_chunk_file(path, payload)
        if self.fault is not None:
            self.fault("dcp.chunk_written")
        return _Written(array, key, path, nbytes, crc)

    # -- what to write ------------------------------------------------------------------
    def grid_chunk(
        self, spec: ArraySpec, coords: tuple[int, ...], tensor: torch.Tensor,
        offsets: tuple[int, ...],
    ) -> _Written:
        """Write chunk ``coords`` of ``spec`` from the shard ``tensor`` at ``offsets``."""
        cs = spec.chunk_shape
        start = [c * n for c, n in zip(coords, cs, strict=True)]
        extent = [min(n, s - b) for n, s, b in zip(cs, spec.shape, start, strict=True)]
        local = [b + o - off for b, o, off in zip(start, spec.origin, offsets, strict=True)]
        sub = tensor[tuple(slice(lo, lo + e) for lo, e in zip(local, extent, strict=True))]
        itemsize = tensor.element_size()
        if extent == list(cs) and sub.is_contiguous():
            segments = [_bytes_of(sub)]
        else:
            # Edge chunk (zarr stores it padded to the full chunk shape) or a strided block.
            raw = self.buffer("pad", math.prod(cs) * itemsize)
            raw.fill(0)
            block = torch.from_numpy(raw).view(tensor.dtype).view(cs)
            block[tuple(slice(0, e) for e in extent)].copy_(sub)
            segments = [raw]
        return self.write_chunk(spec.path, chunk_key(coords), segments, itemsize)

    def pack_chunk(self, path: str, plan: ArrayPlan, index: int, sources: dict[str, ByteView]
                   ) -> _Written:
        """Write chunk ``index`` of a pack array from its members' bytes."""
        isz = plan.info.itemsize
        segments: list[Any] = [
            sources[m.key][first * isz : stop * isz] for m, first, stop in plan.chunk_members(index)
        ]
        pad = plan.chunk_nbytes - sum(len(s) for s in segments)
        if pad:
            segments.append(np.zeros(pad, dtype=np.uint8))
        return self.write_chunk(path, str(index), segments, isz)

    def write_doc(self, rel: str, data: bytes) -> tuple[str, int]:
        """Write one ``zarr.json`` durably; return its path and size."""
        if self.sink is not None:
            self.sink.put(rel, data)
        else:
            write_new_file(self.dir / rel, data)
        return rel, len(data)


def _fsync_all(paths: list[Path], dirs: list[Path]) -> None:
    with ThreadPoolExecutor(FSYNC_THREADS, thread_name_prefix="ckpt-dcp-fsync") as pool:
        list(pool.map(fsync_file, paths))
        list(pool.map(fsync_dir, dirs))


def write_rank(
    task: RankTask,
    plan: SavePlan,
    planner: SavePlanner,
    *,
    fault: Callable[[str], None] | None = None,
    sink: ChunkSink | None = None,
) -> list[WriteResult]:
    """Write every item of this rank's final plan; return one WriteResult per item.

    Items in ``task.slots`` go to chunks of their arrays; the other tensors are packed by
    dtype into ``dcp_packs/r<rank>.<dtype>`` and non-tensor items (the BytesIO DCP's planner
    produced with ``torch.save``; we never pickle anything ourselves) into
    ``dcp_packs/r<rank>.bytes``. Tensors are resolved up front (views of CPU shards; a GPU
    shard is copied to host memory).

    Args:
        task: This rank's task from the coordinator.
        plan: The final local plan.
        planner: The save planner (resolves items to data).
        fault: Called with ``"dcp.chunk_written"`` after each chunk (crash tests).
        sink: Where the files go instead of ``task.directory`` (a hot tier in object
            storage); nothing is fsynced then: a stored object is durable.

    Raises:
        StorageError: On any OS error; files already written are left for the coordinator
            (or ``ckpt gc``) to remove with the uncommitted directory.
    """
    writer = _RankWriter(task, fault, sink)
    rank = task.rank
    big: list[tuple[WriteItem, torch.Tensor, Slot]] = []
    packed: dict[str, torch.Tensor] = {}
    blobs: dict[str, torch.Tensor] = {}
    order: list[tuple[WriteItem, str]] = []  # (item, pack key or "")
    for i, item in enumerate(plan.items):
        key = f"{i}"
        if item.type == WriteItemType.BYTE_IO:
            data = planner.resolve_data(item)
            raw = data.getvalue() if isinstance(data, io.BytesIO) else bytes(data)  # type: ignore[arg-type]
            blobs[key] = (
                torch.frombuffer(bytearray(raw), dtype=torch.uint8)
                if raw
                else torch.empty(0, dtype=torch.uint8)
            )
            order.append((item, key))
            continue
        assert item.tensor_data is not None
        tensor = _cpu_contiguous(planner.resolve_data(item))  # type: ignore[arg-type]
        offsets = tuple(item.tensor_data.chunk.offsets)
        expected = (item.tensor_data.properties.dtype, tuple(item.tensor_data.chunk.sizes))
        if (tensor.dtype, tuple(tensor.shape)) != expected:
            raise CkptError(
                f"the planner resolved {item.index.fqn!r} at {offsets} to a {tensor.dtype} "
                f"tensor of shape {tuple(tensor.shape)}, but planned {expected[0]} of shape "
                f"{expected[1]}; the state changed during the save: do not modify it until "
                "dcp.save returns (or use dcp.async_save)"
            )
        slot = task.slots.get((item.index.fqn, offsets))
        if slot is None:
            packed[key] = tensor
            order.append((item, key))
        else:
            big.append((item, tensor, slot))
            order.append((item, ""))

    pack_plans = plan_layout(packed, task.chunk_bytes)
    blob_plans = plan_layout(blobs, task.chunk_bytes)
    packs: list[tuple[str, ArrayPlan, dict[str, ByteView]]] = [
        (pack_path(rank, name), p, {k: _bytes_of(packed[k]) for k in (m.key for m in p.members)})
        for name, p in pack_plans.items()
    ]
    packs += [
        (pack_path(rank, "bytes"), p, {k: _bytes_of(blobs[k]) for k in (m.key for m in p.members)})
        for p in blob_plans.values()
    ]

    jobs: list[Callable[[], Any]] = []
    for item, tensor, slot in big:
        writer.ensure_dir(slot.array.path)
        assert item.tensor_data is not None
        offsets = tuple(item.tensor_data.chunk.offsets)
        sizes = tuple(item.tensor_data.chunk.sizes)
        for coords in chunks_of_piece(slot.array.origin, slot.array.chunk_shape, offsets, sizes):
            jobs.append(partial(writer.grid_chunk, slot.array, coords, tensor, offsets))
    for path, p, sources in packs:
        writer.ensure_dir(path)
        for index in range(p.n_chunks):
            jobs.append(partial(writer.pack_chunk, path, p, index, sources))
    docs: list[tuple[str, bytes]] = [
        (f"{slot.array.path}/{ZARR_JSON}",
         array_doc(slot.array.dtype, task.codec, slot.array.shape, slot.array.chunk_shape))
        for _, _, slot in big
        if slot.write_meta
    ]
    docs += [
        (f"{path}/{ZARR_JSON}", array_doc(p.info.name, task.codec, (p.length,), (p.chunk_len,)))
        for path, p, _ in packs
    ]
    group = rank_group(rank)
    if any(slot.array.path.startswith(group + "/") for _, _, slot in big):
        # The per-rank layout: this rank's group document is one of its own files.
        docs.append((f"{group}/{ZARR_JSON}", group_doc()))

    with ThreadPoolExecutor(task.threads, thread_name_prefix="ckpt-dcp-write") as pool:
        written: list[_Written] = run_all(pool, jobs)
    with ThreadPoolExecutor(FSYNC_THREADS, thread_name_prefix="ckpt-dcp-meta") as pool:
        meta_files: list[tuple[str, int]] = run_all(
            pool, [partial(writer.write_doc, rel, data) for rel, data in docs]
        )
    if sink is None:
        _fsync_all([w.path for w in written], sorted({w.path.parent for w in written}
                                                      | {writer.dir / Path(r).parent
                                                         for r, _ in meta_files}))
    return _results(task, order, big, packs, written, meta_files)


def _results(
    task: RankTask,
    order: list[tuple[WriteItem, str]],
    big: list[tuple[WriteItem, torch.Tensor, Slot]],
    packs: list[tuple[str, ArrayPlan, dict[str, ByteView]]],
    written: list[_Written],
    meta_files: list[tuple[str, int]],
) -> list[WriteResult]:
    chunks_by_array: dict[str, dict[str, tuple[int, int]]] = {}
    for w in written:
        chunks_by_array.setdefault(w.array, {})[w.key] = (w.nbytes, w.crc)
    pack_infos = tuple(
        ArrayInfo(path, p.info.name, (p.length,), (p.chunk_len,), chunks_by_array.get(path, {}))
        for path, p, _ in packs
    )
    placement: dict[str, tuple[str, int, int]] = {}
    for path, p, _ in packs:
        for m in p.members:
            placement[m.key] = (path, m.offset, m.numel)
    slot_of = {id(item): slot for item, _, slot in big}
    results: list[WriteResult] = []
    for item, key in order:
        fqn = item.index.fqn
        if item.type == WriteItemType.BYTE_IO:
            path, at, nbytes = placement[key]
            stored = Stored(blob=BlobItem(fqn, path, at, nbytes))
            size = nbytes
        else:
            assert item.tensor_data is not None
            offsets = tuple(item.tensor_data.chunk.offsets)
            sizes = tuple(item.tensor_data.chunk.sizes)
            size = math.prod(sizes) * item.tensor_data.properties.dtype.itemsize
            slot = slot_of.get(id(item))
            if slot is None:
                path, at, _ = placement[key]
                stored = Stored(piece=Piece(offsets, sizes, path, None, at))
            else:
                spec = slot.array
                mine = {
                    chunk_key(c): chunks_by_array[spec.path][chunk_key(c)]
                    for c in chunks_of_piece(spec.origin, spec.chunk_shape, offsets, sizes)
                }
                stored = Stored(piece=Piece(offsets, sizes, spec.path, spec.origin, None),
                                chunks=mine)
        if not results:
            stored = Stored(stored.piece, stored.blob, stored.chunks,
                            RankReport(pack_infos, tuple(meta_files)))
        results.append(WriteResult(index=item.index, size_in_bytes=size, storage_data=stored))
    if not order and (pack_infos or meta_files):  # pragma: no cover - packs imply items
        raise CkptError("rank wrote arrays without any item; this is a bug in ckptstore")
    logger.debug("rank %d wrote %d files for checkpoint %s", task.rank, len(written), task.ckpt_id)
    return results
