"""The DCP index: the ``dcp`` section of ``manifest.json``, its records and its parser.

A checkpoint saved through the DCP layout (:mod:`ckptstore.format.dcp`) keeps its tensors in
N-d Zarr arrays and per-rank packs instead of the packed per-dtype arrays; the index says
which piece of which tensor lives in which array, and which chunk files were written. It is
JSON inside the manifest (covered by the manifest digest), so the manifest's parser
validates it when the manifest is read and :attr:`Manifest.dcp
<ckptstore.format.manifest.Manifest.dcp>` holds it parsed. That is why it lives here, below
``format/dcp/`` (which reads and writes the files it describes), with the chunk-key geometry
its checks need.

:meth:`DcpIndex.from_json` treats its input as hostile: it checks types, bounds, paths and
cross references, that pieces tile each tensor exactly, and that every chunk a piece needs
was written, so a reader never sees fill-value zeros where data is missing.
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ckptstore.format.codecs import ARRAY_CODECS, BLOSC_MAX_OVERHEAD, TRAILER
from ckptstore.format.constants import (
    CHUNK_DIR,
    DCP_ARRAY_GROUP,
    DCP_CHUNK_PREFIX,
    DCP_PACK_GROUP,
    DCP_RANK_GROUP,
)
from ckptstore.format.dtypes import DtypeInfo, dtype_by_name
from ckptstore.format.validate import (
    MAX_DIMS,
    MAX_ELEMENTS,
    dims,
    int_in,
    obj,
    rejecting,
    require,
    short,
)

__all__ = [
    "INDEX_VERSION",
    "READABLE_INDEX_VERSIONS",
    "ArrayInfo",
    "BlobItem",
    "Box",
    "DcpIndex",
    "Piece",
    "TensorItem",
    "chunk_file",
    "chunk_grid",
    "chunk_key",
    "chunks_of_piece",
]

logger = logging.getLogger(__name__)

#: Version of the index document.
INDEX_VERSION = 2
#: Index versions this build reads: version 1 (format 1 manifests) kept the tensors inside the
#: index; version 2 lists them in the manifest's common ``tensors`` index (docs/FORMAT.md).
READABLE_INDEX_VERSIONS = (1, 2)

#: (global offsets, sizes) of an N-d box.
Box = tuple[tuple[int, ...], tuple[int, ...]]

_ARRAY_PATH = re.compile(
    rf"^(?:{re.escape(DCP_ARRAY_GROUP)}/[A-Za-z0-9._%~-]{{1,220}}(?:@[0-9]{{1,9}})?"
    rf"|{re.escape(DCP_RANK_GROUP)}/r[0-9]{{1,9}}/[A-Za-z0-9._%~-]{{1,220}}(?:@[0-9]{{1,9}})?"
    rf"|{re.escape(DCP_PACK_GROUP)}/r[0-9]{{1,9}}\.[a-z0-9_]{{1,32}})$"
)
_CHUNK_KEY = re.compile(r"^(?:|[0-9]{1,12}(?:\.[0-9]{1,12}){0,63})$")
_MAX_FQN = 65536
_MAX_ITEMS = 1_000_000
_MAX_CHUNKS = 10_000_000
_MAX_RAW_CHUNK = 2**31  # Blosc's frame limit; a chunk is one frame


# --------------------------------------------------------------------------- geometry
def chunk_key(coords: Sequence[int]) -> str:
    """Index key of a chunk: its coordinates joined with ``.`` (``""`` for a 0-d array)."""
    return ".".join(str(c) for c in coords)


def chunk_file(array: str, key: str) -> str:
    """Relative path of a chunk file (zarr v3 default chunk-key encoding, separator ``.``)."""
    return f"{array}/{DCP_CHUNK_PREFIX}{key}" if key else f"{array}/{CHUNK_DIR}"


def chunk_grid(shape: Sequence[int], chunk_shape: Sequence[int]) -> tuple[int, ...]:
    """Number of chunks along each dimension."""
    return tuple(-(-s // c) for s, c in zip(shape, chunk_shape, strict=True))


def chunks_of_piece(
    origin: Sequence[int], chunk_shape: Sequence[int], offsets: Sequence[int], sizes: Sequence[int]
) -> Iterator[tuple[int, ...]]:
    """Chunk coordinates covering a piece of an array (the piece is chunk-aligned)."""
    if any(s == 0 for s in sizes):
        return
    ranges = [
        range((o - a) // c, -(-(o - a + s) // c))
        for a, c, o, s in zip(origin, chunk_shape, offsets, sizes, strict=True)
    ]
    yield from _product(ranges)


def _product(ranges: Sequence[range]) -> Iterator[tuple[int, ...]]:
    if not ranges:
        yield ()
        return
    for head in ranges[0]:
        for tail in _product(ranges[1:]):
            yield (head, *tail)


# --------------------------------------------------------------------------- the index
@dataclass(frozen=True)
class ArrayInfo:
    """One array of the layout.

    Attributes:
        path: Relative path (``dcp/<name>`` or ``dcp_packs/r<k>.<kind>``).
        dtype: Torch dtype name of the elements (``uint8`` for byte packs).
        shape: Array shape.
        chunk_shape: Chunk shape.
        chunks: Chunk key -> (file size, crc32c of the encoded bytes) for every chunk file.
    """

    path: str
    dtype: str
    shape: tuple[int, ...]
    chunk_shape: tuple[int, ...]
    chunks: dict[str, tuple[int, int]]

    @property
    def info(self) -> DtypeInfo:
        """Storage description of the dtype."""
        info = dtype_by_name(self.dtype)
        assert info is not None  # checked when parsed or built
        return info

    @property
    def chunk_nbytes(self) -> int:
        """Unencoded bytes of one chunk (edge chunks are padded to this size)."""
        return math.prod(self.chunk_shape) * self.info.itemsize

    def to_json(self) -> dict[str, Any]:
        """JSON form."""
        return {
            "dtype": self.dtype,
            "shape": list(self.shape),
            "chunk_shape": list(self.chunk_shape),
            "chunks": {k: list(v) for k, v in sorted(self.chunks.items())},
        }


@dataclass(frozen=True)
class Piece:
    """A box of a tensor held by one array.

    Attributes:
        offsets: Global offsets of the box.
        sizes: Its sizes.
        array: Path of the array holding it.
        origin: For a per-tensor array, the global offsets of the array's element 0 (the box
            is chunk-aligned in it); None for a pack.
        at: For a pack, the element offset of the box's first element (the box is stored
            flat, row-major); None for a per-tensor array.
    """

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    array: str
    origin: tuple[int, ...] | None = None
    at: int | None = None

    @property
    def numel(self) -> int:
        """Elements in the box."""
        return math.prod(self.sizes)

    def to_json(self) -> dict[str, Any]:
        """JSON form."""
        return {
            "offsets": list(self.offsets),
            "sizes": list(self.sizes),
            "array": self.array,
            "origin": None if self.origin is None else list(self.origin),
            "at": self.at,
        }


@dataclass(frozen=True)
class TensorItem:
    """One tensor of the DCP state dict.

    Attributes:
        fqn: Its DCP fully qualified name.
        dtype: Torch dtype name.
        shape: Global shape.
        requires_grad: As recorded by DCP.
        pieces: Where its elements are; they cover the tensor exactly once.
    """

    fqn: str
    dtype: str
    shape: tuple[int, ...]
    requires_grad: bool
    pieces: tuple[Piece, ...]

    def to_json(self) -> dict[str, Any]:
        """JSON form inside a version 1 index."""
        return {
            "dtype": self.dtype,
            "shape": list(self.shape),
            "requires_grad": self.requires_grad,
            "pieces": [p.to_json() for p in self.pieces],
        }

    def to_entry(self) -> dict[str, Any]:
        """JSON form in the manifest's common ``tensors`` index (format 2): the fields every
        tensor entry has (``key``, ``torch_dtype``, ``shape``, ``numel``) plus its pieces."""
        return {
            "key": self.fqn,
            "torch_dtype": self.dtype,
            "shape": list(self.shape),
            "numel": math.prod(self.shape),
            "requires_grad": self.requires_grad,
            "pieces": [p.to_json() for p in self.pieces],
        }


@dataclass(frozen=True)
class BlobItem:
    """One non-tensor item: the bytes DCP's planner produced with ``torch.save``.

    Attributes:
        fqn: Its DCP fully qualified name.
        array: The byte pack holding it.
        at: Offset of its first byte.
        nbytes: Its length.
    """

    fqn: str
    array: str
    at: int
    nbytes: int

    def to_json(self) -> dict[str, Any]:
        """JSON form."""
        return {"array": self.array, "at": self.at, "nbytes": self.nbytes}


@dataclass(frozen=True)
class DcpIndex:
    """Everything needed to find any element of a DCP checkpoint.

    Attributes:
        world_size: Ranks that saved it.
        codec: Codec preset of every chunk.
        arrays: Path -> array.
        tensors: FQN -> tensor, in save order.
        blobs: FQN -> non-tensor item.
        planner_data: DCP's flatten mapping (FQN -> path of keys/indices into the nested
            state), or None if the save planner recorded none.
        dcp_version: DCP's metadata version string.
    """

    world_size: int
    codec: str
    arrays: dict[str, ArrayInfo]
    tensors: dict[str, TensorItem]
    blobs: dict[str, BlobItem]
    planner_data: dict[str, tuple[str | int, ...]] | None
    dcp_version: str | None

    def to_json(self, version: int = INDEX_VERSION) -> dict[str, Any]:
        """JSON form (the value of ``extra["dcp"]`` in ``manifest.json``).

        Version 2 (format 2 manifests) leaves the tensors out: they are the manifest's
        ``tensors`` list (:meth:`tensor_entries`). Version 1 keeps them here.
        """
        doc: dict[str, Any] = {
            "version": version,
            "world_size": self.world_size,
            "codec": self.codec,
            "dcp_version": self.dcp_version,
            "arrays": {p: a.to_json() for p, a in self.arrays.items()},
            "blobs": {f: b.to_json() for f, b in self.blobs.items()},
            "planner_data": (
                None
                if self.planner_data is None
                else {f: list(parts) for f, parts in self.planner_data.items()}
            ),
        }
        if version == 1:
            doc["tensors"] = {f: t.to_json() for f, t in self.tensors.items()}
        return doc

    def tensor_entries(self) -> list[dict[str, Any]]:
        """The tensors as the manifest's common ``tensors`` list holds them (format 2)."""
        return [t.to_entry() for t in self.tensors.values()]

    @property
    def logical_bytes(self) -> int:
        """Bytes of the tensors and non-tensor items before encoding."""
        total = sum(
            math.prod(t.shape) * _itemsize(t.dtype) for t in self.tensors.values()
        )
        return total + sum(b.nbytes for b in self.blobs.values())

    @property
    def stored_bytes(self) -> int:
        """Bytes of all chunk files."""
        return sum(n for a in self.arrays.values() for n, _ in a.chunks.values())

    def files(self) -> list[tuple[str, int, int]]:
        """``(relative path, size, crc32c)`` of every chunk file."""
        return [
            (chunk_file(a.path, key), n, crc)
            for a in self.arrays.values()
            for key, (n, crc) in a.chunks.items()
        ]

    @classmethod
    def from_json(cls, doc: Any, entries: Any = None) -> DcpIndex:
        """Parse and validate an index read from a manifest (treated as hostile).

        Checks types, bounds, paths and cross references, that pieces tile each tensor
        exactly, and that every chunk a piece needs was written, so a reader never sees
        fill-value zeros where data is missing.

        Args:
            doc: The ``extra["dcp"]`` object.
            entries: A version 2 index's tensors: the manifest's ``tensors`` list (None for
                a version 1 index, which holds them itself).

        Raises:
            IntegrityError: On the first problem.
        """
        with rejecting("invalid DCP index in the manifest",
                       "; the checkpoint is damaged: restore it from another replica"):
            return _parse_index(doc, entries)


