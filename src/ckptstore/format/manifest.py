"""The manifest: the index of one checkpoint, its JSON form, digest and validation.

``manifest.json`` is canonical JSON (sorted object keys, no whitespace, ASCII), so the same
manifest always has the same bytes and :attr:`Manifest.digest` identifies it. Order-carrying
parts are lists: tensors are listed in flatten order and the state tree encodes dicts as
key/value lists (see :mod:`ckptstore.format.tree`). ``extra`` is free caller metadata (plain
JSON; NaN/Infinity allowed; its object key order is not kept).

:meth:`Manifest.from_json` treats its input as hostile: it bounds sizes and counts, checks
every type, range and cross-reference, and raises :class:`~ckptstore.errors.IntegrityError`
on the first problem, before any of it is used to open files or allocate memory.
"""

from __future__ import annotations

import itertools
import json
import logging
import re
import threading
import uuid
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import blake3

from ckptstore.errors import IntegrityError
from ckptstore.format.codecs import CODEC_PRESETS
from ckptstore.format.constants import (
    FORMAT_VERSION,
    MAX_CHUNK_BYTES,
    MAX_JSON_ITEMS,
    MAX_MANIFEST_BYTES,
    MAX_TENSORS,
    MAX_TREE_DEPTH,
    MIN_CHUNK_BYTES,
)
from ckptstore.format.dtypes import dtype_by_name
from ckptstore.format.layout import chunk_span
from ckptstore.format.tree import validate_tree

__all__ = [
    "ENCODINGS",
    "ArrayEntry",
    "BaseChunk",
    "BaseRef",
    "ChunkEntry",
    "DeltaInfo",
    "Manifest",
    "TensorEntry",
    "clear_manifest_cache",
    "is_checkpoint_id",
    "manifest_digest",
    "parse_verified",
    "remember_manifest",
]

logger = logging.getLogger(__name__)

_ARRAY_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,63}$")
_BLAKE3_HEX = re.compile(r"^[0-9a-f]{64}$")
_MAX_DIMS = 64
_MAX_ELEMENTS = 2**53
_MAX_KEY_CHARS = 65536
_MAX_RUN_CHARS = 1024
_MAX_CHUNKS = 10_000_000
_BLOSC_OVERHEAD = 16 + 4  # frame header + crc trailer
_MAX_SCOPE = 256

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


def manifest_digest(data: bytes) -> str:
    """Hex blake3 of manifest bytes: the value in ``COMMITTED`` and the catalog."""
    return blake3.blake3(data).hexdigest()


#: Parsed manifests by digest, newest last. Parsing and validating a manifest of a few
#: hundred tensors takes ~10 ms, hashing its bytes ~0.1 ms: a delta save reads its base's
#: and its keyframe's manifests, a load and a progressive load read one, mostly the same few.
_PARSED: OrderedDict[str, Manifest] = OrderedDict()
_PARSED_LOCK = threading.Lock()
_PARSED_MAX = 64


def parse_verified(data: bytes, digest: str) -> Manifest:
    """Parse manifest bytes whose blake3 the caller computed and checked as ``digest``.

    Identical bytes parse to an identical manifest, so a digest seen before returns the
    manifest parsed then (manifests are frozen: treat the shared one as read-only).

    Raises:
        IntegrityError: As :meth:`Manifest.from_json`.
    """
    with _PARSED_LOCK:
        found = _PARSED.get(digest)
        if found is not None:
            _PARSED.move_to_end(digest)
            return found
    manifest = Manifest.from_json(data)
    remember_manifest(manifest, digest)
    return manifest


def clear_manifest_cache() -> None:
    """Forget every parsed manifest (the next read of each parses it again)."""
    with _PARSED_LOCK:
        _PARSED.clear()


