"""Checking a chunk file held in memory against its manifest entry, content included.

A chunk's size and crc32c guard transport only: crc32c is linear, so anyone can change a
chunk's content and fix four bytes to keep both. What identifies a chunk is the blake3 of
its unencoded content that the manifest records (:class:`~ckptstore.format.manifest.ChunkEntry`).
:class:`~ckptstore.format.chunkio.ChunkReader` checks files on disk as a load reads them;
:func:`chunk_problem` checks the bytes a transfer from another store holds before they are
written anywhere (push, pull, sync, bundle import): it decodes them (the array's codec, or a
delta against its base chunk's bytes) and compares the content's blake3.
"""

from __future__ import annotations

from typing import Any

import blake3
import numpy as np

from ckptstore.format.codecs import BLOSC_HEADER, TRAILER, codec_spec, crc32c_update, decode_into
from ckptstore.format.dtypes import dtype_by_name
from ckptstore.format.manifest import ArrayEntry, BaseChunk, ChunkEntry, Manifest

__all__ = ["chunk_label", "chunk_problem"]

_Bytes = bytes | bytearray | memoryview


def chunk_label(manifest: Manifest, array: str, index: int) -> str:
    """``checkpoint <id>, tensor <keys> chunk <path>``: how messages name one chunk."""
    keys = manifest.tensors_in_chunk(array, index)
    shown = ", ".join(keys[:3]) + (f" (+{len(keys) - 3} more)" if len(keys) > 3 else "")
    return (f"checkpoint {manifest.id}, tensor {shown or '-'} chunk "
            f"{manifest.arrays[array].chunk_path(index)}")


def _frame_problem(data: _Bytes, nbytes: int, crc: int) -> str | None:
    if len(data) != nbytes:
        return f"is {len(data)} bytes, the manifest records {nbytes}"
    view = memoryview(data)
    got = crc32c_update(view[: -TRAILER.size], 0)
    trailer = TRAILER.unpack(view[-TRAILER.size :])[0]
    if got != trailer or got != crc:
        return f"has crc32c {got:#010x} (trailer {trailer:#010x}), the manifest records {crc:#010x}"
    return None


def _decode_raw(array: ArrayEntry, data: _Bytes) -> np.ndarray[Any, np.dtype[np.uint8]]:
    """The unencoded content of a ``raw`` chunk file (crc already checked)."""
    raw = array.chunk_nbytes
    body = np.frombuffer(data, dtype=np.uint8)[: len(data) - TRAILER.size]
    out = np.empty(raw, dtype=np.uint8)
    if codec_spec(array.codec).compressed:
        decode_into(body, out, raw)
    elif len(body) != raw:
        raise ValueError(f"holds {len(body)} bytes of an uncompressed {raw}-byte chunk")
    else:
        out[:] = body
    return out


def _apply_delta(array: ArrayEntry, chunk: ChunkEntry, data: _Bytes,
                 target: np.ndarray[Any, np.dtype[np.uint8]]) -> None:
    """Decode delta chunk file ``data`` onto ``target``, which holds its base's content."""
    # The delta codec computes with torch: loaded when a delta chunk is checked, not when a
    # catalog-only command imports this module (tests/cli/test_startup.py).
    from ckptstore.format.delta import (
        decode_payload,
        dequantize_into,
        quantized_payload_size,
        xor_into,
    )

    raw = array.chunk_nbytes
    body = np.frombuffer(data, dtype=np.uint8)[: len(data) - TRAILER.size]
    if chunk.enc == "xor":
        payload = np.empty(raw, dtype=np.uint8)
        decode_payload(body, payload, raw)
        xor_into(target, payload, target)
        return
    bits = 8 if chunk.enc == "q8" else 4
    info = dtype_by_name(array.torch_dtype)
    if info is None:
        raise ValueError(f"unknown dtype {array.torch_dtype!r}")
    # The block size is in the payload header; the frame header bounds the size first.
    size = int(BLOSC_HEADER.unpack_from(body.data)[4]) if len(body) >= BLOSC_HEADER.size else 0
    if size > quantized_payload_size(array.chunk_len, bits, 2):
        raise ValueError(f"payload of {size} bytes is too large for the chunk")
    payload = np.empty(size, dtype=np.uint8)
    decode_payload(body, payload, size)
    dequantize_into(payload, target, info, array.chunk_len, bits)


def chunk_problem(
    manifest: Manifest,
    array: str,
    index: int,
    data: _Bytes,
    *,
    base_data: _Bytes | None = None,
    as_base: BaseChunk | None = None,
) -> str | None:
    """Why ``data`` is not the file of chunk ``index`` of ``array``, or None when it is.

    The file must have the recorded size and crc32c, decode, and its content (for a delta
    chunk: the base's content with the delta applied) must hash to the recorded blake3.

    Args:
        manifest: The manifest that records the chunk.
        array: Array name.
        index: Chunk index.
        data: The chunk file's bytes, crc trailer included.
        base_data: For a delta-encoded chunk, its base chunk file's bytes.
        as_base: Check ``data`` as the base chunk this record describes (a ``raw`` file of
            the same array and index in the base checkpoint) instead of as the chunk itself.

    Returns:
        ``"<label>: <what is wrong>"`` (naming checkpoint, tensor and chunk), or None.
    """
    entry = manifest.arrays[array]
    chunk = entry.chunks[index]
    if as_base is not None:
        chunk = ChunkEntry(index, as_base.nbytes, as_base.crc32c, as_base.blake3, as_base.src)
    label = chunk_label(manifest, array, index)
    problem = _frame_problem(data, chunk.nbytes, chunk.crc32c)
    if problem is not None:
        return f"{label}: {problem}"
    try:
        if chunk.enc == "raw":
            content = _decode_raw(entry, data)
        else:
            base = chunk.base
            if base is None or base_data is None:
                return f"{label}: a delta chunk checked without its base chunk"
            problem = _frame_problem(base_data, base.nbytes, base.crc32c)
            if problem is not None:
                return f"{label}: its base chunk (checkpoint {base.src}) {problem}"
            content = _decode_raw(entry, base_data)
            _apply_delta(entry, chunk, data, content)
    except ValueError as exc:
        return f"{label}: does not decode ({exc})"
    digest = blake3.blake3(content.data).hexdigest()
    if digest != chunk.blake3:
        return (f"{label}: its content hashes to blake3 {digest}, the manifest records "
                f"{chunk.blake3} (same size and crc32c: forged or damaged)")
    return None
