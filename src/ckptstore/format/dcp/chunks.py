"""Verified chunk reads of the DCP layout, and the requests that copy boxes out of them.

Every chunk read is checked against its crc32c trailer and the index's record (size and
crc) before it is decoded; a missing, truncated or damaged chunk raises
:class:`~ckptstore.errors.IntegrityError` naming the checkpoint, the tensor and the file,
never reads as fill-value zeros.

A read is a list of :class:`Request`: copy a sub-box of one stored box into a target view.
"""

from __future__ import annotations

import logging
import math
import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ckptstore.durable import storage_error
from ckptstore.errors import IntegrityError, StorageError
from ckptstore.format.codecs import TRAILER, codec_spec, crc32c_update, decode_into
from ckptstore.format.dcp.boxes import BoxLoc
from ckptstore.format.dcp.layout import ArrayInfo, BlobItem, DcpIndex, chunk_file
from ckptstore.format.fsio import fadvise_willneed, preadv_all
from ckptstore.format.pool import run_all

__all__ = [
    "PREFETCH_AHEAD", "ByteView", "ChunkSource", "ReadJob", "Request", "flat_chunks",
    "load_blob", "read_jobs", "run_jobs", "run_requests",
]

logger = logging.getLogger(__name__)

_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
ByteView = np.ndarray[Any, np.dtype[np.uint8]]


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
        self._check(array, key, parts, trailer_bytes, crc, dest)

    def accept(self, array: ArrayInfo, key: str, frame: Any, dest: ByteView) -> None:
        """Like :meth:`read`, for a whole chunk file's bytes got elsewhere (another tier).

        Sources other than the checkpoint directory (a part of a checkpoint saved across
        hosts that lives in object storage) fetch the file and hand it here, so every chunk
        passes the same checks wherever it came from.

        Raises:
            IntegrityError: If the bytes are not the chunk the index records, fail their crc
                or will not decode.
        """
        record = array.chunks.get(key)
        if record is None:
            raise self.damaged(array, key, "is not in the index")
        nbytes, crc = record
        view = np.frombuffer(frame, dtype=np.uint8)
        if len(view) != nbytes:
            raise self.damaged(array, key, f"is {len(view)} bytes, expected {nbytes} (truncated?)")
        body = view[: nbytes - TRAILER.size]
        trailer_bytes = view[nbytes - TRAILER.size :].tobytes()
        if not self.compressed:
            if len(body) != len(dest):
                raise self.damaged(array, key, f"holds {len(body)} bytes, expected {len(dest)}")
            np.copyto(dest, body)
            body = dest
        self._check(array, key, [body], trailer_bytes, crc, dest)

    def _check(self, array: ArrayInfo, key: str, parts: list[Any], trailer_bytes: bytes,
               crc: int, dest: ByteView) -> None:
        """crc32c against the trailer and the index, then decode (compressed chunks)."""
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

        ``cache`` keeps up to two decoded chunks between calls of one thread, in that
        thread's scratch buffers (one per chunk parity: consecutive chunks, the usual reuse,
        stay together), so reading a pack costs no fresh pages. A thread uses one ``cache``
        at a time.
        """
        isz = array.info.itemsize
        clen = array.chunk_shape[0]
        start, stop = at * isz, at * isz + len(dest)
        pos = start
        while pos < stop:
            index = pos // (clen * isz)
            chunk = cache.get(index)
            if chunk is None:
                for held in [k for k in cache if k % 2 == index % 2]:
                    del cache[held]  # its buffer is about to be overwritten
                chunk = self.buffer(f"flat{index % 2}", array.chunk_nbytes)
                self.read(array, str(index), chunk)
                cache[index] = chunk
            lo = pos - index * clen * isz
            take = min(stop - pos, len(chunk) - lo)
            np.copyto(dest[pos - start : pos - start + take], chunk[lo : lo + take])
            pos += take


def flat_chunks(array: ArrayInfo, at: int, nbytes: int) -> range:
    """Indices of the chunks of a 1-D pack array holding ``nbytes`` bytes from element ``at``
    (what :meth:`ChunkSource.read_flat` reads)."""
    if nbytes <= 0:
        return range(0)
    span = array.chunk_shape[0] * array.info.itemsize
    start = at * array.info.itemsize
    return range(start // span, (start + nbytes - 1) // span + 1)


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


@dataclass(frozen=True)
class ReadJob:
    """One unit of :func:`run_requests`: a request of one chunk, or the packed pieces whose
    first chunk is the same (served in order, so a chunk they share is read once).

    Attributes:
        run: Serves the job's requests.
        path: Its first chunk file (the one read ahead).
        chunks: ``(array, chunk key)`` of every chunk it reads.
    """

    run: Callable[[], None]
    path: Path
    chunks: tuple[tuple[ArrayInfo, str], ...]


def read_jobs(source: ChunkSource, requests: Sequence[Request]) -> list[ReadJob]:
    """The jobs that serve ``requests`` (empty requests need none)."""
    jobs: list[ReadJob] = []
    packed: dict[tuple[str, int], list[Request]] = {}
    for req in requests:
        if any(n == 0 for n in req.lengths):
            continue
        box = req.box
        if box.key is not None:
            path = source.directory / chunk_file(box.array.path, box.key)
            jobs.append(ReadJob(partial(_serve_chunk, source, req), path,
                                ((box.array, box.key),)))
        else:
            assert box.at is not None
            chunk_elems = box.array.chunk_shape[0]
            packed.setdefault((box.array.path, box.at // chunk_elems), []).append(req)
    for (name, index), group in packed.items():
        group.sort(key=lambda r: r.box.at or 0)
        array = group[0].box.array
        keys: dict[str, None] = {}
        for req in group:
            assert req.box.at is not None
            nbytes = math.prod(req.box.sizes) * array.info.itemsize
            keys.update(dict.fromkeys(map(str, flat_chunks(array, req.box.at, nbytes))))
        jobs.append(ReadJob(partial(_serve_packed, source, group),
                            source.directory / chunk_file(name, str(index)),
                            tuple((array, key) for key in keys)))
    return jobs


def run_jobs(jobs: Sequence[ReadJob], threads: int) -> None:
    """Run ``jobs`` on ``threads`` threads, each first asking the kernel to read ahead the
    file of the job :data:`PREFETCH_AHEAD` places later, so a cold load keeps the disk busy
    while the threads decode.

    Raises:
        IntegrityError: On the first damaged chunk (the other jobs are cancelled).
    """

    def job(i: int) -> None:
        if i + PREFETCH_AHEAD < len(jobs):
            _prefetch(jobs[i + PREFETCH_AHEAD].path)
        jobs[i].run()

    for i in range(min(PREFETCH_AHEAD, len(jobs))):
        _prefetch(jobs[i].path)
    if threads <= 1 or len(jobs) <= 1:
        for i in range(len(jobs)):
            job(i)
        return
    with ThreadPoolExecutor(threads, thread_name_prefix="ckpt-dcp-read") as pool:
        run_all(pool, [partial(job, i) for i in range(len(jobs))])


def run_requests(source: ChunkSource, requests: Sequence[Request], threads: int) -> None:
    """Serve every request (:func:`read_jobs`, :func:`run_jobs`).

    Raises:
        IntegrityError: On the first damaged chunk (the other jobs are cancelled).
    """
    run_jobs(read_jobs(source, requests), threads)


def load_blob(source: ChunkSource, blob: BlobItem) -> bytes:
    """The bytes of one non-tensor item."""
    out = np.empty(blob.nbytes, dtype=np.uint8)
    if blob.nbytes:
        source.read_flat(source.index.arrays[blob.array], blob.at, out, {})
    return out.tobytes()
