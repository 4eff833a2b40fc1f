"""Reading and checking single chunk files.

:class:`ChunkReader` fills caller-supplied destination buffers straight from a chunk file
(positional vectored reads for uncompressed chunks, so bytes land in the tensors' memory
without an intermediate copy) and verifies the crc32c trailer against both the bytes read
and the manifest. Any mismatch, missing or truncated file raises
:class:`~ckptstore.errors.IntegrityError`: a damaged chunk never reads as zeros.

Chunk files are opened without following a final symlink, and the directories between a
checkpoint directory and its chunk files (``<array>/c``) must be real directories: a planted
symlink there would make a load read another directory's files silently. Either is an
:class:`~ckptstore.errors.IntegrityError` naming the checkpoint and the array.

Chunks held by other checkpoints (dedup ``src``, and the base chunk of a delta-encoded chunk)
are read from the owner's directory by array and index, checked against the size and crc32c
recorded in *this* checkpoint's manifest. The owner need not be a committed checkpoint any
more: retention deletes a pruned checkpoint's marker and the chunks nobody reads, and keeps
the chunk files later checkpoints still reference.
"""

from __future__ import annotations

import errno
import logging
import os
import stat
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ckptstore.durable import storage_error
from ckptstore.errors import IntegrityError, MissingBaseError, StorageError
from ckptstore.format.codecs import (
    BLOSC_HEADER,
    TRAILER,
    codec_spec,
    crc32c_update,
    decode_into,
)
from ckptstore.format.dtypes import dtype_by_name
from ckptstore.format.fsio import fadvise_willneed, preadv_all
from ckptstore.format.manifest import ArrayEntry, BaseChunk, ChunkEntry, Manifest

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
        self._real_dirs: set[tuple[Path, str]] = set()
        self._lock = threading.Lock()
        self._local = threading.local()

    # -- locating -------------------------------------------------------------------------

    def chunk_path(self, array: ArrayEntry, chunk: ChunkEntry) -> Path:
        """Absolute path of a chunk file.

        A chunk of another checkpoint (``src``) is read from this checkpoint's own directory
        when it is there (hard-linked by a version-2 writer), else from its owner's.

        Raises:
            MissingBaseError: If the chunk lives in another checkpoint that cannot be found.
        """
        return self._located(array, chunk)[0]

    def _located(self, array: ArrayEntry, chunk: ChunkEntry) -> tuple[Path, str | None]:
        """``(path, owner)``: where the chunk file is read from, and whose it is there."""
        self._check_dirs(self.directory, array, chunk.i)
        own = self.directory / array.chunk_path(chunk.i)
        if chunk.src is None or os.path.lexists(own):
            return own, None
        root = self._base_dir(chunk.src)
        self._check_dirs(root, array, chunk.i)
        return root / array.chunk_path(chunk.i), chunk.src

    def base_path(self, array: ArrayEntry, index: int, base: BaseChunk) -> Path:
        """Absolute path of the base chunk file of delta chunk ``index``.

        Raises:
            MissingBaseError: If the base's checkpoint cannot be found.
        """
        root = self._base_dir(base.src)
        self._check_dirs(root, array, index)
        return root / array.chunk_path(index)

    def _check_dirs(self, root: Path, array: ArrayEntry, index: int) -> None:
        """Refuse a symlink (or anything but a directory) between ``root`` and the chunk files.

        Checked once per checkpoint directory and array; a missing directory is left to the
        open, which reports the chunk as missing.

        Raises:
            IntegrityError: If ``<array>`` or ``<array>/c`` is a symlink or not a directory.
        """
        if (root, array.name) in self._real_dirs:
            return
        path = root
        for part in (*array.name.split("/"), "c"):
            path = path / part
            try:
                mode = os.lstat(path).st_mode
            except FileNotFoundError:
                return
            except OSError as exc:
                raise storage_error(path, "inspect chunk directory", exc) from exc
            if stat.S_ISLNK(mode):
                raise self.damaged(array, index, path,
                                   "lies in a symlinked directory (chunk directories must be "
                                   "real directories inside the checkpoint)")
            if not stat.S_ISDIR(mode):
                raise self.damaged(array, index, path, "lies under a path that is not a "
                                                       "directory")
        with self._lock:
            self._real_dirs.add((root, array.name))

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
        # No COMMITTED marker is required: a pruned base keeps exactly the chunk files
        # later checkpoints read, and each is checked against this manifest's size and crc.
        if not path.is_dir():
            return MissingBaseError(
                f"checkpoint {me} needs chunks of checkpoint {ckpt_id}, but its directory "
                f"{path} does not exist; restore checkpoint {ckpt_id} (or this one from a "
                "tier that has both)"
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
        if chunk.enc != "raw":
            self._read_delta(array, chunk, dests)
            return
        path, owner = self._located(array, chunk)
        self._read_file(array, chunk, path, owner, dests)

    def _open(self, array: ArrayEntry, index: int, path: Path, owner: str | None) -> int:
        try:
            # Non-blocking and no final-link following: a FIFO planted as a chunk would
            # otherwise block the open forever; a link would read outside the checkpoint.
            fd = os.open(path, os.O_RDONLY | _O_CLOEXEC | os.O_NONBLOCK | os.O_NOFOLLOW)
        except FileNotFoundError as exc:
            if owner is not None:
                raise MissingBaseError(
                    f"checkpoint {self.manifest.id}: chunk {path} of checkpoint {owner} is "
                    f"missing; restore checkpoint {owner} (or re-save this one in full)"
                ) from exc
            raise self.damaged(array, index, path, "is missing") from exc
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise self.damaged(array, index, path, "is a symlink") from exc
            raise storage_error(path, "open chunk", exc) from exc
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise self.damaged(array, index, path, "is not a regular file")
        return fd

    def _read_file(
        self,
        array: ArrayEntry,
        chunk: ChunkEntry,
        path: Path,
        owner: str | None,
        dests: Sequence[Dest],
    ) -> None:
        """Read one raw-encoded chunk file (``chunk`` carries its expected size and crc)."""
        fd = self._open(array, chunk.i, path, owner)
        try:
            size = os.fstat(fd).st_size
            if size != chunk.nbytes:
                raise self.damaged(
                    array, chunk.i, path,
                    f"is {size} bytes, expected {chunk.nbytes} (truncated?)",
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

    def _read_delta(self, array: ArrayEntry, chunk: ChunkEntry, dests: Sequence[Dest]) -> None:
        """Read a delta-encoded chunk: its base chunk, then the delta applied on top."""
        # Loaded here, not at import: the delta codec computes with torch, and the catalog-only
        # commands reach this module without reading a chunk (tests/cli/test_startup.py).
        from ckptstore.format.delta import (
            decode_payload,
            dequantize_into,
            quantized_payload_size,
            xor_into,
        )

        base = chunk.base
        if base is None:  # the manifest parser guarantees a base; guard direct callers
            raise self.damaged(array, chunk.i, self.directory, "is a delta without a base")
        raw = array.chunk_nbytes
        whole = len(dests) == 1 and dests[0][0] == 0 and len(dests[0][1]) == raw
        # Decode straight into the destination when it is the whole chunk.
        target = dests[0][1] if whole else self.buffer("delta-target", raw)
        as_raw = ChunkEntry(chunk.i, base.nbytes, base.crc32c, base.blake3, base.src)
        self._read_file(array, as_raw, self.base_path(array, chunk.i, base), base.src,
                        [(0, target)])
        path = self.chunk_path(array, chunk)
        frame = self.buffer("frame", chunk.nbytes)
        fd = self._open(array, chunk.i, path, chunk.src)
        try:
            got = preadv_all(fd, [frame], 0)
        except OSError as exc:
            raise storage_error(path, "read chunk", exc) from exc
        finally:
            os.close(fd)
        if got != chunk.nbytes:
            raise self.damaged(array, chunk.i, path,
                               f"is {got} bytes, expected {chunk.nbytes} (truncated?)")
        body = frame[: chunk.nbytes - TRAILER.size]
        crc = crc32c_update(body, 0)
        stored = TRAILER.unpack(frame[-TRAILER.size :].tobytes())[0]
        self._check_crc(array, chunk, path, crc, stored)
        info = dtype_by_name(array.torch_dtype)
        assert info is not None  # the manifest was validated
        n = array.chunk_len
        try:
            if chunk.enc == "xor":
                payload = self.buffer("delta-payload", raw)
                decode_payload(body, payload, raw)
                xor_into(target, payload, target)
            else:
                bits = 8 if chunk.enc == "q8" else 4
                # The block size is in the payload header; the frame header bounds the size.
                size = _frame_nbytes(body)
                if size > quantized_payload_size(n, bits, 2):
                    raise ValueError(f"payload of {size} bytes is too large for the chunk")
                payload = self.buffer("delta-payload", size)
                decode_payload(body, payload, size)
                dequantize_into(payload, target, info, n, bits)
        except ValueError as exc:
            raise self.damaged(array, chunk.i, path, f"does not decode: {exc}") from exc
        if not whole:
            for offset, buf in dests:
                np.copyto(buf, target[offset : offset + len(buf)])

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
        """Hint the kernel to start reading a chunk's files; errors are ignored (read reports)."""
        chunk = array.chunks[index]
        try:
            paths = [self.chunk_path(array, chunk)]
            if chunk.base is not None:
                paths.append(self.base_path(array, index, chunk.base))
        except IntegrityError:  # MissingBaseError too; the read reports it
            return
        for path in paths:
            try:
                fd = os.open(path, os.O_RDONLY | _O_CLOEXEC | os.O_NONBLOCK | os.O_NOFOLLOW)
            except OSError:
                continue
            try:
                fadvise_willneed(fd)
            finally:
                os.close(fd)


def _frame_nbytes(frame: Any) -> int:
    """Decoded size a Blosc frame announces in its header (0 if it has none)."""
    view = np.frombuffer(frame, dtype=np.uint8) if not isinstance(frame, np.ndarray) else frame
    if len(view) < BLOSC_HEADER.size:
        return 0
    return int(BLOSC_HEADER.unpack_from(view.data)[4])