def _itemsize(dtype: str) -> int:
    info = dtype_by_name(dtype)
    return info.itemsize if info is not None else 0


# --------------------------------------------------------------------------- validation
def _count(value: Any, what: str) -> int:
    """An element or byte offset/count inside an array."""
    return int_in(value, what, 0, MAX_ELEMENTS)


def _dtype_name(value: Any, what: str) -> str:
    require(isinstance(value, str) and dtype_by_name(value) is not None, f"{what}: bad dtype")
    return str(value)


def _parse_index(doc: Any, entries: Any) -> DcpIndex:
    version = doc.get("version") if isinstance(doc, dict) else None
    require(version in READABLE_INDEX_VERSIONS and (version == 1) == (entries is None),
            f"index version {short(version)} is not supported here")
    fields = {"version", "world_size", "codec", "dcp_version", "arrays", "blobs",
              "planner_data"}
    top = obj(doc, "index", fields | {"tensors"} if version == 1 else fields)
    world_size = int_in(top["world_size"], "world_size", 1, 2**31)
    codec = top["codec"]
    require(codec in ARRAY_CODECS, f"codec must be one of {ARRAY_CODECS}")
    dcp_version = top["dcp_version"]
    require(dcp_version is None or (isinstance(dcp_version, str) and len(dcp_version) < 64),
            "dcp_version")
    arrays = _parse_arrays(top["arrays"], codec)
    tensors = _parse_tensors(top["tensors"] if entries is None else _from_entries(entries),
                             arrays)
    blobs = _parse_blobs(top["blobs"], arrays)
    require(not set(tensors) & set(blobs), "an fqn is both a tensor and a non-tensor item")
    planner_data = _parse_planner_data(top["planner_data"])
    return DcpIndex(world_size, codec, arrays, tensors, blobs, planner_data, dcp_version)


