"""Reading the DCP layout: verified chunks, box copies, DCP metadata, full loads, verify.

Every chunk read is checked against its crc32c trailer and the index's record (size and
crc) before it is decoded; a missing, truncated or damaged chunk raises
:class:`~ckptstore.errors.IntegrityError` naming the checkpoint, the tensor and the file,
never reads as fill-value zeros.

A read is a list of :class:`Request`: copy a sub-box of one stored box into a target view.
The boxes DCP sees as "saved chunks" are our zarr chunks (for per-tensor arrays) and the
packed pieces, so each of DCP's ReadItems touches exactly one stored box, and a rank reads
only the chunks that overlap its shards.
"""

from __future__ import annotations

import io
import logging
import math
import os
import pickle
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import crc32c as _crc32c
import numpy as np
import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)

from ckptstore.durable import storage_error
from ckptstore.errors import IntegrityError, InvalidNameError, StorageError, UnsafeObjectError
from ckptstore.format.codecs import TRAILER, codec_spec, crc32c_update, decode_into
from ckptstore.format.constants import ZARR_JSON
from ckptstore.format.dcp.layout import (
    ArrayInfo,
    BlobItem,
    DcpIndex,
    Piece,
    TensorItem,
    chunk_file,
    chunk_key,
    chunks_of_piece,
    is_dcp_manifest,
)
from ckptstore.format.fsio import fadvise_willneed, preadv_all
from ckptstore.format.keys import escape_component, key_matches
from ckptstore.format.manifest import Manifest

__all__ = [
    "BoxLoc",
    "ChunkSource",
    "Request",
    "build_metadata",
    "index_of",
    "is_dcp_manifest",
    "load_blob",
    "load_full",
    "run_requests",
    "stored_boxes",
    "verify_dcp",
]

logger = logging.getLogger(__name__)

_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
ByteView = np.ndarray[Any, np.dtype[np.uint8]]


def index_of(manifest: Manifest) -> DcpIndex:
    """The DCP index of a manifest (parsed and validated with the manifest).

    Raises:
        IntegrityError: If the manifest has no valid DCP index.
    """
    if manifest.dcp is None:
        raise IntegrityError(
            f"checkpoint {manifest.id} was not saved through DCP (no DCP index in its "
            "manifest); load it with store.load instead of a DCP storage reader"
        )
    return manifest.dcp


@dataclass(frozen=True)
class BoxLoc:
    """One stored box: a whole chunk of a per-tensor array, or a packed piece.

    Attributes:
        fqn: The tensor.
        array: The array holding it.
        offsets: Global offsets of the box.
        sizes: Its sizes (edge chunks are clipped to the tensor).
        key: Chunk key, for a chunk of a per-tensor array.
        at: Element offset in the pack, for a packed piece.
    """

    fqn: str
    array: ArrayInfo
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    key: str | None = None
    at: int | None = None


def _piece_boxes(item: TensorItem, piece: Piece, arrays: dict[str, ArrayInfo]) -> Iterator[BoxLoc]:
    array = arrays[piece.array]
    if piece.at is not None:
        yield BoxLoc(item.fqn, array, piece.offsets, piece.sizes, at=piece.at)
        return
    assert piece.origin is not None
    if piece.numel == 0:
        yield BoxLoc(item.fqn, array, piece.offsets, piece.sizes, key=None, at=0)
        return
    cs = array.chunk_shape
    for coords in chunks_of_piece(piece.origin, cs, piece.offsets, piece.sizes):
        start = tuple(a + c * n for a, c, n in zip(piece.origin, coords, cs, strict=True))
        sizes = tuple(
            min(n, a + s - b)
            for n, a, s, b in zip(cs, piece.origin, array.shape, start, strict=True)
        )
        yield BoxLoc(item.fqn, array, start, sizes, key=chunk_key(coords))


def stored_boxes(index: DcpIndex) -> dict[str, list[BoxLoc]]:
    """Every stored box of every tensor, by fqn."""
    return {
        fqn: [box for piece in item.pieces for box in _piece_boxes(item, piece, index.arrays)]
        for fqn, item in index.tensors.items()
    }