def remember_manifest(manifest: Manifest, digest: str) -> None:
    """Cache ``manifest`` as the parse of the bytes with ``digest`` (its writer knows them)."""
    with _PARSED_LOCK:
        _PARSED[digest] = manifest
        _PARSED.move_to_end(digest)
        while len(_PARSED) > _PARSED_MAX:
            _PARSED.popitem(last=False)


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
        return f"{self.name}/c/{index}"

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
    """

    key: str
    array: str
    offset: int
    numel: int
    shape: tuple[int, ...]
    torch_dtype: str
    chunk_start: int
    chunk_stop: int

    def to_dict(self) -> dict[str, Any]:
        """JSON form."""
        return {
            "key": self.key,
            "array": self.array,
            "offset": self.offset,
            "numel": self.numel,
            "shape": list(self.shape),
            "torch_dtype": self.torch_dtype,
            "chunk_start": self.chunk_start,
            "chunk_stop": self.chunk_stop,
        }


@dataclass(frozen=True)
class Manifest:
    """Index of one checkpoint. See DESIGN.md "The checkpoint format".

    Attributes:
        format_version: Layout version (:data:`~ckptstore.format.constants.FORMAT_VERSION`).
        id: Checkpoint id (uuid).
        run: Run name.
        step: Training step.
        created_at: ISO-8601 creation time (UTC).
        kind: ``"full"``, or ``"delta"`` when some chunks live in other checkpoints.
        base_id: The base checkpoint of a delta, else None.
        codec: Codec preset used for the chunks this checkpoint wrote.
        chunk_bytes: Target chunk size the writer used.
        arrays: Array name -> entry.
        tensors: Tensor key -> entry, in flatten order.
        tree: JSON skeleton of the state.
        logical_bytes: Sum of the stored tensors' sizes.
        stored_bytes: Bytes of chunk files this checkpoint physically wrote.
        extra: Free-form JSON metadata from the caller.
        delta: How it was encoded relative to other checkpoints (None: written without a
            delta mode; a ``kind == "delta"`` manifest without it is a plain dedup delta).
    """

    format_version: int
    id: str
    run: str
    step: int
    created_at: str
    kind: str
    base_id: str | None
    codec: str
    chunk_bytes: int
    arrays: dict[str, ArrayEntry]
    tensors: dict[str, TensorEntry]
    tree: Any
    logical_bytes: int
    stored_bytes: int
    extra: dict[str, Any] = field(default_factory=dict)
    delta: DeltaInfo | None = None

    def to_json(self) -> bytes:
        """Canonical JSON bytes (deterministic: same manifest, same bytes)."""
        doc = {
            "format_version": self.format_version,
            "id": self.id,
            "run": self.run,
            "step": self.step,
            "created_at": self.created_at,
            "kind": self.kind,
            "base_id": self.base_id,
            "codec": self.codec,
            "chunk_bytes": self.chunk_bytes,
            "arrays": {name: a.to_dict() for name, a in self.arrays.items()},
            "tensors": [t.to_dict() for t in self.tensors.values()],
            "tree": self.tree,
            "logical_bytes": self.logical_bytes,
            "stored_bytes": self.stored_bytes,
            "extra": self.extra,
        }
        if self.delta is not None:
            # Only when set: manifests written without a delta mode keep their exact bytes.
            doc["delta"] = self.delta.to_dict()
        return json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode(
            "ascii"
        )

    @property
    def digest(self) -> str:
        """Hex blake3 of :meth:`to_json`."""
        return manifest_digest(self.to_json())

    def tensor_keys(self) -> list[str]:
        """Tensor keys in flatten order."""
        return list(self.tensors)

    def referenced_checkpoints(self) -> set[str]:
        """Ids of other checkpoints whose chunk files this one reads (dedup and delta bases)."""
        return {
            owner
            for a in self.arrays.values()
            for c in a.chunks
            for owner in c.owners()
            if owner is not None
        }

    def chunk_refs(self) -> list[tuple[str, str, int]]:
        """Every chunk file a full read opens: ``(owner id, array name, chunk index)``.

        Includes the checkpoint's own files, chunks it references in other checkpoints
        (``src``) and the base chunks its delta-encoded chunks are decoded against.
        """
        refs: dict[tuple[str, str, int], None] = {}
        for a in self.arrays.values():
            for c in a.chunks:
                for owner in c.owners():
                    refs.setdefault((owner or self.id, a.name, c.i))
        return list(refs)

    @property
    def lossy(self) -> bool:
        """Whether some values are stored approximately (see :attr:`delta`)."""
        return self.delta is not None and self.delta.lossy

    def tensors_in_chunk(self, array: str, index: int) -> list[str]:
        """Keys of the tensors with elements in chunk ``index`` of ``array`` (for messages)."""
        return [
            t.key
            for t in self.tensors.values()
            if t.array == array and t.chunk_start <= index < t.chunk_stop
        ]

    @classmethod
    def from_json(cls, data: bytes) -> Manifest:
        """Parse and validate manifest bytes.

        Raises:
            IntegrityError: If the bytes are too large, not JSON, or fail any check.
        """
        if len(data) > MAX_MANIFEST_BYTES:
            raise IntegrityError(
                f"manifest is {len(data)} bytes, over the {MAX_MANIFEST_BYTES} byte limit"
            )
        # Bound the objects json.loads would build before it builds them (a byte count is
        # an upper bound: a ',' inside a string only makes us stricter).
        items = data.count(b",") + data.count(b"{") + data.count(b"[")
        if items > MAX_JSON_ITEMS:
            raise IntegrityError(
                f"manifest holds about {items} JSON values, over the {MAX_JSON_ITEMS} limit; "
                "it is not a ckptstore manifest (or the state has too many tensors)"
            )
        try:
            doc = json.loads(data, object_pairs_hook=_no_duplicates)
        except RecursionError as exc:
            raise IntegrityError("manifest JSON is nested too deeply") from exc
        except (ValueError, UnicodeDecodeError) as exc:
            raise IntegrityError(f"manifest is not valid JSON: {exc}") from exc
        try:
            return _parse(doc)
        except _Invalid as exc:
            raise IntegrityError(f"invalid manifest: {exc}") from None
        except RecursionError as exc:
            raise IntegrityError("manifest is nested too deeply") from exc


@dataclass(frozen=True)
class BaseRef:
    """The base checkpoint a new checkpoint deduplicates chunks (or encodes deltas) against.

    Attributes:
        manifest: The base's (committed) manifest.
        directory: The base's directory.
        locate: Finds the directories of checkpoints the base itself reads chunks from
            (needed to XOR-encode against a base chunk the base deduplicated).
    """

    manifest: Manifest
    directory: Path
    locate: Callable[[str], Path] | None = None


class _Invalid(ValueError):
    """Internal: one validation failure, turned into IntegrityError by from_json."""


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    result = dict(pairs)
    if len(result) != len(pairs):
        raise ValueError("duplicate object key")
    return result


def _require(cond: bool, message: str) -> None:
    if not cond:
        raise _Invalid(message)


def _int(value: Any, what: str, lo: int = 0, hi: int = 2**63 - 1) -> int:
    _require(
        isinstance(value, int) and not isinstance(value, bool) and lo <= value <= hi,
        f"{what} must be an int in [{lo}, {hi}], got {_short(value)}",
    )
    return int(value)


def _str(value: Any, what: str, max_len: int = _MAX_RUN_CHARS) -> str:
    _require(
        isinstance(value, str) and len(value) <= max_len,
        f"{what} must be a string of at most {max_len} characters",
    )
    return str(value)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


_TOP_FIELDS = frozenset(
    {
        "format_version",
        "id",
        "run",
        "step",
        "created_at",
        "kind",
        "base_id",
        "codec",
        "chunk_bytes",
        "arrays",
        "tensors",
        "tree",
        "logical_bytes",
        "stored_bytes",
        "extra",
    }
)


def _parse(doc: Any) -> Manifest:
    _require(isinstance(doc, dict), "top level must be an object")
    _require(
        set(doc) - {"delta"} == _TOP_FIELDS,
        f"fields must be {sorted(_TOP_FIELDS)} (and optionally delta)",
    )
    version = _int(doc["format_version"], "format_version")
    _require(
        version == FORMAT_VERSION,
        f"format_version {version} is not supported (this build reads {FORMAT_VERSION}); "
        "upgrade ckptstore",
    )
    ckpt_id = doc["id"]
    _require(is_checkpoint_id(ckpt_id), "id must be a uuid")
    created_at = _str(doc["created_at"], "created_at", 64)
    try:
        datetime.fromisoformat(created_at)
    except ValueError:
        raise _Invalid("created_at must be an ISO-8601 time") from None
    kind = doc["kind"]
    _require(kind in ("full", "delta"), "kind must be 'full' or 'delta'")
    base_id = doc["base_id"]
    _require(
        (kind == "full" and base_id is None) or (kind == "delta" and is_checkpoint_id(base_id)),
        "base_id must be a uuid for a delta and null for a full checkpoint",
    )
    codec = doc["codec"]
    _require(codec in CODEC_PRESETS, f"codec must be one of {CODEC_PRESETS}")
    chunk_bytes = _int(doc["chunk_bytes"], "chunk_bytes", MIN_CHUNK_BYTES, MAX_CHUNK_BYTES)
    arrays = _parse_arrays(doc["arrays"], chunk_bytes, ckpt_id)
    tensors = _parse_tensors(doc["tensors"], arrays)
    srcs = {o for a in arrays.values() for c in a.chunks for o in c.owners() if o is not None}
    _require(
        (kind == "delta") == bool(srcs),
        "a delta must reference other checkpoints' chunks and a full checkpoint must not",
    )
    delta = _parse_delta(doc["delta"]) if doc.get("delta") is not None else None
    extra = doc["extra"]
    _require(isinstance(extra, dict), "extra must be an object")
    _check_depth(extra, "extra", 0)
    if extra.get("files") is not None:
        _check_extra_files(extra["files"], arrays)
    try:
        validate_tree(doc["tree"], {k: t.torch_dtype for k, t in tensors.items()})
    except ValueError as exc:
        raise _Invalid(str(exc)) from None
    return Manifest(
        format_version=version,
        id=ckpt_id,
        run=_str(doc["run"], "run"),
        step=_int(doc["step"], "step", -(2**63), 2**63 - 1),
        created_at=created_at,
        kind=kind,
        base_id=base_id,
        codec=codec,
        chunk_bytes=chunk_bytes,
        arrays=arrays,
        tensors=tensors,
        tree=doc["tree"],
        logical_bytes=_int(doc["logical_bytes"], "logical_bytes"),
        stored_bytes=_int(doc["stored_bytes"], "stored_bytes"),
        extra=extra,
        delta=delta,
    )


_DELTA_FIELDS = frozenset(DeltaInfo.__slots__)  # type: ignore[attr-defined]


def _float_or_none(value: Any, what: str) -> float | None:
    if value is None:
        return None
    _require(
        isinstance(value, int | float) and not isinstance(value, bool) and value >= 0
        and value == value and value != float("inf"),
        f"{what} must be a finite number >= 0 or null",
    )
    return float(value)


def _parse_delta(raw: Any) -> DeltaInfo:
    _require(isinstance(raw, dict) and set(raw) == _DELTA_FIELDS, "delta: bad fields")
    mode = raw["mode"]
    _require(mode in DELTA_MODES, f"delta.mode must be one of {DELTA_MODES}")
    _require(isinstance(raw["lossy"], bool), "delta.lossy must be a boolean")
    scope = raw["scope"]
    _require(
        isinstance(scope, list) and len(scope) <= _MAX_SCOPE
        and all(isinstance(p, str) and len(p) <= _MAX_KEY_CHARS for p in scope),
        "delta.scope must be a list of key patterns",
    )
    quantize = raw["quantize"]
    _require(quantize in (None, 8, 4) and not isinstance(quantize, bool),
             "delta.quantize must be 8, 4 or null")
    block = raw["block"]
    _require(block is None or (type(block) is int and 2 <= block <= 2**24 and block % 2 == 0),
             "delta.block must be an even int in [2, 2**24] or null")
    max_err = _float_or_none(raw["max_abs_error"], "delta.max_abs_error")
    mean_err = _float_or_none(raw["mean_abs_error"], "delta.mean_abs_error")
    return DeltaInfo(
        mode=mode,
        depth=_int(raw["depth"], "delta.depth", 0, 2**31),
        lossy=raw["lossy"],
        scope=tuple(scope),
        threshold=_float_or_none(raw["threshold"], "delta.threshold"),
        quantize=quantize,
        block=block,
        max_abs_error=max_err or 0.0,
        mean_abs_error=mean_err or 0.0,
        lossy_elements=_int(raw["lossy_elements"], "delta.lossy_elements"),
    )


_EXTRA_PATH = re.compile(r"^[A-Za-z0-9._%@~-]{1,255}(?:/[A-Za-z0-9._%@~-]{1,255}){0,15}$")
_RESERVED = frozenset({"zarr.json", "manifest.json", "COMMITTED", "COMMITTED.tmp"})


def _check_extra_files(raw: Any, arrays: dict[str, ArrayEntry]) -> None:
    """``extra["files"]``: files of other layouts; their paths are used to copy and delete."""
    _require(isinstance(raw, list) and len(raw) <= _MAX_CHUNKS, "extra.files must be a list")
    seen: set[str] = set()
    for entry in raw:
        _require(isinstance(entry, list) and len(entry) == 3, "extra.files: bad entry")
        path, nbytes, crc = entry
        _require(
            isinstance(path, str)
            and bool(_EXTRA_PATH.match(path))
            and not any(part in (".", "..") for part in path.split("/"))
            and path not in _RESERVED
            and path.split("/")[0] not in arrays
            and path not in seen,
            f"extra.files: path {_short(path)} is not allowed",
        )
        seen.add(path)
        _int(nbytes, f"extra.files {path}: size", 0, 2**40)
        _require(crc is None or (isinstance(crc, int) and not isinstance(crc, bool)
                                 and 0 <= crc < 2**32), f"extra.files {path}: bad crc32c")
        _require(crc is None or nbytes >= 4, f"extra.files {path}: too short for a crc32c")


def _check_depth(value: Any, what: str, depth: int) -> None:
    _require(depth <= MAX_TREE_DEPTH, f"{what} is nested deeper than {MAX_TREE_DEPTH}")
    children: Iterable[Any]
    if isinstance(value, dict):
        children = value.values()
    elif isinstance(value, list):
        children = value
    else:
        return
    for child in children:
        _check_depth(child, what, depth + 1)


_ARRAY_FIELDS = frozenset(
    {"torch_dtype", "zarr_dtype", "itemsize", "length", "chunk_len", "codec", "chunks"}
)
_CHUNK_FIELDS = frozenset({"i", "nbytes", "crc32c", "blake3", "src"})
_DELTA_CHUNK_FIELDS = _CHUNK_FIELDS | {"enc", "base"}
_BASE_FIELDS = frozenset({"src", "nbytes", "crc32c", "blake3"})


def _parse_arrays(raw: Any, chunk_bytes: int, ckpt_id: str) -> dict[str, ArrayEntry]:
    _require(isinstance(raw, dict), "arrays must be an object")
    _require(len(raw) <= 256, "too many arrays")
    arrays: dict[str, ArrayEntry] = {}
    total_chunks = 0
    for name, entry in raw.items():
        _require(bool(_ARRAY_NAME.match(name)), f"array name {_short(name)} is not an identifier")
        where = f"array {name}"
        _require(isinstance(entry, dict) and set(entry) == _ARRAY_FIELDS, f"{where}: bad fields")
        dtype_name = entry["torch_dtype"]
        info = dtype_by_name(dtype_name) if isinstance(dtype_name, str) else None
        _require(info is not None, f"{where}: unknown torch dtype {_short(entry['torch_dtype'])}")
        assert info is not None
        _require(entry["zarr_dtype"] == info.zarr_dtype, f"{where}: zarr_dtype mismatch")
        _require(entry["itemsize"] == info.itemsize, f"{where}: itemsize mismatch")
        length = _int(entry["length"], f"{where}: length", 0, _MAX_ELEMENTS)
        chunk_len = _int(entry["chunk_len"], f"{where}: chunk_len", 1, _MAX_ELEMENTS)
        # Balanced chunking never exceeds chunk_bytes by more than one element; this bounds
        # the scratch memory a reader allocates per chunk.
        raw_nbytes = chunk_len * info.itemsize
        _require(
            raw_nbytes <= chunk_bytes + info.itemsize,
            f"{where}: chunk of {raw_nbytes} bytes exceeds chunk_bytes {chunk_bytes}",
        )
        codec = entry["codec"]
        _require(codec in CODEC_PRESETS, f"{where}: codec must be one of {CODEC_PRESETS}")
        chunks_raw = entry["chunks"]
        n_chunks = -(-length // chunk_len)
        _require(
            isinstance(chunks_raw, list) and len(chunks_raw) == n_chunks,
            f"{where}: expected {n_chunks} chunks",
        )
        total_chunks += n_chunks
        _require(total_chunks <= _MAX_CHUNKS, "too many chunks")
        chunks = tuple(
            _parse_chunk(c, i, where, codec, raw_nbytes, ckpt_id)
            for i, c in enumerate(chunks_raw)
        )
        arrays[name] = ArrayEntry(
            name, info.name, info.zarr_dtype, info.itemsize, length, chunk_len, codec, chunks
        )
    return arrays


def _nbytes_range(codec: str, raw_nbytes: int) -> tuple[int, int]:
    """Bounds of a stored chunk file's size (a Blosc frame may exceed its input a little)."""
    if codec == "none":
        return raw_nbytes + 4, raw_nbytes + 4
    return _BLOSC_OVERHEAD, 2 * raw_nbytes + 1024