def _from_entries(raw: Any) -> dict[str, Any]:
    """The manifest's ``tensors`` list of a DCP checkpoint, keyed by fqn in the version 1
    index form (the common fields are checked against the tensor's own)."""
    require(isinstance(raw, list) and len(raw) <= _MAX_ITEMS, "tensors must be a list")
    out: dict[str, Any] = {}
    for i, entry in enumerate(raw):
        e = obj(entry, f"tensor {i}",
                {"key", "torch_dtype", "shape", "numel", "requires_grad", "pieces"})
        fqn = e["key"]
        require(isinstance(fqn, str) and fqn not in out, f"tensor {i}: bad or repeated key")
        shape = dims(e["shape"], f"tensor {i} shape")
        require(type(e["numel"]) is int and e["numel"] == math.prod(shape),
                f"tensor {i}: numel does not match its shape")
        out[fqn] = {"dtype": e["torch_dtype"], "shape": e["shape"],
                    "requires_grad": e["requires_grad"], "pieces": e["pieces"]}
    return out


def _parse_arrays(raw: Any, codec: str) -> dict[str, ArrayInfo]:
    require(isinstance(raw, dict) and len(raw) <= _MAX_ITEMS, "arrays must be an object")
    arrays: dict[str, ArrayInfo] = {}
    total = 0
    for path, entry in raw.items():
        require(bool(_ARRAY_PATH.match(path)), f"array path {path[:80]!r} is not allowed")
        where = f"array {path}"
        e = obj(entry, where, {"dtype", "shape", "chunk_shape", "chunks"})
        dtype = _dtype_name(e["dtype"], where)
        shape = dims(e["shape"], f"{where} shape")
        chunk_shape = dims(e["chunk_shape"], f"{where} chunk_shape", 1)
        require(len(chunk_shape) == len(shape), f"{where}: chunk_shape rank differs")
        raw_nbytes = math.prod(chunk_shape) * _itemsize(dtype)
        require(raw_nbytes <= _MAX_RAW_CHUNK, f"{where}: chunks of {raw_nbytes} bytes are too big")
        grid = chunk_grid(shape, chunk_shape)
        chunks_raw = e["chunks"]
        require(isinstance(chunks_raw, dict), f"{where}: chunks must be an object")
        total += len(chunks_raw)
        require(total <= _MAX_CHUNKS, "too many chunks")
        if codec == "none":
            lo, hi = raw_nbytes + TRAILER.size, raw_nbytes + TRAILER.size
        else:
            lo = BLOSC_MAX_OVERHEAD + TRAILER.size
            hi = raw_nbytes + BLOSC_MAX_OVERHEAD + TRAILER.size
        chunks: dict[str, tuple[int, int]] = {}
        for key, rec in chunks_raw.items():
            require(bool(_CHUNK_KEY.match(key)), f"{where}: bad chunk key {key[:40]!r}")
            coords = tuple(int(c) for c in key.split(".")) if key else ()
            require(
                len(coords) == len(shape) and all(c < g for c, g in zip(coords, grid, strict=True)),
                f"{where}: chunk {key} is outside the array",
            )
            require(isinstance(rec, list) and len(rec) == 2, f"{where} chunk {key}: bad record")
            chunks[key] = (
                int_in(rec[0], f"{where} chunk {key} size", lo, hi),
                int_in(rec[1], f"{where} chunk {key} crc32c", 0, 2**32 - 1),
            )
        arrays[path] = ArrayInfo(path, dtype, shape, chunk_shape, chunks)
    return arrays


