"""Delta encodings of one chunk against a base chunk (the mode of a save: ckptstore.deltaspec).

A delta-encoded chunk file (``enc`` in the manifest's chunk entry) holds a Blosc frame (LZ4,
or zstd in zstd-coded arrays) + crc32c trailer like any compressed chunk, but its payload is
relative to a *base chunk*: the chunk with the same array and index in the keyframe
checkpoint, stored ``raw``.

* ``xor`` (lossless): the payload is ``chunk XOR base``, bit-shuffled and compressed.
  Unchanged bits are zero, so a chunk that moved a little costs little; decoding is exact.
* ``q8`` / ``q4`` (lossy, opt-in): the payload is the element-wise difference
  ``chunk - base``, with changes below an absolute threshold dropped, quantized to signed
  8- or 4-bit codes with one float32 scale per block of elements (``scale = max|delta| /
  qmax``). The reconstruction is ``base + code * scale`` rounded to the array's dtype; the
  writer computes exactly what the reader will, so the recorded error is the true error.

Deltas are always taken against the keyframe's exact (lossless) chunk, never against
another delta, so errors never accumulate along a chain and every delta chunk needs exactly
one other file.

Payload of a quantized chunk (before compression), all little-endian::

    magic "CKQ1" | bits u8 | 3 pad bytes | elements u32 | block u32
    scales   float32[ceil(elements / block)]
    codes    int8[blocks * block]            (q8)
             uint8[blocks * block / 2]       (q4: two codes per byte, low nibble first,
                                             stored as code + 8)
"""

from __future__ import annotations

import logging
import math
import struct
import threading
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ckptstore.deltaspec import DEFAULT_BLOCK, DEFAULT_LOSSY_SCOPE, DeltaSpec, parse_delta
from ckptstore.format.codecs import CodecSpec, codec_spec, decode_into, encode_into
from ckptstore.format.dtypes import DtypeInfo

__all__ = [
    "DEFAULT_BLOCK",
    "DEFAULT_LOSSY_SCOPE",
    "DELTA_CODEC",
    "FAST_DELTA_CODEC",
    "DeltaSpec",
    "QuantResult",
    "dequantize_into",
    "parse_delta",
    "payload_codec",
    "quantize_chunk",
    "quantized_payload_size",
    "threshold_chunk",
    "xor_into",
]

logger = logging.getLogger(__name__)

#: Codec of delta-encoded chunk files in arrays whose codec is zstd (archive-oriented).
DELTA_CODEC: CodecSpec = codec_spec("zstd-1")
#: Codec of delta-encoded chunk files elsewhere: Blosc-LZ4 compresses XOR deltas of float
#: weights within ~5% of zstd-1 at ~2.5x its speed, which keeps a delta save as fast as a
#: full one. The reader decodes either (the Blosc frame names its compressor).
FAST_DELTA_CODEC: CodecSpec = codec_spec("lz4")


def payload_codec(array_codec: str) -> CodecSpec:
    """The codec for delta payloads of an array whose raw chunks use ``array_codec``."""
    return DELTA_CODEC if array_codec.startswith("zstd") else FAST_DELTA_CODEC

_HEADER = struct.Struct("<4sB3xII")
_MAGIC = b"CKQ1"
_QMAX = {8: 127, 4: 7}


# ---------------------------------------------------------------------------- xor
def xor_into(a: np.ndarray[Any, Any], b: np.ndarray[Any, Any], out: np.ndarray[Any, Any]) -> None:
    """``out = a ^ b`` over uint8 buffers of equal length (8 bytes at a time when possible)."""
    n = len(out)
    wide = n - n % 8
    if wide:
        np.bitwise_xor(a[:wide].view(np.uint64), b[:wide].view(np.uint64),
                       out=out[:wide].view(np.uint64))
    if wide < n:
        np.bitwise_xor(a[wide:n], b[wide:n], out=out[wide:n])


def encode_payload(
    payload: np.ndarray[Any, Any],
    typesize: int,
    out: np.ndarray[Any, Any],
    codec: CodecSpec = DELTA_CODEC,
) -> Any:
    """Compress a delta payload into ``out`` (bit-shuffled Blosc); return the frame."""
    return encode_into(codec, payload, typesize, out)


def decode_payload(frame: Any, dest: np.ndarray[Any, Any], nbytes: int) -> None:
    """Decompress a delta frame of exactly ``nbytes`` payload bytes into ``dest``.

    Raises:
        ValueError: If the frame is malformed or of another size.
    """
    decode_into(frame, dest, nbytes)


# ---------------------------------------------------------------------------- lossy
@dataclass(frozen=True)
class QuantResult:
    """A lossily encoded chunk.

    Attributes:
        payload: The payload bytes to compress (a view of a scratch buffer).
        max_abs_error: Largest ``|reconstructed - saved|`` over the chunk's elements.
        sum_abs_error: Sum of the absolute errors (for the mean).
        elements: Number of real (non-padding) elements.
    """

    payload: np.ndarray[Any, Any]
    max_abs_error: float
    sum_abs_error: float
    elements: int