def build_metadata(
    index: DcpIndex, boxes: dict[str, list[BoxLoc]]
) -> tuple[Metadata, dict[MetadataIndex, BoxLoc | BlobItem]]:
    """DCP ``Metadata`` for a checkpoint, and the storage location of every saved chunk."""
    sd_meta: dict[str, TensorStorageMetadata | BytesStorageMetadata] = {}
    where: dict[MetadataIndex, BoxLoc | BlobItem] = {}
    for fqn, item in index.tensors.items():
        info = index.arrays[item.pieces[0].array].info if item.pieces else None
        dtype = info.torch_dtype if info is not None else _dtype(item.dtype)
        chunks = []
        for box in boxes[fqn]:
            chunks.append(ChunkStorageMetadata(torch.Size(box.offsets), torch.Size(box.sizes)))
            where[MetadataIndex(fqn, box.offsets)] = box
        sd_meta[fqn] = TensorStorageMetadata(
            properties=TensorProperties(dtype=dtype, requires_grad=item.requires_grad),
            size=torch.Size(item.shape),
            chunks=chunks,
        )
    for fqn, blob in index.blobs.items():
        sd_meta[fqn] = BytesStorageMetadata()
        where[MetadataIndex(fqn)] = blob
    planner_data = (
        None if index.planner_data is None else {f: tuple(p) for f, p in index.planner_data.items()}
    )
    metadata = Metadata(
        state_dict_metadata=sd_meta,
        planner_data=planner_data,
        storage_data=where,
        version=index.dcp_version,
    )
    return metadata, where


def _dtype(name: str) -> torch.dtype:
    from ckptstore.format.dtypes import dtype_by_name

    info = dtype_by_name(name)
    assert info is not None
    return info.torch_dtype


# --------------------------------------------------------------------------- chunks
class ChunkSource:
    """Reads verified, decoded chunks of one checkpoint's DCP arrays. Thread-safe."""

    def __init__(self, directory: Path, manifest_id: str, index: DcpIndex) -> None:
        self.directory = Path(directory)
        self.ckpt_id = manifest_id
        self.index = index
        self.compressed = codec_spec(index.codec).compressed
        self._local = threading.local()

    def buffer(self, name: str, size: int) -> ByteView:
        """A per-thread scratch buffer, reused (fresh pages fault at ~2 GB/s)."""
        buf: ByteView | None = getattr(self._local, name, None)
        if buf is None or len(buf) < size:
            buf = np.empty(size, dtype=np.uint8)
            setattr(self._local, name, buf)
        return buf[:size]

    def damaged(self, array: ArrayInfo, key: str, what: str) -> IntegrityError:
        """The error for a bad chunk: checkpoint, tensor(s) and file."""
        path = self.directory / chunk_file(array.path, key)
        owners = sorted(
            {fqn for fqn, item in self.index.tensors.items()
             if any(p.array == array.path for p in item.pieces)}
            | {fqn for fqn, blob in self.index.blobs.items() if blob.array == array.path}
        )
        shown = ", ".join(owners[:3]) + (f" (+{len(owners) - 3} more)" if len(owners) > 3 else "")
        return IntegrityError(
            f"checkpoint {self.ckpt_id}: chunk {path} (of {shown or array.path}) {what}; the "
            "checkpoint is damaged: restore it from another replica or load an earlier one"
        )

    def read(self, array: ArrayInfo, key: str, dest: ByteView) -> None:
        """Fill ``dest`` (``array.chunk_nbytes`` bytes) with chunk ``key``, verified.

        Raises:
            IntegrityError: If the chunk is missing, truncated, fails its crc or will not
                decode.
            StorageError: On other OS errors.
        """
        record = array.chunks.get(key)
        if record is None:
            raise self.damaged(array, key, "is not in the index")
        nbytes, crc = record
        path = self.directory / chunk_file(array.path, key)
        try:
            fd = os.open(path, os.O_RDONLY | _O_CLOEXEC)
        except FileNotFoundError as exc:
            raise self.damaged(array, key, "is missing") from exc
        except OSError as exc:
            raise storage_error(path, "open chunk", exc) from exc
        try:
            size = os.fstat(fd).st_size
            if size != nbytes:
                raise self.damaged(array, key, f"is {size} bytes, expected {nbytes} (truncated?)")
            fadvise_willneed(fd)
            if self.compressed:
                frame = self.buffer("frame", nbytes)
                got = preadv_all(fd, [frame], 0)
                body: Any = frame[: nbytes - TRAILER.size]
                parts: list[Any] = [body]
                trailer_bytes = frame[nbytes - TRAILER.size : nbytes].tobytes()
            else:
                trailer = self.buffer("trailer", TRAILER.size)
                got = preadv_all(fd, [dest, trailer], 0)
                parts = [dest]
                trailer_bytes = trailer.tobytes()
        except OSError as exc:
            if isinstance(exc, StorageError):
                raise
            raise storage_error(path, "read chunk", exc) from exc
        finally:
            os.close(fd)
        if got != nbytes:
            raise self.damaged(array, key, f"ended after {got} of {nbytes} bytes")
        actual = 0
        for part in parts:
            actual = crc32c_update(part, actual)
        stored = TRAILER.unpack(trailer_bytes)[0]
        if actual != stored:
            raise self.damaged(
                array, key, f"fails its crc32c (stored {stored:#010x}, computed {actual:#010x})"
            )
        if actual != crc:
            raise self.damaged(
                array, key, f"has crc32c {actual:#010x}, the index records {crc:#010x}"
            )
        if self.compressed:
            try:
                decode_into(parts[0], dest, len(dest))
            except ValueError as exc:
                raise self.damaged(array, key, f"does not decode: {exc}") from exc

    def read_flat(self, array: ArrayInfo, at: int, dest: ByteView,
                  cache: dict[int, ByteView]) -> None:
        """Fill ``dest`` with the bytes of elements ``[at, at + n)`` of a 1-D pack array.

        ``cache`` keeps decoded chunks between calls (the caller bounds its size).
        """
        isz = array.info.itemsize
        clen = array.chunk_shape[0]
        start, stop = at * isz, at * isz + len(dest)
        pos = start
        while pos < stop:
            index = pos // (clen * isz)
            chunk = cache.get(index)
            if chunk is None:
                if len(cache) >= 2:
                    cache.pop(next(iter(cache)))
                chunk = np.empty(array.chunk_nbytes, dtype=np.uint8)
                self.read(array, str(index), chunk)
                cache[index] = chunk
            lo = pos - index * clen * isz
            take = min(stop - pos, len(chunk) - lo)
            np.copyto(dest[pos - start : pos - start + take], chunk[lo : lo + take])
            pos += take