def _parse_piece(raw: Any, where: str, shape: tuple[int, ...], dtype: str,
                 arrays: Mapping[str, ArrayInfo]) -> Piece:
    p = obj(raw, where, {"offsets", "sizes", "array", "origin", "at"})
    offsets = dims(p["offsets"], f"{where} offsets")
    sizes = dims(p["sizes"], f"{where} sizes")
    require(
        len(offsets) == len(sizes) == len(shape)
        and all(o + s <= n for o, s, n in zip(offsets, sizes, shape, strict=True)),
        f"{where}: box lies outside the tensor",
    )
    array = arrays.get(p["array"]) if isinstance(p["array"], str) else None
    require(array is not None, f"{where}: unknown array")
    assert array is not None
    require(array.dtype == dtype, f"{where}: array dtype differs from the tensor's")
    numel = math.prod(sizes)
    if p["at"] is not None:
        require(p["origin"] is None and len(array.shape) == 1, f"{where}: bad pack piece")
        at = _count(p["at"], f"{where} at")
        require(at + numel <= array.shape[0], f"{where}: lies outside its pack")
        _require_chunks(array, (at,), (numel,), (0,), where)
        return Piece(offsets, sizes, array.path, None, at)
    require(p["origin"] is not None, f"{where}: a piece needs origin or at")
    origin = dims(p["origin"], f"{where} origin")
    require(len(origin) == len(shape), f"{where}: origin rank differs")
    require(
        all(
            a <= o and o + s <= a + n and (o - a) % c == 0
            for a, o, s, n, c in zip(origin, offsets, sizes, array.shape, array.chunk_shape,
                                     strict=True)
        ),
        f"{where}: box is not chunk-aligned inside its array",
    )
    local = tuple(o - a for o, a in zip(offsets, origin, strict=True))
    _require_chunks(array, local, sizes, tuple(0 for _ in sizes), where)
    return Piece(offsets, sizes, array.path, origin, None)


