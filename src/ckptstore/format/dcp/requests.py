"""Requests that copy boxes of a DCP-layout checkpoint into tensors, served by a pool of
readers over :class:`~ckptstore.format.dcp.chunks.ChunkSource` (every chunk verified there).

A read is a list of :class:`Request`: copy a sub-box of one stored box into a target view.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch

from ckptstore.format.dcp.boxes import BoxLoc
from ckptstore.format.dcp.chunks import ByteView, ChunkSource, flat_chunks
from ckptstore.format.dcp.layout import ArrayInfo, chunk_file
from ckptstore.format.fsio import fadvise_willneed
from ckptstore.format.pool import run_all

__all__ = ["PREFETCH_AHEAD", "ReadJob", "Request", "read_jobs", "run_jobs", "run_requests"]

_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)


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
