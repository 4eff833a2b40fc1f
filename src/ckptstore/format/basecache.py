"""The latest keyframe's chunks, kept in memory so xor/lossy delta saves need not read it back.

A delta save encodes each changed chunk against the keyframe's chunk. Reading that chunk back
(file read, crc32c, decompression) costs about as much as compressing the new chunk, which
made a delta save slower than a full one. The writer of a keyframe copies each chunk's
unencoded bytes here as it writes them; the deltas that follow take their base chunks from
here and fall back to reading the keyframe only for chunks that are not cached.

Every cached chunk is stored with the blake3 digest the writer computed from those same bytes
and is handed out only to a caller that asks for that digest (the one in the keyframe's
manifest), so a cache entry can never stand in for different content.

Call order: :meth:`KeyframeCache.begin` when a keyframe starts, :meth:`KeyframeCache.put`
from the writer threads for each of its chunks, then :meth:`KeyframeCache.get` from later
delta saves against that keyframe; :meth:`KeyframeCache.clear` releases the memory.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = ["KeyframeCache"]

_Chunk = tuple[str, np.ndarray[Any, np.dtype[np.uint8]]]


class KeyframeCache:
    """Unencoded chunks of one keyframe, bounded in bytes; thread-safe.

    Args:
        budget_bytes: Most bytes held. A keyframe larger than this is cached in part (its
            first chunks written); the rest is read back from disk by the delta saves.
    """

    def __init__(self, budget_bytes: int) -> None:
        if budget_bytes < 0:
            raise ValueError(f"budget_bytes must be >= 0, got {budget_bytes}")
        self.budget_bytes = budget_bytes
        self._lock = threading.Lock()
        self._ckpt_id: str | None = None
        self._chunks: dict[tuple[str, int], _Chunk] = {}
        self._used = 0
        # Buffers of the previous keyframe, reused: fresh multi-MB arrays page-fault on first
        # touch, which would add ~50% to the copy.
        self._spare: dict[int, list[np.ndarray[Any, np.dtype[np.uint8]]]] = {}

    @property
    def ckpt_id(self) -> str | None:
        """The keyframe whose chunks are cached (None: nothing cached)."""
        return self._ckpt_id

    @property
    def used_bytes(self) -> int:
        """Bytes of chunk data held now."""
        return self._used

    def begin(self, ckpt_id: str) -> None:
        """Start caching keyframe ``ckpt_id``; the previous keyframe's chunks are dropped."""
        with self._lock:
            for _, buf in self._chunks.values():
                self._spare.setdefault(len(buf), []).append(buf)
            self._chunks = {}
            self._used = 0
            self._ckpt_id = ckpt_id

    def put(self, ckpt_id: str, array: str, index: int, segments: Sequence[Any],
            digest: str) -> bool:
        """Copy one chunk of keyframe ``ckpt_id`` (its unencoded bytes, in pieces).

        Args:
            ckpt_id: The keyframe being written (ignored unless it is the one begun).
            array: Array name.
            index: Chunk index.
            segments: The chunk's bytes, in order (buffers; padding included).
            digest: Hex blake3 of exactly those bytes, as recorded in the manifest.

        Returns:
            True if the chunk was cached, False if over budget or for another keyframe.
        """
        size = sum(len(s) for s in segments)
        with self._lock:
            if ckpt_id != self._ckpt_id or self._used + size > self.budget_bytes:
                return False
            spare = self._spare.get(size)
            buf = spare.pop() if spare else None
            self._used += size
        if buf is None:
            buf = np.empty(size, dtype=np.uint8)
        pos = 0
        for seg in segments:
            np.copyto(buf[pos : pos + len(seg)], np.frombuffer(seg, dtype=np.uint8))
            pos += len(seg)
        with self._lock:
            if ckpt_id != self._ckpt_id:
                return False
            self._chunks[(array, index)] = (digest, buf)
        return True

    def get(self, ckpt_id: str, array: str, index: int, digest: str,
            nbytes: int) -> np.ndarray[Any, np.dtype[np.uint8]] | None:
        """The cached chunk of keyframe ``ckpt_id`` if it has ``digest`` and ``nbytes`` bytes.

        The returned array is shared: callers only read it.
        """
        with self._lock:
            if ckpt_id != self._ckpt_id:
                return None
            found = self._chunks.get((array, index))
        if found is None or found[0] != digest or len(found[1]) != nbytes:
            return None
        return found[1]

    def clear(self) -> None:
        """Drop every cached chunk and the spare buffers."""
        with self._lock:
            self._chunks = {}
            self._spare = {}
            self._used = 0
            self._ckpt_id = None
