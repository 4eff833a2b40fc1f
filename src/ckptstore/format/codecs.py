"""Codec presets: how chunk bytes are encoded, and the matching Zarr v3 codec chain.

Every preset is ``bytes`` (+ optional ``blosc``) + ``crc32c``, all core Zarr v3 codecs, so any
Zarr v3 reader can decode our chunks. We encode with numcodecs' Blosc directly instead of
through zarr because zarr's per-chunk machinery costs more than the compression itself; a
test checks zarr decodes our bytes identically.

Why these settings (measured on model weights): bit-shuffle beats byte-shuffle on float
weights at the same speed, LZ4 level 1 is as fast as any level and compresses within 1% of
level 5 on weights, and zstd is offered for the archive tier where bytes cost more than CPU.

The default, ``auto``, chooses per array (:func:`auto_codec`): float arrays of at most 4 bytes
per element get Blosc-LZ4 with bit-shuffle when a sample of the array shrinks enough: to 95 %
for 1- and 2-byte floats (bf16 weights: ~75 %), to 90 % for fp32 (weights and AdamW moments:
85-88 %, measured on GPT-2 small; LZ4 decodes at several GB/s, so a load stays well under
``torch.load``'s time, and a save writes 12 % fewer bytes for little more CPU). fp64 and
integer arrays are stored raw. A save against a base keeps the base's choice per array, so a
chunk compares equal to its base chunk whenever its content does.
"""

from __future__ import annotations

import ctypes
import logging
import struct
from dataclasses import dataclass
from typing import Any

import crc32c as _crc32c
import numcodecs.blosc as _blosc
import numpy as np

__all__ = [
    "BLOSC_HEADER",
    "BLOSC_MAX_OVERHEAD",
    "ARRAY_CODECS",
    "AUTO",
    "AUTO_MAX_RATIO",
    "AUTO_MAX_RATIO_FP32",
    "CODEC_PRESETS",
    "TRAILER",
    "CodecSpec",
    "auto_codec",
    "auto_samples",
    "check_codec_setting",
    "codec_spec",
    "crc32c_combine",
    "crc32c_update",
    "decode_into",
    "encode",
    "encode_into",
    "max_encoded_size",
]

logger = logging.getLogger(__name__)

#: The default codec setting: chosen per array by :func:`auto_codec`.
AUTO = "auto"
#: Codecs an array's chunks are stored with.
ARRAY_CODECS: tuple[str, ...] = ("none", "lz4", "zstd-1", "zstd-3")
#: Names accepted for a save's ``codec`` setting.
CODEC_PRESETS: tuple[str, ...] = (AUTO, *ARRAY_CODECS)
#: ``auto`` compresses an array of 1- or 2-byte floats when a sample shrinks to this fraction
#: or less.
AUTO_MAX_RATIO = 0.95
#: ... and an array of 4-byte floats when it shrinks to this fraction or less: their bytes
#: cost more CPU per byte saved, so they must gain more.
AUTO_MAX_RATIO_FP32 = 0.90
#: Bytes of an array ``auto`` compresses to decide: 64 Ki fp32 values are plenty to tell, and
#: a save without a base samples every float array (GPT-2 small: 150 fp32 arrays, 76 ms of a
#: ~1 s save at 1 MiB each, 19 ms at this size).
AUTO_SAMPLE_BYTES = 256 * 1024

#: The crc32c codec appends the checksum of the encoded bytes as 4 little-endian bytes.
TRAILER = struct.Struct("<I")

#: Blosc 1 frame header: version, versionlz, flags, typesize, nbytes, blocksize, cbytes.
BLOSC_HEADER = struct.Struct("<BBBBIII")

#: Bytes Blosc may add to incompressible input (the frame header).
BLOSC_MAX_OVERHEAD = 16

# Blosc's bit-shuffle filter id.
_BITSHUFFLE = 2


@dataclass(frozen=True, slots=True)
class CodecSpec:
    """One preset.

    Attributes:
        name: Preset name (one of :data:`CODEC_PRESETS`).
        cname: Blosc compressor name, or None for the uncompressed preset.
        clevel: Blosc compression level (0 when uncompressed).
    """

    name: str
    cname: str | None
    clevel: int

    @property
    def compressed(self) -> bool:
        """Whether chunks are Blosc frames (False: raw bytes + trailer)."""
        return self.cname is not None


_SPECS = {
    "none": CodecSpec("none", None, 0),
    "lz4": CodecSpec("lz4", "lz4", 1),
    "zstd-1": CodecSpec("zstd-1", "zstd", 1),
    "zstd-3": CodecSpec("zstd-3", "zstd", 3),
}