def _hex_digest(value: Any, what: str) -> str:
    _require(isinstance(value, str) and bool(_BLAKE3_HEX.match(value)),
             f"{what}: blake3 must be 64 hex digits")
    return str(value)


def _parse_chunk(
    raw: Any, index: int, where: str, codec: str, raw_nbytes: int, ckpt_id: str
) -> ChunkEntry:
    what = f"{where} chunk {index}"
    _require(
        isinstance(raw, dict) and (set(raw) == _CHUNK_FIELDS or set(raw) == _DELTA_CHUNK_FIELDS),
        f"{what}: fields",
    )
    _require(raw["i"] == index and type(raw["i"]) is int, f"{what}: wrong index")
    enc = raw.get("enc", "raw")
    _require((enc in ENCODINGS and enc != "raw") or "enc" not in raw,
             f"{what}: enc must be one of {ENCODINGS[1:]} when present")
    # Delta-encoded files are always Blosc frames, whatever the array's codec.
    lo, hi = _nbytes_range(codec if enc == "raw" else "zstd-1", raw_nbytes)
    nbytes = _int(raw["nbytes"], f"{what}: nbytes", lo, hi)
    crc = _int(raw["crc32c"], f"{what}: crc32c", 0, 2**32 - 1)
    digest = _hex_digest(raw["blake3"], what)
    src = raw["src"]
    _require(
        src is None or (is_checkpoint_id(src) and src != ckpt_id),
        f"{what}: src must be null or another checkpoint's uuid",
    )
    base = None
    if enc != "raw":
        b = raw["base"]
        _require(isinstance(b, dict) and set(b) == _BASE_FIELDS, f"{what}: base: bad fields")
        _require(is_checkpoint_id(b["src"]) and b["src"] != ckpt_id,
                 f"{what}: base.src must be another checkpoint's uuid")
        base_lo, base_hi = _nbytes_range(codec, raw_nbytes)
        base = BaseChunk(
            b["src"],
            _int(b["nbytes"], f"{what}: base.nbytes", base_lo, base_hi),
            _int(b["crc32c"], f"{what}: base.crc32c", 0, 2**32 - 1),
            _hex_digest(b["blake3"], f"{what}: base"),
        )
    return ChunkEntry(index, nbytes, crc, digest, src, enc, base)


