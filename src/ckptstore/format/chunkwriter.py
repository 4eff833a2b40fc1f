"""Chunk files of the packed layout: one save's chunks written, hashed and flushed in parallel.

:class:`ChunkWriter` writes every chunk of every packed array on a small thread pool, at the
keys zarr v3 uses, from the tensors' own memory (or from the bytes a streamed state's source
produces for that chunk, :mod:`ckptstore.format.sources`): vectored writes of the tensor
segments that fall in the chunk (no gathered copy when uncompressed), crc32c and blake3
computed on the way (both release the GIL), early writeback so the final fsyncs find little
to do, and, with a base checkpoint, a reference to an identical base chunk or a delta
against it instead of the chunk. Going through zarr's own ``__setitem__`` measured ~2x
slower.

A chunk identical to the base's is recorded as the base's (``src``) and hard-linked into
this checkpoint's own directory, so the copy stays a complete Zarr array for any reader and
the file system's link count keeps the bytes alive as long as either checkpoint needs them.
Where a link cannot be made (another file system), the chunk is only referenced and the
array's ``zarr.json`` declares the chunk-reference codec (:mod:`ckptstore.format.zarrmeta`).

:func:`write_chunk_file` is the one way any layout writes a Zarr chunk with the crc32c codec
(the DCP layout uses it too), so the trailer and write-once rules are the same everywhere.
"""

from __future__ import annotations

import logging
import os
import stat
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import blake3
import numpy as np

from ckptstore.durable import fsync_many, storage_error
from ckptstore.errors import IntegrityError, StorageError
from ckptstore.format.basecache import KeyframeCache
from ckptstore.format.chunkio import ChunkReader
from ckptstore.format.codecs import (
    TRAILER,
    CodecSpec,
    crc32c_update,
    encode_into,
    max_encoded_size,
)
from ckptstore.format.constants import chunk_rel
from ckptstore.format.delta import (
    DeltaSpec,
    QuantResult,
    encode_payload,
    payload_codec,
    quantize_chunk,
    threshold_chunk,
    xor_into,
)
from ckptstore.format.fsio import create_exclusive, start_writeback, writev_all
from ckptstore.format.layout import ArrayPlan
from ckptstore.format.manifest import ArrayEntry, BaseChunk, BaseRef, ChunkEntry
from ckptstore.format.pool import cancel_on_error
from ckptstore.format.sources import TensorSource

__all__ = ["ChunkWriter", "ErrorStats", "write_chunk_file"]

logger = logging.getLogger(__name__)

# Above this many segments in one chunk, copying them into one buffer is cheaper than
# hashing and writing many tiny pieces.
_GATHER_ABOVE = 64

# Uncompressed chunks are hashed and written in pieces that fit in L2 cache.
_PIECE_BYTES = 1 << 20

# An XOR delta that compresses to more than this fraction of the chunk is not worth its
# dependency on the base: the chunk is written whole instead.
_XOR_WORTH = 0.9


@dataclass(frozen=True, slots=True)
class _Written:
    entry: ChunkEntry
    path: Path | None  # None when deduplicated against the base
    logical: int
    lossy: QuantResult | None = None  # error statistics of a lossily stored chunk
    linked: bool = False  # a deduplicated chunk hard-linked into this directory


@dataclass
class ErrorStats:
    """Error statistics over the lossily stored chunks of one save (for its DeltaInfo)."""

    max_abs: float = 0.0
    sum_abs: float = 0.0
    elements: int = 0

    def add(self, result: QuantResult, elements: int) -> None:
        """Count one lossily stored chunk of ``elements`` real (unpadded) elements."""
        self.max_abs = max(self.max_abs, result.max_abs_error)
        self.sum_abs += result.sum_abs_error
        self.elements += elements


