"""The record types of a manifest: its chunks, arrays, tensors, delta record and files.

A :class:`~ckptstore.format.manifest.Manifest` is built from these: each is a frozen value
with its JSON form (``to_dict``); the parser (:mod:`ckptstore.format.manifest.parse`) builds
them from validated JSON, the writers build them directly.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any, NamedTuple

from ckptstore.format.constants import chunk_rel

__all__ = [
    "DELTA_MODES",
    "ENCODINGS",
    "ArrayEntry",
    "BaseChunk",
    "ChunkEntry",
    "DeltaInfo",
    "FileEntry",
    "TensorEntry",
    "is_checkpoint_id",
]

#: How a chunk file encodes its chunk: ``raw`` (the array's codec), or a delta against a
#: base chunk (``xor``: lossless; ``q8``/``q4``: quantized, lossy). See
#: :mod:`ckptstore.format.delta`.
ENCODINGS: tuple[str, ...] = ("raw", "xor", "q8", "q4")
#: Delta modes recorded in :class:`DeltaInfo`.
DELTA_MODES: tuple[str, ...] = ("dedup", "xor", "lossy")


def is_checkpoint_id(value: object) -> bool:
    """Whether ``value`` is a canonical (lower-case, hyphenated) uuid string."""
    if not isinstance(value, str) or len(value) != 36:
        return False
    try:
        return str(uuid.UUID(value)) == value
    except ValueError:
        return False


@dataclass(frozen=True, slots=True)
class BaseChunk:
    """The base chunk a delta-encoded chunk is decoded against.

    It is the chunk with the same array name and index in checkpoint ``src``, stored ``raw``
    with the array's codec. Its size and hashes are recorded here so a reader can check the
    base file without the base's manifest (which may be gone once the base is pruned).

    Attributes:
        src: Id of the checkpoint whose directory holds the base chunk file.
        nbytes: Size of that file, crc trailer included.
        crc32c: crc32c of its encoded bytes.
        blake3: Hex blake3 of its unencoded content.
    """

    src: str
    nbytes: int
    crc32c: int
    blake3: str

    def to_dict(self) -> dict[str, Any]:
        """JSON form."""
        return {"src": self.src, "nbytes": self.nbytes, "crc32c": self.crc32c,
                "blake3": self.blake3}


@dataclass(frozen=True, slots=True)
class ChunkEntry:
    """One chunk of an array.

    Attributes:
        i: Chunk index (the zarr chunk key is ``<array>/c/<i>``).
        nbytes: Size of the stored file, crc trailer included.
        crc32c: crc32c of the encoded bytes (the value in the trailer).
        blake3: Hex blake3 of the unencoded chunk, padding included: the content hash used
            for dedup and deep verification. For a lossy chunk it is the hash of the
            reconstructed (approximate) content, which is what a load returns.
        src: None when this checkpoint holds the file, else the id of the checkpoint that does.
        enc: How the file encodes the chunk (one of :data:`ENCODINGS`); ``raw`` is plain Zarr.
        base: For a delta-encoded chunk, the base chunk it is decoded against; else None.
    """

    i: int
    nbytes: int
    crc32c: int
    blake3: str
    src: str | None = None
    enc: str = "raw"
    base: BaseChunk | None = None

    def to_dict(self) -> dict[str, Any]:
        """JSON form (``enc``/``base`` only when not raw, so full manifests stay unchanged)."""
        doc: dict[str, Any] = {
            "i": self.i,
            "nbytes": self.nbytes,
            "crc32c": self.crc32c,
            "blake3": self.blake3,
            "src": self.src,
        }
        if self.enc != "raw":
            doc["enc"] = self.enc
            doc["base"] = self.base.to_dict() if self.base is not None else None
        return doc

    def owners(self) -> list[str | None]:
        """Checkpoints whose chunk files reading this chunk opens (None: this checkpoint)."""
        return [self.src] if self.base is None else [self.src, self.base.src]


@dataclass(frozen=True, slots=True)
class DeltaInfo:
    """How a checkpoint was encoded relative to others (the manifest's ``delta`` object).

    Attributes:
        mode: ``dedup`` (identical chunks referenced), ``xor`` (changed chunks XOR-encoded
            against the keyframe) or ``lossy`` (as xor, with the tensors in ``scope``
            quantized).
        depth: Saves since the keyframe: 0 for a keyframe (or a dedup checkpoint), else the
            position in the chain whose keyframe is the manifest's ``base_id``.
        lossy: Whether any chunk holds approximate values.
        scope: Key patterns of the tensors stored lossily (lossy mode).
        threshold: Element changes below this absolute value were dropped (lossy mode).
        quantize: Bits of the quantized deltas (8 or 4), or None.
        block: Elements per quantization scale.
        max_abs_error: Largest absolute difference between a stored (reconstructed) value
            and the value that was saved; 0.0 when lossless.
        mean_abs_error: Mean absolute error over the lossily stored elements.
        lossy_elements: Number of elements stored lossily.
    """

    mode: str
    depth: int = 0
    lossy: bool = False
    scope: tuple[str, ...] = ()
    threshold: float | None = None
    quantize: int | None = None
    block: int | None = None
    max_abs_error: float = 0.0
    mean_abs_error: float = 0.0
    lossy_elements: int = 0

    def to_dict(self) -> dict[str, Any]:
        """JSON form."""
        return {
            "mode": self.mode,
            "depth": self.depth,
            "lossy": self.lossy,
            "scope": list(self.scope),
            "threshold": self.threshold,
            "quantize": self.quantize,
            "block": self.block,
            "max_abs_error": self.max_abs_error,
            "mean_abs_error": self.mean_abs_error,
            "lossy_elements": self.lossy_elements,
        }


@dataclass(frozen=True, slots=True)
class ArrayEntry:
    """One packed 1-D array (one per torch dtype).

    Attributes:
        name: Array name inside the group.
        torch_dtype: Torch dtype name of its elements.
        zarr_dtype: Zarr data type used on disk.
        itemsize: Bytes per element.
        length: Number of elements.
        chunk_len: Elements per chunk.
        codec: Codec preset of its chunks.
        chunks: One entry per chunk, in index order.
    """

    name: str
    torch_dtype: str
    zarr_dtype: str
    itemsize: int
    length: int
    chunk_len: int
    codec: str
    chunks: tuple[ChunkEntry, ...]

    @property
    def chunk_nbytes(self) -> int:
        """Unencoded bytes per chunk, padding included."""
        return self.chunk_len * self.itemsize

    def chunk_path(self, index: int) -> str:
        """Relative path of a chunk file (zarr v3 default chunk key encoding)."""
        return chunk_rel(self.name, index)

    def to_dict(self) -> dict[str, Any]:
        """JSON form."""
        return {
            "torch_dtype": self.torch_dtype,
            "zarr_dtype": self.zarr_dtype,
            "itemsize": self.itemsize,
            "length": self.length,
            "chunk_len": self.chunk_len,
            "codec": self.codec,
            "chunks": [c.to_dict() for c in self.chunks],
        }


@dataclass(frozen=True, slots=True)
class TensorEntry:
    """Where one tensor lives.

    Attributes:
        key: Tensor key.
        array: Array holding it.
        offset: First element in the array.
        numel: Number of elements.
        shape: Shape.
        torch_dtype: Torch dtype name.
        chunk_start: First chunk holding its elements.
        chunk_stop: One past the last chunk (equal to ``chunk_start`` when empty).
        cast: The tensor is not stored itself: its values are elements ``[offset, offset +
            numel)`` of ``array`` (a wider float dtype, normally another tensor's range)
            rounded to ``torch_dtype`` (format version 3; see
            :mod:`ckptstore.format.casts`).
    """

    key: str
    array: str
    offset: int
    numel: int
    shape: tuple[int, ...]
    torch_dtype: str
    chunk_start: int
    chunk_stop: int
    cast: bool = False

    def to_dict(self) -> dict[str, Any]:
        """JSON form (``cast`` only where set, so version-2 manifests keep their bytes)."""
        doc: dict[str, Any] = {
            "key": self.key,
            "array": self.array,
            "offset": self.offset,
            "numel": self.numel,
            "shape": list(self.shape),
            "torch_dtype": self.torch_dtype,
            "chunk_start": self.chunk_start,
            "chunk_stop": self.chunk_stop,
        }
        if self.cast:
            doc["cast"] = True
        return doc


class FileEntry(NamedTuple):
    """One file a checkpoint owns outside the packed arrays (another layout's, e.g. DCP's).

    Attributes:
        path: Relative path inside the checkpoint directory.
        nbytes: Its size.
        crc32c: When set, the file ends with the crc32c of the rest (the Zarr crc32c codec's
            trailer) and this is that value; None for files without a trailer (metadata).
    """

    path: str
    nbytes: int
    crc32c: int | None

    def to_list(self) -> list[Any]:
        """JSON form: ``[path, size, crc32c or null]``."""
        return [self.path, self.nbytes, self.crc32c]