def _compute_dtype(info: DtypeInfo) -> torch.dtype:
    return torch.float64 if info.name == "float64" else torch.float32


def _as_tensor(buf: np.ndarray[Any, Any], info: DtypeInfo, n: int) -> torch.Tensor:
    return torch.from_numpy(buf[: n * info.itemsize]).view(info.torch_dtype)


_SCRATCH = threading.local()


def _scratch(name: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
    """A per-thread scratch tensor of at least ``numel`` elements (reused across chunks)."""
    key = f"{name}:{dtype}"
    buf: torch.Tensor | None = getattr(_SCRATCH, key, None)
    if buf is None or buf.numel() < numel:
        buf = torch.empty(numel, dtype=dtype)
        setattr(_SCRATCH, key, buf)
    return buf[:numel]


def quantized_payload_size(n: int, bits: int, block: int) -> int:
    """Payload bytes of a quantized chunk of ``n`` elements."""
    blocks = -(-n // block)
    codes = blocks * block if bits == 8 else blocks * block // 2
    return _HEADER.size + 4 * blocks + codes


def _apply(
    base: torch.Tensor,
    codes: torch.Tensor,
    scales: torch.Tensor,
    n: int,
    info: DtypeInfo,
    out: torch.Tensor,
) -> None:
    """``out = base + codes * scale`` in the compute dtype, rounded to the array's dtype.

    The writer and the reader both call this, with the same operations in the same order
    (a separate multiply and add, never a fused one), so both get the same bits. ``out``
    holds ``n`` elements of the array's dtype and may be ``base`` itself.
    """
    cd = _compute_dtype(info)
    # One per-thread working buffer: a fresh one per chunk costs page faults. Copying the
    # int codes gives +0.0 for a zero code, as the reader's conversion does (a rounded float
    # grid could hold -0.0, and -0.0 + -0.0 keeps a sign bit that +0.0 + -0.0 does not).
    work = _scratch("work", codes.numel(), cd)
    work.copy_(codes)
    work.view(scales.numel(), -1).mul_(scales.to(cd).view(-1, 1))
    if info.torch_dtype == cd:
        # IEEE addition is commutative: this is exactly ``base + deq``.
        torch.add(work[:n], base, out=out)
    else:
        out.copy_(work[:n].add_(base.to(cd)).to(info.torch_dtype))


def quantize_chunk(
    new: np.ndarray[Any, Any],
    base: np.ndarray[Any, Any],
    info: DtypeInfo,
    n: int,
    *,
    bits: int,
    block: int,
    threshold: float | None,
    payload_out: np.ndarray[Any, Any],
    recon_out: np.ndarray[Any, Any],
) -> QuantResult | None:
    """Quantize ``new - base`` for one chunk.

    Every element pass over a multi-MB chunk costs about as much as hashing it, so this
    makes as few as it can: codes go straight into the payload, the reconstruction straight
    into ``recon_out``, and scratch buffers are reused per thread.

    Args:
        new: The chunk being saved (uint8 view, ``n * itemsize`` bytes at least).
        base: The keyframe's chunk (same size).
        info: The array's dtype.
        n: Elements in the chunk (padding included).
        bits: 8 or 4.
        block: Elements per scale.
        threshold: Changes below this absolute value are dropped (None: none dropped).
        payload_out: Scratch of at least :func:`quantized_payload_size` bytes.
        recon_out: Scratch receiving the reconstructed chunk bytes (what a load returns).

    Returns:
        The result, or None when the chunk holds non-finite values (then it must be stored
        losslessly: NaN/inf deltas cannot be quantized).
    """
    cd = _compute_dtype(info)
    qmax = _QMAX[bits]
    new_t = _as_tensor(new, info, n)
    base_t = _as_tensor(base, info, n)
    blocks = -(-n // block)
    padded = blocks * block
    delta = _scratch("delta", padded, cd)
    mag = _scratch("mag", padded, cd)
    delta[n:] = 0
    torch.sub(new_t.to(cd), base_t.to(cd), out=delta[:n])
    torch.abs(delta, out=mag)
    amax = mag.view(blocks, block).amax(dim=1)
    if not bool(torch.isfinite(amax).all()):
        # NaN/inf in either chunk: such deltas cannot be quantized.
        return None
    if threshold is not None:
        # Multiplying by a 0/1 mask is ~5x faster than masked_fill_; every value is finite
        # here, so the product is exactly the kept change or zero.
        keep = _scratch("keep", padded, cd)
        delta.mul_(torch.ge(mag, threshold, out=keep))
        # Dropping small changes leaves a block's largest change alone unless every change
        # in the block is dropped.
        amax.masked_fill_(amax < threshold, 0.0)
    scales = (amax / qmax).to(torch.float32)
    wide = scales.to(cd)
    # A block whose scale is zero or not a normal float32 keeps its codes at 0 (its error,
    # at most 127 * 1.2e-38, is measured below like any other). Every other inverse is
    # finite, and ``|delta| * inv <= qmax * (1 + a few ulps)`` rounds to at most qmax, so
    # the codes need no clamp.
    inv = torch.where(wide >= torch.finfo(torch.float32).tiny, 1.0 / wide,
                      torch.zeros((), dtype=cd))
    grid = delta.view(blocks, block)
    grid.mul_(inv.view(-1, 1)).round_()
    size = quantized_payload_size(n, bits, block)
    out = payload_out[:size]
    out[: _HEADER.size] = np.frombuffer(_HEADER.pack(_MAGIC, bits, n, block), dtype=np.uint8)
    pos = _HEADER.size
    out[pos : pos + 4 * blocks] = scales.numpy().view(np.uint8)
    pos += 4 * blocks
    if bits == 8:
        codes = torch.from_numpy(out[pos:]).view(torch.int8)
        codes.copy_(delta)
    else:
        codes = _scratch("codes", padded, torch.int8)
        codes.copy_(delta)
        # Codes + 8 fit a nibble; on the (little-endian) int16 view of each pair the first
        # code is the low byte, so both nibbles are gathered with contiguous operations.
        pairs = codes.add(8).view(torch.int16)
        torch.from_numpy(out[pos:]).copy_((pairs & 0x0F) | ((pairs >> 4) & 0xF0))
    recon = torch.from_numpy(recon_out[: n * info.itemsize]).view(info.torch_dtype)
    _apply(base_t, codes, scales, n, info, out=recon)
    # Into the (no longer needed) delta buffer.
    diff = torch.sub(recon.to(cd), new_t.to(cd), out=delta[:n]).abs_()
    peak = diff.max() if n else torch.zeros((), dtype=cd)
    if not bool(torch.isfinite(peak)):
        return None
    # The subtraction above rounds to the compute dtype; one step up in that dtype makes
    # the recorded bound an upper bound of the exact error.
    if bool(peak > 0):
        peak = torch.nextafter(peak, torch.tensor(math.inf, dtype=cd))
    worst = float(peak)
    # The sum only feeds the reported mean error: torch's pairwise float32 summation is
    # accurate enough for that and several times faster than accumulating in float64.
    total = float(diff.sum())
    return QuantResult(out, worst, total, n)


def dequantize_into(
    payload: np.ndarray[Any, Any],
    dest: np.ndarray[Any, Any],
    info: DtypeInfo,
    n: int,
    bits: int,
) -> None:
    """Reconstruct a quantized chunk in place: ``dest`` holds the base chunk on entry.

    Raises:
        ValueError: If the payload's header does not match the chunk.
    """
    if len(payload) < _HEADER.size:
        raise ValueError("quantized payload is shorter than its header")
    magic, got_bits, got_n, block = _HEADER.unpack_from(payload.data)
    if magic != _MAGIC or got_bits != bits or got_n != n or block < 2 or block % 2:
        raise ValueError(
            f"quantized payload header ({magic!r}, {got_bits} bits, {got_n} elements, block "
            f"{block}) does not match a {bits}-bit chunk of {n} elements"
        )
    if len(payload) != quantized_payload_size(n, bits, block):
        raise ValueError(f"quantized payload is {len(payload)} bytes, expected "
                         f"{quantized_payload_size(n, bits, block)}")
    blocks = -(-n // block)
    pos = _HEADER.size
    scales = torch.from_numpy(payload[pos : pos + 4 * blocks]).view(torch.float32)
    pos += 4 * blocks
    raw = torch.from_numpy(payload[pos:])
    if bits == 8:
        codes = raw.view(torch.int8)
    else:
        wide = raw.to(torch.int16)
        # The inverse of the packing: low nibble to the low byte of each int16 pair.
        codes = ((wide & 0x0F) | ((wide & 0xF0) << 4)).view(torch.int8) - 8
    base_t = _as_tensor(dest, info, n)
    _apply(base_t, codes, scales, n, info, out=base_t)


def threshold_chunk(
    new: np.ndarray[Any, Any],
    base: np.ndarray[Any, Any],
    info: DtypeInfo,
    n: int,
    threshold: float,
    recon_out: np.ndarray[Any, Any],
) -> QuantResult:
    """Drop element changes below ``threshold``: ``recon`` takes the base's exact bits there.

    The result is then stored XOR-encoded (mostly zero bits). Non-finite changes are kept.
    """
    cd = _compute_dtype(info)
    new_t = _as_tensor(new, info, n)
    base_t = _as_tensor(base, info, n)
    new_f = new_t.to(cd)
    drop = (new_f - base_t.to(cd)).abs() < threshold
    recon = torch.where(drop, base_t, new_t)
    np.copyto(recon_out[: n * info.itemsize], recon.view(torch.uint8).numpy())
    err = torch.where(drop, (recon.to(torch.float64) - new_t.to(torch.float64)).abs(),
                      torch.zeros((), dtype=torch.float64))
    payload = recon_out[: n * info.itemsize]
    return QuantResult(payload, float(err.max()) if n else 0.0,
                       float(err.sum(dtype=torch.float64)), n)