class ChunkWriter:
    """Writes every chunk of every array of one save on a thread pool.

    Call order: construct (a keyframe save registers with ``cache`` here) → :meth:`run`
    once; then read :attr:`errors`.
    """

    def __init__(
        self,
        directory: Path,
        specs: dict[str, CodecSpec],
        sources: TensorSource,
        plans: dict[str, ArrayPlan],
        base: BaseRef | None,
        delta: DeltaSpec | None = None,
        *,
        ckpt_id: str = "",
        cache: KeyframeCache | None = None,
    ) -> None:
        self._directory = directory
        self._specs = specs
        self._sources = sources
        self._plans = plans
        self._local = threading.local()
        self._gather_size = max((p.chunk_nbytes for p in plans.values()), default=0)
        self._base_id = base.manifest.id if base is not None else None
        self._base_ref = base
        self._base: dict[str, ArrayEntry] = {}
        #: Arrays some of whose chunks are only referenced, not in this directory.
        self.incomplete: set[str] = set()
        self._delta = delta if delta is not None and delta.chained else None
        self._base_reader = (
            ChunkReader(base.directory, base.manifest, base.locate)
            if base is not None and self._delta is not None
            else None
        )
        self._errors_lock = threading.Lock()
        self.errors = ErrorStats()
        self._ckpt_id = ckpt_id
        self._cache = cache
        # A chained delta mode without a base writes a keyframe: the saves after it will
        # want its chunks.
        self._fill_cache = (
            cache is not None and delta is not None and delta.chained and base is None
        )
        if self._fill_cache:
            assert cache is not None
            cache.begin(ckpt_id)
        if base is not None:
            for name, plan in plans.items():
                old = base.manifest.arrays.get(name)
                if (
                    old is not None
                    and old.chunk_len == plan.chunk_len
                    and old.codec == specs[name].name
                    and old.torch_dtype == plan.info.name
                ):
                    self._base[name] = old

    def run(
        self,
        threads: int,
        progress: Callable[[int], None] | None,
        meanwhile: Callable[[], None] | None = None,
    ) -> tuple[dict[str, list[ChunkEntry]], int]:
        """Write all chunks, then fsync them; return entries per array and bytes written.

        Args:
            threads: Writer threads.
            progress: Called on this thread with the logical bytes of each finished chunk.
            meanwhile: Called once on this thread while the pool writes, before any result
                is collected: work that does not need the chunks overlaps their I/O
                instead of adding to the save. Its exception stops the save like a
                chunk's.
        """
        results: dict[str, list[ChunkEntry | None]] = {
            name: [None] * plan.n_chunks for name, plan in self._plans.items()
        }
        written: list[Path] = []
        stored = 0
        with ThreadPoolExecutor(threads, thread_name_prefix="ckpt-write") as pool:
            futures: list[tuple[str, Future[_Written]]] = [
                (name, pool.submit(self._write_chunk, plan, i))
                for name, plan in self._plans.items()
                for i in range(plan.n_chunks)
            ]
            # Stop queued chunks on a failure; running ones finish before the pool closes,
            # so no write happens after we return.
            with cancel_on_error(future for _, future in futures):
                if meanwhile is not None:
                    meanwhile()
                for name, future in futures:
                    done = future.result()
                    results[name][done.entry.i] = done.entry
                    if done.entry.src is not None and not done.linked:
                        self.incomplete.add(name)
                    if done.lossy is not None:
                        self.errors.add(done.lossy, done.lossy.elements)
                    if done.path is not None:
                        written.append(done.path)
                        stored += done.entry.nbytes
                    if progress is not None:
                        progress(done.logical)
                # Writeback of every file is already under way; these mostly just wait, many
                # at once (the file system commits waiting flushes together).
                fsync_many(written)
        entries = {name: [e for e in chunks if e is not None] for name, chunks in results.items()}
        return entries, stored

    def _buffer(self, name: str, size: int) -> np.ndarray[Any, np.dtype[np.uint8]]:
        # Per-thread buffers, reused for every chunk: fresh 8 MiB allocations per chunk
        # would page-fault at ~2 GB/s, slower than compressing.
        buf: np.ndarray[Any, np.dtype[np.uint8]] | None = getattr(self._local, name, None)
        if buf is None:
            buf = np.empty(size, dtype=np.uint8)
            setattr(self._local, name, buf)
        return buf

    def _write_chunk(self, plan: ArrayPlan, index: int) -> _Written:
        spec = self._specs[plan.name]
        segments: list[Any] = self._sources.read(
            [(member.key, first, stop) for member, first, stop in plan.chunk_members(index)]
        )
        logical = sum(len(s) for s in segments)
        pad = plan.chunk_nbytes - logical
        if pad:
            segments.append(np.zeros(pad, dtype=np.uint8))
        old_array = self._base.get(plan.name)
        old = (
            old_array.chunks[index]
            if old_array is not None and index < len(old_array.chunks)
            else None
        )
        # Delta encoding needs the base's exact chunk: only raw-encoded ones qualify.
        encode = self._delta is not None and old is not None and old.enc == "raw"
        if len(segments) > 1 and (
            spec.compressed or len(segments) > _GATHER_ABOVE or encode
        ):
            buf = self._buffer("gather", self._gather_size)
            pos = 0
            for seg in segments:
                np.copyto(buf[pos : pos + len(seg)], seg)
                pos += len(seg)
            segments = [buf[:pos]]

        path = self._directory / chunk_rel(plan.name, index)
        if old is None and not spec.compressed:
            streamed = self._stream_raw(path, index, segments, logical)
            if self._fill_cache:
                assert self._cache is not None
                self._cache.put(self._ckpt_id, plan.name, index, segments, streamed.entry.blake3)
            return streamed

        # A chunk stored lossily is hashed after quantization (its digest is that of what a
        # load returns); any other chunk first, so an unchanged one is referenced without
        # reading its base.
        lossy = encode and plan.lossy and self._delta is not None and bool(
            self._delta.quantize or self._delta.threshold)
        digest: str | None = None
        if not lossy:
            hasher = blake3.blake3()
            for seg in segments:
                hasher.update(seg)
            digest = hasher.hexdigest()
            if self._fill_cache:
                assert self._cache is not None
                self._cache.put(self._ckpt_id, plan.name, index, segments, digest)
            if old is not None and old.enc == "raw" and old.blake3 == digest:
                return self._reference(plan.name, old, digest, path, logical)
        if encode:
            assert old_array is not None and old is not None
            delta, digest = self._write_delta(plan, spec, index, old_array, old, segments[0],
                                              path, logical, digest)
            if delta is not None:
                return delta
        if digest is None:
            digest = blake3.blake3(segments[0]).hexdigest()
        payload: list[Any] = segments
        if spec.compressed:
            out = self._buffer("encoded", max_encoded_size(self._gather_size))
            payload = [encode_into(spec, segments[0], plan.info.itemsize, out)]
        crc, nbytes = self._write_file(path, payload)
        return _Written(ChunkEntry(index, nbytes, crc, digest, None), path, logical)

    def _reference(
        self,
        array: str,
        old: ChunkEntry,
        digest: str,
        path: Path,
        logical: int,
        lossy: QuantResult | None = None,
    ) -> _Written:
        """Record the chunk as the base's (identical) file, hard-linked here when possible."""
        owner = old.src or self._base_id
        entry = ChunkEntry(old.i, old.nbytes, old.crc32c, digest, owner)
        return _Written(entry, None, logical, lossy, linked=self._link(array, old, path))

    def _link(self, array: str, old: ChunkEntry, path: Path) -> bool:
        """Hard-link the base's file for ``old`` to ``path``; False where that is impossible."""
        base = self._base_ref
        if base is None:
            return False
        rel = chunk_rel(array, old.i)
        # A version-2 base holds every chunk it uses (its own or a link); a version-1 one
        # only its own, the rest is in the owner's directory.
        candidates = [base.directory / rel]
        if old.src is not None and base.locate is not None:
            try:
                candidates.append(Path(base.locate(old.src)) / rel)
            except Exception:  # an owner that cannot be located: the chunk stays a reference
                logger.debug("cannot locate checkpoint %s to link its chunk", old.src)
        for source in candidates:
            try:
                if not stat.S_ISREG(os.lstat(source).st_mode):
                    return False  # never carry a planted link or FIFO into this checkpoint
                os.link(source, path, follow_symlinks=False)
                return True
            except FileNotFoundError:
                continue
            except OSError as exc:
                # EXDEV (another file system), EPERM/EMLINK: reference without a link.
                logger.debug("cannot hard-link %s to %s (%s)", source, path, exc)
                return False
        return False

    def _write_file(self, path: Path, payload: list[Any]) -> tuple[int, int]:
        """Write ``payload`` + crc32c trailer to a new file; return (crc, bytes written)."""
        return write_chunk_file(path, payload)

    def _write_delta(
        self,
        plan: ArrayPlan,
        array_spec: CodecSpec,
        index: int,
        old_array: ArrayEntry,
        old: ChunkEntry,
        data: Any,
        path: Path,
        logical: int,
        digest: str | None,
    ) -> tuple[_Written | None, str | None]:
        """Store a chunk relative to the base's chunk: as a reference or a delta file.

        Args:
            digest: The chunk's blake3 when already computed (None: computed here).

        Returns:
            ``(written, digest)`` when done; ``(None, digest or None)`` when the chunk is to
            be written whole instead.
        """
        spec = self._delta
        assert spec is not None and self._base_reader is not None
        raw = plan.chunk_nbytes
        new = np.frombuffer(data, dtype=np.uint8) if not isinstance(data, np.ndarray) else data
        cached = (
            self._cache.get(self._base_id or "", plan.name, index, old.blake3, raw)
            if self._cache is not None
            else None
        )
        if cached is not None:
            base = cached
        else:
            base = self._buffer("base", self._gather_size)[:raw]
            try:
                self._base_reader.read(old_array, index, [(0, base)])
            except (IntegrityError, StorageError) as exc:
                # MissingBaseError is an IntegrityError. The save must not fail because its
                # keyframe is damaged: this chunk is simply stored whole.
                logger.warning("cannot read base chunk %s/%d of %s (%s); writing it whole",
                               plan.name, index, self._base_id, exc)
                return None, digest
        payload_buf = self._buffer("payload", self._gather_size + 64)
        n = plan.chunk_len
        real = max(0, min(n, plan.length - index * n))
        enc, typesize = "xor", plan.info.itemsize
        lossy: QuantResult | None = None
        payload: Any = None
        if plan.lossy and spec.quantize:
            recon = self._buffer("recon", self._gather_size)
            lossy = quantize_chunk(
                new, base, plan.info, n, bits=spec.quantize, block=spec.block,
                threshold=spec.threshold, payload_out=payload_buf, recon_out=recon,
            )
            if lossy is not None:
                enc, typesize, payload = f"q{spec.quantize}", 1, lossy.payload
                new = recon[:raw]
        elif plan.lossy and spec.threshold:
            recon = self._buffer("recon", self._gather_size)
            lossy = threshold_chunk(new, base, plan.info, n, spec.threshold, recon)
            new = recon[:raw]
        if lossy is not None or digest is None:
            # The digest is that of what a load returns: a lossy chunk's reconstruction.
            digest = blake3.blake3(new.data).hexdigest()
        if lossy is not None:
            # Error statistics count the real elements, not the tail padding (exact zeros).
            lossy = QuantResult(lossy.payload, lossy.max_abs_error, lossy.sum_abs_error, real)
        if old.blake3 == digest:
            # Every change of a lossy chunk dropped (or, with no digest passed in, none made):
            # reference the base's file.
            return self._reference(plan.name, old, digest, path, logical, lossy), digest
        if payload is None:
            payload = payload_buf[:raw]
            xor_into(new, base, payload)
        out = self._buffer("encoded", max_encoded_size(self._gather_size + 64))
        frame = encode_payload(payload, typesize, out, payload_codec(array_spec.name))
        if lossy is None and len(frame) > _XOR_WORTH * raw:
            return None, digest
        crc, nbytes = self._write_file(path, [frame])
        ref = BaseChunk(old.src or self._base_id or "", old.nbytes, old.crc32c, old.blake3)
        entry = ChunkEntry(index, nbytes, crc, digest, None, enc, ref)
        return _Written(entry, path, logical, lossy), digest

    def _stream_raw(self, path: Path, index: int, segments: list[Any], logical: int) -> _Written:
        """Write an uncompressed chunk piece by piece, hashing each piece just before.

        The kernel then copies each piece from cache instead of reading the chunk from
        memory a third time (measured ~15% faster than hashing the whole chunk first).
        Only used when no base chunk could make the write unnecessary.
        """
        hasher = blake3.blake3()
        crc = 0
        try:
            fd = create_exclusive(path)
            try:
                for seg in segments:
                    for start in range(0, len(seg), _PIECE_BYTES):
                        piece = seg[start : start + _PIECE_BYTES]
                        crc = crc32c_update(piece, crc)
                        hasher.update(piece)
                        writev_all(fd, [piece])
                writev_all(fd, [TRAILER.pack(crc)])
                start_writeback(fd)
            finally:
                os.close(fd)
        except OSError as exc:
            raise storage_error(path, "write chunk", exc) from exc
        nbytes = sum(len(seg) for seg in segments) + TRAILER.size
        entry = ChunkEntry(index, nbytes, crc, hasher.hexdigest(), None)
        return _Written(entry, path, logical)


def write_chunk_file(path: Path, payload: Sequence[Any]) -> tuple[int, int]:
    """Write ``payload`` + its crc32c trailer to a new chunk file, starting writeback.

    Shared by every layout that writes Zarr chunks with the crc32c codec (packed arrays here,
    the DCP backend's N-d arrays), so the trailer and write-once rules are the same everywhere.

    Returns:
        ``(crc32c, bytes written)``.

    Raises:
        StorageError: If the file exists or cannot be written.
    """
    crc = 0
    for part in payload:
        crc = crc32c_update(part, crc)
    try:
        fd = create_exclusive(path)
        try:
            nbytes = writev_all(fd, [*payload, TRAILER.pack(crc)])
            start_writeback(fd)
        finally:
            os.close(fd)
    except OSError as exc:
        raise storage_error(path, "write chunk", exc) from exc
    return crc, nbytes
