"""Reading and checking single chunk files.

:class:`ChunkReader` fills caller-supplied destination buffers straight from a chunk file
(positional vectored reads for uncompressed chunks, so bytes land in the tensors' memory
without an intermediate copy) and verifies the crc32c trailer against both the bytes read
and the manifest. Any mismatch, missing or truncated file raises
:class:`~ckptstore.errors.IntegrityError`: a damaged chunk never reads as zeros.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ckptstore.errors import IntegrityError, MissingBaseError, StorageError
from ckptstore.format.codecs import TRAILER, codec_spec, crc32c_update, decode_into
from ckptstore.format.constants import COMMIT_NAME
from ckptstore.format.fsio import fadvise_willneed, preadv_all, storage_error
from ckptstore.format.manifest import ArrayEntry, ChunkEntry, Manifest

__all__ = ["ByteBuffer", "ChunkReader", "Dest", "Locate"]

logger = logging.getLogger(__name__)

#: Finds another checkpoint's directory by id.
Locate = Callable[[str], Path]
#: A uint8 numpy array.
ByteBuffer = np.ndarray[Any, np.dtype[np.uint8]]
#: (byte offset inside the unencoded chunk, writable uint8 buffer to fill from there).
Dest = tuple[int, ByteBuffer]

_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)


class ChunkReader:
    """Reads verified chunks of one checkpoint, following ``src`` to other checkpoints.

    Thread-safe: scratch buffers are per thread, base directories are resolved once.
    """

    def __init__(self, directory: Path, manifest: Manifest, locate: Locate | None) -> None:
        self.directory = Path(directory)
        self.manifest = manifest
        self._locate = locate
        self._bases: dict[str, Path | MissingBaseError] = {}
        self._lock = threading.Lock()
        self._local = threading.local()

    # -- locating -------------------------------------------------------------------------

    def chunk_path(self, array: ArrayEntry, chunk: ChunkEntry) -> Path:
        """Absolute path of a chunk file.

        Raises:
            MissingBaseError: If the chunk lives in another checkpoint that cannot be found.
        """
        root = self.directory if chunk.src is None else self._base_dir(chunk.src)
        return root / array.chunk_path(chunk.i)

    def _base_dir(self, ckpt_id: str) -> Path:
        with self._lock:
            found = self._bases.get(ckpt_id)
            if found is None:
                found = self._resolve(ckpt_id)
                self._bases[ckpt_id] = found
        if isinstance(found, MissingBaseError):
            raise found
        return found

    def _resolve(self, ckpt_id: str) -> Path | MissingBaseError:
        me = self.manifest.id
        if self._locate is None:
            return MissingBaseError(
                f"checkpoint {me} reads chunks from base checkpoint {ckpt_id}, but no locate "
                "function was given to find it"
            )
        try:
            path = Path(self._locate(ckpt_id))
        except Exception as exc:  # any failure to locate means the base is unavailable
            err = MissingBaseError(
                f"checkpoint {me} needs base checkpoint {ckpt_id}, which cannot be located: {exc}"
            )
            err.__cause__ = exc
            return err
        if not (path / COMMIT_NAME).is_file():
            return MissingBaseError(
                f"checkpoint {me} needs base checkpoint {ckpt_id}, but {path} holds no "
                "committed checkpoint; restore the base or re-save this checkpoint in full"
            )
        return path

    # -- reading --------------------------------------------------------------------------

    def buffer(self, name: str, size: int) -> ByteBuffer:
        """A per-thread scratch buffer of ``size`` bytes, reused across calls with ``name``.

        Reuse matters: a fresh multi-MiB allocation per chunk page-faults at ~2 GB/s.
        """
        buf: ByteBuffer | None = getattr(self._local, name, None)
        if buf is None or len(buf) < size:
            buf = np.empty(size, dtype=np.uint8)
            setattr(self._local, name, buf)
        return buf[:size]

    def damaged(self, array: ArrayEntry, index: int, path: Path | str, what: str) -> IntegrityError:
        """Build the error for a bad chunk, naming checkpoint, tensors and path."""
        keys = self.manifest.tensors_in_chunk(array.name, index)
        shown = ", ".join(keys[:5]) + (f" (+{len(keys) - 5} more)" if len(keys) > 5 else "")
        return IntegrityError(
            f"checkpoint {self.manifest.id}: chunk {path} (array {array.name} chunk {index}, "
            f"tensors {shown or '-'}) {what}; the checkpoint is damaged: restore it from "
            "another replica or an earlier checkpoint"
        )

    def read(self, array: ArrayEntry, index: int, dests: Sequence[Dest]) -> None:
        """Fill ``dests`` from chunk ``index`` of ``array`` and verify the chunk's crc32c.

        Args:
            array: The array entry.
            index: Chunk index.
            dests: Sorted, non-overlapping (offset, buffer) pairs inside the unencoded chunk.

        Raises:
            IntegrityError: On a missing, truncated or corrupted chunk.
            MissingBaseError: If the chunk's base checkpoint is gone.
            StorageError: On other OS errors.
        """
        chunk = array.chunks[index]
        path = self.chunk_path(array, chunk)
        try:
            fd = os.open(path, os.O_RDONLY | _O_CLOEXEC)
        except FileNotFoundError as exc:
            if chunk.src is not None:
                raise MissingBaseError(
                    f"checkpoint {self.manifest.id}: chunk {path} of base checkpoint "
                    f"{chunk.src} is missing; restore the base checkpoint"
                ) from exc
            raise self.damaged(array, index, path, "is missing") from exc
        except OSError as exc:
            raise storage_error(path, "open chunk", exc) from exc
        try:
            size = os.fstat(fd).st_size
            if size != chunk.nbytes:
                raise self.damaged(
                    array, index, path, f"is {size} bytes, expected {chunk.nbytes} (truncated?)"
                )
            # One hint for the whole file lets the kernel queue all of it at once on a cold
            # cache instead of ramping readahead up while we wait.
            fadvise_willneed(fd)
            if codec_spec(array.codec).compressed:
                self._read_compressed(fd, path, array, chunk, dests)
            else:
                self._read_raw(fd, path, array, chunk, dests)
        except OSError as exc:
            if isinstance(exc, StorageError):
                raise
            raise storage_error(path, "read chunk", exc) from exc
        finally:
            os.close(fd)

    def _check_crc(
        self, array: ArrayEntry, chunk: ChunkEntry, path: Path, crc: int, trailer: int
    ) -> None:
        if crc != trailer:
            raise self.damaged(
                array,
                chunk.i,
                path,
                f"fails its crc32c (stored {trailer:#010x}, computed {crc:#010x})",
            )
        if crc != chunk.crc32c:
            raise self.damaged(
                array,
                chunk.i,
                path,
                f"has crc32c {crc:#010x} but the manifest records {chunk.crc32c:#010x}",
            )

    def _read_raw(
        self, fd: int, path: Path, array: ArrayEntry, chunk: ChunkEntry, dests: Sequence[Dest]
    ) -> None:
        raw = array.chunk_nbytes
        iov: list[ByteBuffer] = []
        pos = 0
        scratch: ByteBuffer | None = None
        for offset, buf in dests:
            if offset > pos:
                # Bytes nobody asked for still go through the checksum, so they are read,
                # each into its own place in scratch.
                scratch = scratch if scratch is not None else self.buffer("scratch", raw)
                iov.append(scratch[pos:offset])
            iov.append(buf)
            pos = offset + len(buf)
        if pos < raw:
            scratch = scratch if scratch is not None else self.buffer("scratch", raw)
            iov.append(scratch[pos:raw])
        trailer = self.buffer("trailer", TRAILER.size)
        got = preadv_all(fd, [*iov, trailer], 0)
        if got != chunk.nbytes:
            raise self.damaged(array, chunk.i, path, f"ended after {got} of {chunk.nbytes} bytes")
        crc = 0
        for part in iov:
            crc = crc32c_update(part, crc)
        self._check_crc(array, chunk, path, crc, TRAILER.unpack(trailer.tobytes())[0])

    def _read_compressed(
        self, fd: int, path: Path, array: ArrayEntry, chunk: ChunkEntry, dests: Sequence[Dest]
    ) -> None:
        raw = array.chunk_nbytes
        frame = self.buffer("frame", chunk.nbytes)
        got = preadv_all(fd, [frame], 0)
        if got != chunk.nbytes:
            raise self.damaged(array, chunk.i, path, f"ended after {got} of {chunk.nbytes} bytes")
        body = frame[: chunk.nbytes - TRAILER.size]
        crc = crc32c_update(body, 0)
        stored = TRAILER.unpack(frame[-TRAILER.size :].tobytes())[0]
        self._check_crc(array, chunk, path, crc, stored)
        whole = len(dests) == 1 and dests[0][0] == 0 and len(dests[0][1]) == raw
        target = dests[0][1] if whole else self.buffer("scratch", raw)
        try:
            decode_into(body, target, raw)
        except ValueError as exc:
            raise self.damaged(array, chunk.i, path, f"does not decode: {exc}") from exc
        if not whole:
            for offset, buf in dests:
                np.copyto(buf, target[offset : offset + len(buf)])

    def prefetch(self, array: ArrayEntry, index: int) -> None:
        """Hint the kernel to start reading a chunk file; errors are ignored (read reports)."""
        try:
            path = self.chunk_path(array, array.chunks[index])
            fd = os.open(path, os.O_RDONLY | _O_CLOEXEC)
        except (OSError, MissingBaseError):
            return
        try:
            fadvise_willneed(fd)
        finally:
            os.close(fd)