# --------------------------------------------------------------------------- requests
@dataclass(frozen=True)
class Request:
    """Copy ``[offsets, offsets+lengths)`` of a stored box (box coordinates) into ``target``.

    Attributes:
        box: The stored box.
        offsets: Start inside the box.
        lengths: Extent.
        target: A tensor of shape ``lengths`` (any device, possibly a view).
    """

    box: BoxLoc
    offsets: tuple[int, ...]
    lengths: tuple[int, ...]
    target: torch.Tensor


def _direct(target: torch.Tensor, dtype: torch.dtype) -> bool:
    return (
        target.device.type == "cpu"
        and target.dtype == dtype
        and target.is_contiguous()
        and not target.is_conj()
        and not target.is_neg()
    )


def _as_bytes(target: torch.Tensor) -> ByteView:
    view: ByteView = target.detach().reshape(-1).view(torch.uint8).numpy()
    return view


def _copy(req: Request, source: torch.Tensor) -> None:
    region = source[tuple(slice(o, o + n) for o, n in zip(req.offsets, req.lengths, strict=True))]
    with torch.no_grad():
        req.target.copy_(region)


def _serve_chunk(source: ChunkSource, req: Request) -> None:
    box, array = req.box, req.box.array
    assert box.key is not None
    info = array.info
    whole = req.lengths == array.chunk_shape and not any(req.offsets)
    if whole and _direct(req.target, info.torch_dtype):
        source.read(array, box.key, _as_bytes(req.target))
        return
    raw = source.buffer("chunk", array.chunk_nbytes)
    source.read(array, box.key, raw)
    _copy(req, torch.from_numpy(raw).view(info.torch_dtype).view(array.chunk_shape))


def _serve_packed(source: ChunkSource, reqs: Sequence[Request]) -> None:
    cache: dict[int, ByteView] = {}
    for req in reqs:
        box, array = req.box, req.box.array
        assert box.at is not None
        info = array.info
        nbytes = math.prod(box.sizes) * info.itemsize
        whole = req.lengths == box.sizes and not any(req.offsets)
        if whole and _direct(req.target, info.torch_dtype):
            source.read_flat(array, box.at, _as_bytes(req.target), cache)
            continue
        raw = source.buffer("piece", nbytes)
        source.read_flat(array, box.at, raw, cache)
        _copy(req, torch.from_numpy(raw).view(info.torch_dtype).view(box.sizes))