_TENSOR_FIELDS = frozenset(
    {"key", "array", "offset", "numel", "shape", "torch_dtype", "chunk_start", "chunk_stop"}
)


def _parse_tensors(raw: Any, arrays: dict[str, ArrayEntry]) -> dict[str, TensorEntry]:
    _require(isinstance(raw, list), "tensors must be a list")
    _require(len(raw) <= MAX_TENSORS, f"more than {MAX_TENSORS} tensors")
    tensors: dict[str, TensorEntry] = {}
    for entry in raw:
        _require(isinstance(entry, dict) and set(entry) == _TENSOR_FIELDS, "tensor: bad fields")
        key = _str(entry["key"], "tensor key", _MAX_KEY_CHARS)
        where = f"tensor {key!r}"
        _require(key not in tensors, f"{where}: listed twice")
        array = arrays.get(entry["array"]) if isinstance(entry["array"], str) else None
        _require(array is not None, f"{where}: unknown array {_short(entry['array'])}")
        assert array is not None
        _require(
            entry["torch_dtype"] == array.torch_dtype, f"{where}: dtype differs from its array"
        )
        shape_raw = entry["shape"]
        _require(
            isinstance(shape_raw, list) and len(shape_raw) <= _MAX_DIMS,
            f"{where}: shape must be a list of at most {_MAX_DIMS} dims",
        )
        shape = tuple(_int(d, f"{where}: shape", 0, _MAX_ELEMENTS) for d in shape_raw)
        numel = _int(entry["numel"], f"{where}: numel", 0, _MAX_ELEMENTS)
        product = 1
        for dim in shape:
            product *= dim
            # Bail out early so a hostile shape cannot make us multiply huge ints.
            _require(product <= _MAX_ELEMENTS, f"{where}: shape has too many elements")
        _require(product == numel, f"{where}: numel {numel} != product of shape {shape}")
        offset = _int(entry["offset"], f"{where}: offset", 0, _MAX_ELEMENTS)
        _require(offset + numel <= array.length, f"{where}: lies outside array {array.name}")
        span = chunk_span(offset, numel, array.chunk_len)
        _require(
            (entry["chunk_start"], entry["chunk_stop"]) == span,
            f"{where}: chunk range does not match its offset",
        )
        tensors[key] = TensorEntry(key, array.name, offset, numel, shape, array.torch_dtype, *span)
    _check_disjoint(tensors)
    return tensors


def _check_disjoint(tensors: dict[str, TensorEntry]) -> None:
    """Refuse two tensors whose elements overlap in one array.

    The writer places every tensor in its own range (tied weights are stored once and
    referenced), so an overlap means a hand-made manifest: loading it would hand out two
    tensors sharing bytes, and a partial load or a delta against it would be wrong.
    """
    spans: dict[str, list[tuple[int, int, str]]] = {}
    for t in tensors.values():
        if t.numel:  # an empty tensor occupies no bytes
            spans.setdefault(t.array, []).append((t.offset, t.offset + t.numel, t.key))
    for array, ranges in spans.items():
        ranges.sort()
        # Sorted by start, any overlap shows between neighbours.
        for (_, end, first), (start, _, second) in itertools.pairwise(ranges):
            _require(
                start >= end,
                f"tensors {_short(first)} and {_short(second)} overlap in array {array} "
                f"(elements from {start} to {end})",
            )