def _require_chunks(array: ArrayInfo, start: tuple[int, ...], sizes: tuple[int, ...],
                    origin: tuple[int, ...], where: str) -> None:
    """Every chunk overlapping ``[start, start+sizes)`` of ``array`` must have been written."""
    for coords in chunks_of_piece(origin, array.chunk_shape, start, sizes):
        key = chunk_key(coords)
        require(key in array.chunks, f"{where}: chunk {chunk_file(array.path, key)} is missing")


def _parse_tensors(raw: Any, arrays: Mapping[str, ArrayInfo]) -> dict[str, TensorItem]:
    require(isinstance(raw, dict) and len(raw) <= _MAX_ITEMS, "tensors must be an object")
    tensors: dict[str, TensorItem] = {}
    for fqn, entry in raw.items():
        require(len(fqn) <= _MAX_FQN, "fqn too long")
        where = f"tensor {fqn[:200]!r}"
        e = obj(entry, where, {"dtype", "shape", "requires_grad", "pieces"})
        dtype = _dtype_name(e["dtype"], where)
        shape = dims(e["shape"], f"{where} shape")
        require(isinstance(e["requires_grad"], bool), f"{where}: requires_grad must be a bool")
        require(isinstance(e["pieces"], list), f"{where}: pieces must be a list")
        pieces = tuple(
            _parse_piece(p, f"{where} piece {i}", shape, dtype, arrays)
            for i, p in enumerate(e["pieces"])
        )
        # Pieces come from DCP's deduplicated plan and never overlap, so their volumes add
        # up to the tensor's exactly when none is missing.
        require(
            sum(p.numel for p in pieces) == math.prod(shape),
            f"{where}: its pieces do not cover it (a rank's shards are missing)",
        )
        tensors[fqn] = TensorItem(fqn, dtype, shape, e["requires_grad"], pieces)
    return tensors


