"""Verified chunk reads of the DCP layout (bytes; the copies into tensors are in
:mod:`ckptstore.format.dcp.requests`).

Every chunk read is checked against its crc32c trailer and the index's record (size and
crc) before it is decoded; a missing, truncated or damaged chunk raises
:class:`~ckptstore.errors.IntegrityError` naming the checkpoint, the tensor and the file,
never reads as fill-value zeros.

Nothing here imports torch: the parts of a checkpoint saved across hosts are checked and moved
through this module by processes that never build a tensor (``ckpt show`` among them).
"""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path
from typing import Any

import numpy as np

from ckptstore.durable import storage_error
from ckptstore.errors import IntegrityError, StorageError
from ckptstore.format.codecs import TRAILER, codec_spec, crc32c_update, decode_into
from ckptstore.format.dcp.layout import ArrayInfo, BlobItem, DcpIndex, chunk_file
from ckptstore.format.fsio import fadvise_willneed, preadv_all

__all__ = ["ByteView", "ChunkSource", "flat_chunks", "load_blob"]

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
def load_blob(source: ChunkSource, blob: BlobItem) -> bytes:
    """The bytes of one non-tensor item."""
    out = np.empty(blob.nbytes, dtype=np.uint8)
    if blob.nbytes:
        source.read_flat(source.index.arrays[blob.array], blob.at, out, {})
    return out.tobytes()