def codec_spec(name: str) -> CodecSpec:
    """Return the array codec called ``name``.

    Raises:
        ValueError: If ``name`` is not one of :data:`ARRAY_CODECS` (``auto`` is resolved per
            array by :func:`auto_codec` first).
    """
    try:
        return _SPECS[name]
    except KeyError:
        if name == AUTO:
            raise ValueError("codec 'auto' is chosen per array (auto_codec)") from None
        raise ValueError(
            f"unknown codec {name!r}; choose one of {', '.join(CODEC_PRESETS)}"
        ) from None


def check_codec_setting(name: str) -> str:
    """Return ``name`` if it is a codec setting a save accepts (``auto`` or an array codec).

    Raises:
        ValueError: Naming the choices.
    """
    if name not in CODEC_PRESETS:
        raise ValueError(f"unknown codec {name!r}; choose one of {', '.join(CODEC_PRESETS)}")
    return name


def auto_samples(itemsize: int, is_float: bool) -> bool:
    """Whether :func:`auto_codec` looks at a sample of an array of this dtype at all.

    Floats of up to 4 bytes can gain from LZ4 (their sign and exponent bits repeat); for any
    other dtype the choice is ``none`` whatever the bytes.
    """
    return itemsize <= 4 and is_float


def auto_codec(itemsize: int, is_float: bool, sample: Any) -> str:
    """The codec ``auto`` stores an array with (see the module docstring).

    Args:
        itemsize: Bytes per element of the stored dtype.
        is_float: Whether the elements are floating point.
        sample: Up to :data:`AUTO_SAMPLE_BYTES` of the array's bytes (any buffer).

    Returns:
        ``"lz4"`` or ``"none"``.
    """
    data = _as_uint8(sample)
    if not auto_samples(itemsize, is_float) or len(data) < 4096:
        return "none"
    data = data[: AUTO_SAMPLE_BYTES - AUTO_SAMPLE_BYTES % itemsize]
    out = np.empty(max_encoded_size(len(data)), dtype=np.uint8)
    frame = encode_into(_SPECS["lz4"], data, itemsize, out)
    limit = AUTO_MAX_RATIO if itemsize <= 2 else AUTO_MAX_RATIO_FP32
    return "lz4" if len(frame) <= limit * len(data) else "none"


def crc32c_update(data: Any, crc: int = 0) -> int:
    """Extend a crc32c over ``data`` (any buffer); releases the GIL on large inputs."""
    return int(_crc32c.crc32c(data, crc))


#: The crc32c (Castagnoli) polynomial, bit-reversed as the reflected CRC uses it.
_CRC32C_POLY = 0x82F63B78


def _mult_mod_poly(a: int, b: int) -> int:
    """``a(x) * b(x) mod P(x)`` over GF(2), both reflected 32-bit polynomials."""
    product = 0
    bit = 1 << 31
    while a:
        if a & bit:
            product ^= b
            a ^= bit
        bit >>= 1
        b = (b >> 1) ^ _CRC32C_POLY if b & 1 else b >> 1
    return product


def _x_pow_2k_table() -> tuple[int, ...]:
    """``x^(2^k) mod P(x)`` for k = 0..31, each the square of the one before."""
    table = [1 << 30]  # x^1, reflected
    for _ in range(31):
        table.append(_mult_mod_poly(table[-1], table[-1]))
    return tuple(table)


_X_POW_2K = _x_pow_2k_table()


def crc32c_combine(crc_a: int, crc_b: int, len_b: int) -> int:
    """The crc32c of ``A + B`` from ``crc32c(A)``, ``crc32c(B)`` and ``len(B)``.

    Lets consecutive parts of one byte stream be checksummed on several threads and joined
    (a snapshot's read-back, ``ops/writing/snapshot.py``). Appending ``len_b`` bytes
    multiplies A's remainder by ``x^(8 * len_b)`` mod P; the CRCs' pre- and post-inversions
    cancel in the XOR with B's. O(log len_b) polynomial products: ~0.1 ms in Python.
    """
    if len_b <= 0:
        return crc_a
    shift = 1 << 31  # x^0, reflected
    n, k = len_b, 3  # x^(8 * len_b): the bits of len_b, starting at 2^3
    while n:
        if n & 1:
            shift = _mult_mod_poly(_X_POW_2K[k & 31], shift)
        n >>= 1
        k += 1
    return _mult_mod_poly(shift, crc_a) ^ crc_b