def _parse_blobs(raw: Any, arrays: Mapping[str, ArrayInfo]) -> dict[str, BlobItem]:
    require(isinstance(raw, dict) and len(raw) <= _MAX_ITEMS, "blobs must be an object")
    blobs: dict[str, BlobItem] = {}
    for fqn, entry in raw.items():
        require(len(fqn) <= _MAX_FQN, "fqn too long")
        where = f"item {fqn[:200]!r}"
        e = obj(entry, where, {"array", "at", "nbytes"})
        array = arrays.get(e["array"]) if isinstance(e["array"], str) else None
        require(
            array is not None and array.dtype == "uint8" and len(array.shape) == 1,
            f"{where}: unknown or non-byte array",
        )
        assert array is not None
        at = _count(e["at"], f"{where} at")
        nbytes = _count(e["nbytes"], f"{where} nbytes")
        require(at + nbytes <= array.shape[0], f"{where}: lies outside its pack")
        _require_chunks(array, (at,), (nbytes,), (0,), where)
        blobs[fqn] = BlobItem(fqn, array.path, at, nbytes)
    return blobs


def _parse_planner_data(raw: Any) -> dict[str, tuple[str | int, ...]] | None:
    if raw is None:
        return None
    require(isinstance(raw, dict) and len(raw) <= _MAX_ITEMS, "planner_data must be an object")
    out: dict[str, tuple[str | int, ...]] = {}
    for fqn, parts in raw.items():
        require(
            isinstance(parts, list)
            and 0 < len(parts) <= MAX_DIMS
            and all(
                (isinstance(p, str) and len(p) <= _MAX_FQN)
                or (isinstance(p, int) and not isinstance(p, bool) and 0 <= p < 2**31)
                for p in parts
            ),
            f"planner_data of {fqn[:200]!r} must be a list of keys and indices",
        )
        out[fqn] = tuple(parts)
    return out