#: How many jobs ahead of the readers the kernel is asked to start reading chunk files.
PREFETCH_AHEAD = 8


def _prefetch(path: Path) -> None:
    """Hint the kernel to read a file ahead (cold loads overlap I/O with decoding)."""
    try:
        fd = os.open(path, os.O_RDONLY | _O_CLOEXEC)
    except OSError:
        return  # the read reports it
    try:
        fadvise_willneed(fd)
    finally:
        os.close(fd)


def run_requests(source: ChunkSource, requests: Sequence[Request], threads: int) -> None:
    """Serve every request: one job per chunk, packed pieces grouped by their first chunk.

    Each job first asks the kernel to read ahead the file of the job
    :data:`PREFETCH_AHEAD` places later, so a cold load keeps the disk busy while the
    threads decode.

    Raises:
        IntegrityError: On the first damaged chunk (the other jobs are cancelled).
    """
    work: list[tuple[Callable[[], None], Path]] = []
    packed: dict[tuple[str, int], list[Request]] = {}
    for req in requests:
        if any(n == 0 for n in req.lengths):
            continue
        if req.box.key is not None:
            path = source.directory / chunk_file(req.box.array.path, req.box.key)
            work.append((partial(_serve_chunk, source, req), path))
        else:
            assert req.box.at is not None
            chunk_elems = req.box.array.chunk_shape[0]
            packed.setdefault((req.box.array.path, req.box.at // chunk_elems), []).append(req)
    for (array, index), group in packed.items():
        group.sort(key=lambda r: r.box.at or 0)
        path = source.directory / chunk_file(array, str(index))
        work.append((partial(_serve_packed, source, group), path))

    def job(i: int) -> None:
        if i + PREFETCH_AHEAD < len(work):
            _prefetch(work[i + PREFETCH_AHEAD][1])
        work[i][0]()

    for i in range(min(PREFETCH_AHEAD, len(work))):
        _prefetch(work[i][1])
    if threads <= 1 or len(work) <= 1:
        for i in range(len(work)):
            job(i)
        return
    with ThreadPoolExecutor(threads, thread_name_prefix="ckpt-dcp-read") as pool:
        futures: list[Future[None]] = [pool.submit(job, i) for i in range(len(work))]
        try:
            for future in futures:
                future.result()
        except BaseException:
            for future in futures:
                future.cancel()
            raise


def load_blob(source: ChunkSource, blob: BlobItem) -> bytes:
    """The bytes of one non-tensor item."""
    out = np.empty(blob.nbytes, dtype=np.uint8)
    if blob.nbytes:
        source.read_flat(source.index.arrays[blob.array], blob.at, out, {})
    return out.tobytes()


# --------------------------------------------------------------------------- full loads
def _key_of(index: DcpIndex, fqn: str) -> str:
    parts = (index.planner_data or {}).get(fqn)
    if not parts:
        return escape_component(fqn)
    return "/".join(escape_component(p) for p in parts)


def _set_path(root: dict[str, Any], parts: Sequence[str | int], value: Any) -> None:
    node: Any = root
    for depth, part in enumerate(parts):
        last = depth == len(parts) - 1
        nxt = None if last else parts[depth + 1]
        if isinstance(node, list):
            assert isinstance(part, int)
            while len(node) <= part:
                node.append(None)
            if last:
                node[part] = value
            else:
                if node[part] is None:
                    node[part] = [] if isinstance(nxt, int) else {}
                node = node[part]
        else:
            if last:
                node[part] = value
            else:
                node = node.setdefault(part, [] if isinstance(nxt, int) else {})


def _safe_load(fqn: str, data: bytes) -> Any:
    try:
        return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        raise UnsafeObjectError(
            f"non-tensor item {fqn!r} needs arbitrary unpickling, which ckptstore refuses "
            f"when loading without a DCP planner: {str(exc).splitlines()[0]}; load it with "
            "dcp.load and a planner you trust, or save plain values (numbers, str, lists, dicts)"
        ) from exc


def load_full(
    directory: Path,
    manifest: Manifest,
    *,
    keys: Sequence[str] | None = None,
    threads: int = 2,
) -> dict[str, Any]:
    """Load a DCP checkpoint into full (unsharded) CPU tensors, without a process group.

    The nesting comes back from DCP's flatten mapping: dict keys as strings (DCP records
    every dict key as a string, so an optimizer's ``state[0]`` becomes ``"0"``), list
    positions as lists. Non-tensor items are read with ``torch.load(weights_only=True)``,
    never with arbitrary unpickling.

    Args:
        directory: The checkpoint directory.
        manifest: Its verified manifest.
        keys: fnmatch patterns over ``/``-joined key paths (``"model/*"``) or DCP fqns
            (``"model.layer.weight"``); only matching items are read.
        threads: Reader threads.

    Returns:
        The nested state (a flat ``{fqn: value}`` dict if DCP recorded no mapping).

    Raises:
        IntegrityError: On a damaged or missing chunk.
        InvalidNameError: If a key pattern matches nothing.
        UnsafeObjectError: If a non-tensor item would need arbitrary unpickling.
    """
    index = index_of(manifest)
    source = ChunkSource(directory, manifest.id, index)
    names = list(index.tensors) + list(index.blobs)
    if keys is not None:
        patterns = [keys] if isinstance(keys, str) else list(keys)
        chosen = [
            f for f in names if key_matches(_key_of(index, f), patterns) or key_matches(f, patterns)
        ]
        missing = [
            p for p in patterns
            if not any(key_matches(_key_of(index, f), [p]) or key_matches(f, [p]) for f in names)
        ]
        if missing:
            some = ", ".join(_key_of(index, f) for f in names[:8])
            raise InvalidNameError(
                f"key patterns {missing} match nothing in checkpoint {manifest.id}; "
                f"keys look like: {some or '(none)'}"
            )
        names = chosen
    boxes = stored_boxes(index)
    values: dict[str, Any] = {}
    requests: list[Request] = []
    for fqn in names:
        item = index.tensors.get(fqn)
        if item is None:
            continue
        out = torch.empty(item.shape, dtype=_dtype(item.dtype))
        values[fqn] = out
        for box in boxes[fqn]:
            view = out[tuple(slice(o, o + s) for o, s in zip(box.offsets, box.sizes, strict=True))]
            requests.append(Request(box, tuple(0 for _ in box.sizes), box.sizes, view))
    run_requests(source, requests, threads)
    for fqn in names:
        blob = index.blobs.get(fqn)
        if blob is not None:
            values[fqn] = _safe_load(fqn, load_blob(source, blob))
    if index.planner_data is None:
        return values
    root: dict[str, Any] = {}
    for fqn in sorted(values, key=lambda f: _key_of(index, f)):
        _set_path(root, index.planner_data.get(fqn) or (fqn,), values[fqn])
    return root


# --------------------------------------------------------------------------- verify
def verify_dcp(directory: Path, manifest: Manifest, *, deep: bool = True) -> list[str]:
    """Check every file of a DCP checkpoint against the index.

    Args:
        directory: The checkpoint directory.
        manifest: Its manifest.
        deep: Read every chunk and check its crc32c; otherwise sizes only.

    Returns:
        One line per problem; empty when intact.
    """
    directory = Path(directory)
    try:
        index = index_of(manifest)
    except IntegrityError as exc:
        return [str(exc)]
    problems: list[str] = []
    for path in index.arrays:
        if not (directory / path / ZARR_JSON).is_file():
            problems.append(f"{path}/{ZARR_JSON}: missing")

    def check(entry: tuple[str, int, int]) -> str | None:
        rel, nbytes, crc = entry
        path = directory / rel
        try:
            if not deep:
                size = path.stat().st_size
                return None if size == nbytes else f"{rel}: is {size} bytes, expected {nbytes}"
            data = path.read_bytes()
        except FileNotFoundError:
            return f"{rel}: missing"
        except OSError as exc:
            return f"{rel}: cannot read: {exc}"
        if len(data) != nbytes:
            return f"{rel}: is {len(data)} bytes, expected {nbytes}"
        body_crc = int(_crc32c.crc32c(data[: -TRAILER.size]))
        trailer = TRAILER.unpack(data[-TRAILER.size :])[0]
        if body_crc != trailer or body_crc != crc:
            return f"{rel}: crc32c {body_crc:#010x} differs from {crc:#010x}"
        return None

    with ThreadPoolExecutor(2, thread_name_prefix="ckpt-dcp-verify") as pool:
        problems += [p for p in pool.map(check, index.files()) if p is not None]
    if problems:
        logger.warning("checkpoint %s: %d problems", manifest.id, len(problems))
    return problems