class _BloscContext:
    """Blosc's contextual (thread-safe, single-threaded) entry points, called directly.

    numcodecs' ``compress`` allocates a fresh output buffer per call and then shrinks it,
    which page-faults and copies ~8 MiB per chunk and halved compression throughput in our
    measurements. numcodecs' extension module exports c-blosc's ``blosc_compress_ctx`` /
    ``blosc_decompress_ctx``, which compress into a caller-owned buffer; if a numcodecs build
    does not export them we fall back to the numcodecs API (same frames, just slower).
    """

    def __init__(self) -> None:
        self.compress: Any = None
        self.decompress: Any = None
        try:
            lib = ctypes.CDLL(_blosc.__file__)
            compress = lib.blosc_compress_ctx
            decompress = lib.blosc_decompress_ctx
        except (OSError, AttributeError, TypeError):
            logger.debug("blosc ctx symbols unavailable; using numcodecs.blosc")
            return
        compress.argtypes = [
            ctypes.c_int,  # clevel
            ctypes.c_int,  # doshuffle
            ctypes.c_size_t,  # typesize
            ctypes.c_size_t,  # nbytes
            ctypes.c_void_p,  # src
            ctypes.c_void_p,  # dest
            ctypes.c_size_t,  # destsize
            ctypes.c_char_p,  # compressor
            ctypes.c_size_t,  # blocksize
            ctypes.c_int,  # numinternalthreads
        ]
        compress.restype = ctypes.c_int
        decompress.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        decompress.restype = ctypes.c_int
        self.compress = compress
        self.decompress = decompress


_CTX = _BloscContext()


def _as_uint8(data: Any) -> np.ndarray[Any, np.dtype[np.uint8]]:
    arr = np.frombuffer(data, dtype=np.uint8) if not isinstance(data, np.ndarray) else data
    if arr.dtype != np.uint8 or arr.ndim != 1 or not arr.flags.c_contiguous:
        arr = np.ascontiguousarray(arr).reshape(-1).view(np.uint8)
    return arr


def max_encoded_size(raw_nbytes: int) -> int:
    """Upper bound of a Blosc frame for ``raw_nbytes`` input (incompressible data is copied)."""
    return raw_nbytes + BLOSC_MAX_OVERHEAD


def encode_into(spec: CodecSpec, data: Any, itemsize: int, out: Any) -> Any:
    """Compress one chunk into ``out`` and return the used prefix of it.

    Blosc runs without internal threads: the writer parallelises across chunks instead.

    Args:
        spec: A compressed preset.
        data: The unencoded chunk bytes (any contiguous buffer).
        itemsize: Shuffle granularity, the element size of the stored dtype.
        out: Writable uint8 numpy buffer of at least :func:`max_encoded_size` bytes.
    """
    if spec.cname is None:
        raise ValueError("encode_into() needs a compressed preset")
    src = _as_uint8(data)
    if _CTX.compress is None:
        frame = _blosc.compress(src, spec.cname.encode(), spec.clevel, _BITSHUFFLE, 0, itemsize)
        out[: len(frame)] = np.frombuffer(frame, dtype=np.uint8)
        return out[: len(frame)]
    size = _CTX.compress(
        spec.clevel,
        _BITSHUFFLE,
        itemsize,
        src.nbytes,
        src.ctypes.data,
        out.ctypes.data,
        out.nbytes,
        spec.cname.encode(),
        0,
        1,
    )
    if size <= 0:
        raise ValueError(f"blosc compression failed with code {size}")
    return out[:size]


def encode(spec: CodecSpec, data: Any, itemsize: int) -> bytes:
    """Compress one chunk and return the frame as bytes (convenience for tests and tools)."""
    src = _as_uint8(data)
    out = np.empty(max_encoded_size(src.nbytes), dtype=np.uint8)
    return bytes(encode_into(spec, src, itemsize, out))


def decode_into(frame: Any, dest: Any, raw_nbytes: int) -> None:
    """Decompress one Blosc frame into ``dest``.

    The header is checked first so a frame that claims another size than the manifest's
    chunk can neither overflow ``dest`` nor leave part of it stale.

    Args:
        frame: The Blosc frame (encoded chunk without the crc trailer).
        dest: Writable buffer of at least ``raw_nbytes`` bytes.
        raw_nbytes: The decoded size the manifest promises.

    Raises:
        ValueError: If the frame is malformed or decodes to another size.
    """
    src = _as_uint8(frame)
    if src.nbytes < BLOSC_HEADER.size:
        raise ValueError(f"blosc frame of {src.nbytes} bytes is shorter than its header")
    _, _, _, _, nbytes, _, cbytes = BLOSC_HEADER.unpack_from(src.data)
    if nbytes != raw_nbytes or cbytes != src.nbytes:
        raise ValueError(
            f"blosc header says {nbytes} bytes from {cbytes}, "
            f"expected {raw_nbytes} from {src.nbytes}"
        )
    target = _as_uint8(dest)
    if target.nbytes < raw_nbytes or not target.flags.writeable:
        raise ValueError("destination buffer too small or read-only")
    if _CTX.decompress is None:
        try:
            _blosc.decompress(src, target)
        except (RuntimeError, ValueError) as exc:
            raise ValueError(f"blosc decompression failed: {exc}") from exc
        return
    size = _CTX.decompress(src.ctypes.data, target.ctypes.data, raw_nbytes, 1)
    if size != raw_nbytes:
        raise ValueError(f"blosc decompression failed with code {size}")
