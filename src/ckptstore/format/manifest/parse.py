"""The manifest parser: ``manifest.json`` bytes, treated as hostile, to a manifest's fields.

:func:`parse_manifest` bounds sizes and counts before ``json.loads`` builds anything, checks
every type, range and cross-reference (through :mod:`ckptstore.format.validate`), parses the
format's keys inside ``extra`` into their typed fields (the DCP index through
:meth:`~ckptstore.format.manifest.dcpindex.DcpIndex.from_json`), and raises
:class:`~ckptstore.errors.IntegrityError` on the first problem, before any of it is used to
open files or allocate memory.
"""

from __future__ import annotations

import itertools
import re
from datetime import datetime
from typing import Any

from ckptstore.format.codecs import ARRAY_CODECS, CODEC_PRESETS
from ckptstore.format.constants import (
    CAST_FORMAT_VERSION,
    CAST_PAIRS,
    DCP_ARRAY_GROUP,
    DCP_INDEX_KEY,
    DCP_PACK_GROUP,
    FILES_KEY,
    FORMAT_VERSION,
    MAX_CHUNK_BYTES,
    MAX_JSON_ITEMS,
    MAX_MANIFEST_BYTES,
    MAX_TENSORS,
    MAX_TREE_DEPTH,
    MIN_CHUNK_BYTES,
    READABLE_VERSIONS,
    REENCODED_FROM_KEY,
    RESERVED_NAMES,
    TENSOR_GROUP,
    ZARR_JSON,
)
from ckptstore.format.dtypes import dtype_by_name
from ckptstore.format.gcpause import without_gc
from ckptstore.format.layout import chunk_span
from ckptstore.format.manifest.dcpindex import DcpIndex
from ckptstore.format.manifest.records import (
    DELTA_MODES,
    ENCODINGS,
    ArrayEntry,
    BaseChunk,
    ChunkEntry,
    DeltaInfo,
    FileEntry,
    TensorEntry,
    is_checkpoint_id,
)
from ckptstore.format.tree import validate_tree
from ckptstore.format.validate import (
    MAX_DIMS,
    MAX_ELEMENTS,
    Invalid,
    check_depth,
    hex_digest,
    int_in,
    load_json,
    rejecting,
    require,
    short,
    str_max,
)

__all__ = ["parse_manifest"]

_ARRAY_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,63}$")
# Version 2: a tensor's own array, ``tensors/<escaped key>`` (format.keys.escape_node_name).
# A re-encoded copy suffixes the group: ``tensors__zstd3/<escaped key>``.
_TENSOR_ARRAY_NAME = re.compile(
    rf"^{TENSOR_GROUP}(?:__[a-z0-9]{{1,16}})?/(?!__)[A-Za-z0-9._%~-]{{1,200}}$"
)
_MAX_ARRAYS_V1 = 256
_MAX_KEY_CHARS = 65536
_MAX_RUN_CHARS = 1024
_MAX_CHUNKS = 10_000_000
_BLOSC_OVERHEAD = 16 + 4  # frame header + crc trailer
_MAX_SCOPE = 256


@without_gc
def parse_manifest(data: bytes) -> dict[str, Any]:
    """Parse and validate manifest bytes into the fields of a ``Manifest``.

    The result is the keyword arguments of
    :class:`~ckptstore.format.manifest.model.Manifest` (``Manifest(**fields)``), which
    declares the fields and their types once; this module only imports the records, so
    the manifest's own module can use it.

    The collector is paused (:mod:`ckptstore.format.gcpause`): a parse allocates a few
    container objects per tensor (the JSON document's, then the records), none in a cycle.
    In a fresh process that has just imported torch, those allocations made the
    interpreter's first full collection (~50 ms over torch's ~170k objects) fall inside the
    parse, ten times the parse itself.

    Raises:
        IntegrityError: If the bytes are too large, not JSON, or fail any check.
    """
    doc = load_json(
        data, "manifest", max_bytes=MAX_MANIFEST_BYTES, max_items=MAX_JSON_ITEMS,
        too_many="; it is not a ckptstore manifest (or the state has too many tensors)",
    )
    with rejecting("invalid manifest", too_deep="manifest is nested too deeply"):
        return _parse(doc)


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


def _parse(doc: Any) -> dict[str, Any]:
    require(isinstance(doc, dict), "top level must be an object")
    version = int_in(doc.get("format_version"), "format_version")
    require(
        version in READABLE_VERSIONS,
        f"format_version {version} is not supported (this build reads {READABLE_VERSIONS}, "
        f"writes {FORMAT_VERSION}); upgrade ckptstore",
    )
    top = _TOP_FIELDS if version == 1 else _TOP_FIELDS | {"metadata", "metadata_ref"}
    require(
        set(doc) - {"delta"} == top,
        f"fields must be {sorted(top)} (and optionally delta)",
    )
    ckpt_id = doc["id"]
    require(is_checkpoint_id(ckpt_id), "id must be a uuid")
    created_at = str_max(doc["created_at"], "created_at", 64)
    try:
        datetime.fromisoformat(created_at)
    except ValueError:
        raise Invalid("created_at must be an ISO-8601 time") from None
    kind = doc["kind"]
    require(kind in ("full", "delta"), "kind must be 'full' or 'delta'")
    base_id = doc["base_id"]
    require(
        (kind == "full" and base_id is None) or (kind == "delta" and is_checkpoint_id(base_id)),
        "base_id must be a uuid for a delta and null for a full checkpoint",
    )
    codec = doc["codec"]
    codecs = CODEC_PRESETS if version >= 2 else ARRAY_CODECS
    require(codec in codecs, f"codec must be one of {codecs}")
    chunk_bytes = int_in(doc["chunk_bytes"], "chunk_bytes", MIN_CHUNK_BYTES, MAX_CHUNK_BYTES)
    arrays = _parse_arrays(doc["arrays"], chunk_bytes, ckpt_id, version)
    extra = doc["extra"]
    require(isinstance(extra, dict), "extra must be an object")
    check_depth(extra, "extra", MAX_TREE_DEPTH)
    # A format 2 DCP checkpoint lists its tensors (with their pieces) in the same index;
    # the DCP index parses them against its arrays.
    dcp_entries = version >= 2 and bool(extra.get(DCP_INDEX_KEY))
    tensors = {} if dcp_entries else _parse_tensors(doc["tensors"], arrays, version)
    srcs = {o for a in arrays.values() for c in a.chunks for o in c.owners() if o is not None}
    require(
        (kind == "delta") == bool(srcs),
        "a delta must reference other checkpoints' chunks and a full checkpoint must not",
    )
    delta = _parse_delta(doc["delta"]) if doc.get("delta") is not None else None
    extra, dcp, files, reencoded_from = _format_keys(
        extra, arrays, doc["tensors"] if dcp_entries else None)
    metadata: dict[str, str] = {}
    metadata_ref: dict[str, str] = {}
    if version >= 2:
        metadata, metadata_ref = _parse_metadata(doc["metadata"], doc["metadata_ref"], arrays,
                                                 dcp)
    try:
        validate_tree(doc["tree"], {k: t.torch_dtype for k, t in tensors.items()})
    except ValueError as exc:
        raise Invalid(str(exc)) from None
    return {
        "format_version": version,
        "id": ckpt_id,
        "run": str_max(doc["run"], "run", _MAX_RUN_CHARS),
        "step": int_in(doc["step"], "step", -(2**63), 2**63 - 1),
        "created_at": created_at,
        "kind": kind,
        "base_id": base_id,
        "codec": codec,
        "chunk_bytes": chunk_bytes,
        "arrays": arrays,
        "tensors": tensors,
        "tree": doc["tree"],
        "logical_bytes": int_in(doc["logical_bytes"], "logical_bytes"),
        "stored_bytes": int_in(doc["stored_bytes"], "stored_bytes"),
        "extra": extra,
        "delta": delta,
        "dcp": dcp,
        "files": files,
        "reencoded_from": reencoded_from,
        "metadata": metadata,
        "metadata_ref": metadata_ref,
    }


def _parse_metadata(
    raw: Any, raw_ref: Any, arrays: dict[str, ArrayEntry], dcp: DcpIndex | None
) -> tuple[dict[str, str], dict[str, str]]:
    """``metadata``: the digest of every ``zarr.json``; ``metadata_ref``: of the arrays'
    chunk-reference variants (only arrays with chunks of other checkpoints)."""
    require(isinstance(raw, dict), "metadata must be an object")
    require(isinstance(raw_ref, dict), "metadata_ref must be an object")
    groups: set[str] = {""}
    names = list(arrays) if dcp is None else [*dcp.arrays, DCP_ARRAY_GROUP, DCP_PACK_GROUP]
    for name in names:
        parts = name.split("/")
        groups.update("/".join(parts[:i]) for i in range(1, len(parts)))
    expected = {f"{g}/{ZARR_JSON}" if g else ZARR_JSON for g in groups}
    expected |= {f"{name}/{ZARR_JSON}" for name in names}
    require(set(raw) == expected, "metadata must list exactly the zarr.json of every node")
    metadata = {path: hex_digest(value, f"metadata {short(path)}") for path, value in raw.items()}
    shared = {
        f"{a.name}/{ZARR_JSON}"
        for a in arrays.values()
        if any(c.src is not None for c in a.chunks) and all(c.enc == "raw" for c in a.chunks)
    }
    require(
        set(raw_ref) == shared,
        "metadata_ref must list exactly the arrays with chunks of other checkpoints",
    )
    metadata_ref = {
        path: hex_digest(value, f"metadata_ref {short(path)}") for path, value in raw_ref.items()
    }
    return metadata, metadata_ref


def _format_keys(
    extra: dict[str, Any], arrays: dict[str, ArrayEntry], dcp_entries: Any
) -> tuple[dict[str, Any], DcpIndex | None, tuple[FileEntry, ...], str | None]:
    """Take the format's keys out of ``extra``, parsed: ``(rest, dcp, files, reencoded_from)``.

    ``dcp_entries`` is the manifest's ``tensors`` list when it holds a DCP index's tensors
    (format 2), else None.

    A key whose value carries nothing (null, an empty list or string: some callers wrote
    those as metadata) stays in ``extra`` as written, so the manifest re-serialises to the
    same bytes; any other value must be the format's data and is checked as such.
    """
    rest = dict(extra)
    dcp = None
    if rest.get(DCP_INDEX_KEY):
        raw = rest.pop(DCP_INDEX_KEY)
        require(isinstance(raw, dict), "extra.dcp must be the DCP index object")
        # Raises its own IntegrityError, which names the DCP index.
        dcp = DcpIndex.from_json(raw, dcp_entries)
    files: tuple[FileEntry, ...] = ()
    if rest.get(FILES_KEY) is not None:
        files = _parse_files(rest[FILES_KEY], arrays)
        if files:
            del rest[FILES_KEY]
    reencoded_from = None
    if rest.get(REENCODED_FROM_KEY):
        reencoded_from = hex_digest(rest.pop(REENCODED_FROM_KEY), "extra.reencoded_from")
    return rest, dcp, files, reencoded_from


_DELTA_FIELDS = frozenset(DeltaInfo.__slots__)  # type: ignore[attr-defined]


def _float_or_none(value: Any, what: str) -> float | None:
    if value is None:
        return None
    require(
        isinstance(value, int | float) and not isinstance(value, bool) and value >= 0
        and value == value and value != float("inf"),
        f"{what} must be a finite number >= 0 or null",
    )
    return float(value)


def _parse_delta(raw: Any) -> DeltaInfo:
    require(isinstance(raw, dict) and set(raw) == _DELTA_FIELDS, "delta: bad fields")
    mode = raw["mode"]
    require(mode in DELTA_MODES, f"delta.mode must be one of {DELTA_MODES}")
    require(isinstance(raw["lossy"], bool), "delta.lossy must be a boolean")
    scope = raw["scope"]
    require(
        isinstance(scope, list) and len(scope) <= _MAX_SCOPE
        and all(isinstance(p, str) and len(p) <= _MAX_KEY_CHARS for p in scope),
        "delta.scope must be a list of key patterns",
    )
    quantize = raw["quantize"]
    require(quantize in (None, 8, 4) and not isinstance(quantize, bool),
             "delta.quantize must be 8, 4 or null")
    block = raw["block"]
    require(block is None or (type(block) is int and 2 <= block <= 2**24 and block % 2 == 0),
             "delta.block must be an even int in [2, 2**24] or null")
    max_err = _float_or_none(raw["max_abs_error"], "delta.max_abs_error")
    mean_err = _float_or_none(raw["mean_abs_error"], "delta.mean_abs_error")
    return DeltaInfo(
        mode=mode,
        depth=int_in(raw["depth"], "delta.depth", 0, 2**31),
        lossy=raw["lossy"],
        scope=tuple(scope),
        threshold=_float_or_none(raw["threshold"], "delta.threshold"),
        quantize=quantize,
        block=block,
        max_abs_error=max_err or 0.0,
        mean_abs_error=mean_err or 0.0,
        lossy_elements=int_in(raw["lossy_elements"], "delta.lossy_elements"),
    )


_EXTRA_PATH = re.compile(r"^[A-Za-z0-9._%@~-]{1,255}(?:/[A-Za-z0-9._%@~-]{1,255}){0,15}$")


def _parse_files(raw: Any, arrays: dict[str, ArrayEntry]) -> tuple[FileEntry, ...]:
    """``extra["files"]``: files of other layouts; their paths are used to copy and delete."""
    require(isinstance(raw, list) and len(raw) <= _MAX_CHUNKS, "extra.files must be a list")
    seen: set[str] = set()
    files: list[FileEntry] = []
    for entry in raw:
        require(isinstance(entry, list) and len(entry) == 3, "extra.files: bad entry")
        path, nbytes, crc = entry
        require(
            isinstance(path, str)
            and bool(_EXTRA_PATH.match(path))
            and not any(part in (".", "..") for part in path.split("/"))
            and path not in RESERVED_NAMES
            and path.split("/")[0] not in arrays
            and path not in seen,
            f"extra.files: path {short(path)} is not allowed",
        )
        seen.add(path)
        int_in(nbytes, f"extra.files {path}: size", 0, 2**40)
        require(crc is None or (isinstance(crc, int) and not isinstance(crc, bool)
                                 and 0 <= crc < 2**32), f"extra.files {path}: bad crc32c")
        require(crc is None or nbytes >= 4, f"extra.files {path}: too short for a crc32c")
        files.append(FileEntry(path, nbytes, crc))
    return tuple(files)


_ARRAY_FIELDS = frozenset(
    {"torch_dtype", "zarr_dtype", "itemsize", "length", "chunk_len", "codec", "chunks"}
)
_CHUNK_FIELDS = frozenset({"i", "nbytes", "crc32c", "blake3", "src"})
_DELTA_CHUNK_FIELDS = _CHUNK_FIELDS | {"enc", "base"}
_BASE_FIELDS = frozenset({"src", "nbytes", "crc32c", "blake3"})


def _parse_arrays(
    raw: Any, chunk_bytes: int, ckpt_id: str, version: int
) -> dict[str, ArrayEntry]:
    require(isinstance(raw, dict), "arrays must be an object")
    require(len(raw) <= (_MAX_ARRAYS_V1 if version == 1 else MAX_TENSORS), "too many arrays")
    arrays: dict[str, ArrayEntry] = {}
    total_chunks = 0
    for name, entry in raw.items():
        require(
            isinstance(name, str) and (
                bool(_ARRAY_NAME.match(name))
                or (version >= 2 and bool(_TENSOR_ARRAY_NAME.match(name)))
            ),
            f"array name {short(name)} is not an identifier",
        )
        where = f"array {name}"
        require(isinstance(entry, dict) and set(entry) == _ARRAY_FIELDS, f"{where}: bad fields")
        dtype_name = entry["torch_dtype"]
        info = dtype_by_name(dtype_name) if isinstance(dtype_name, str) else None
        require(info is not None, f"{where}: unknown torch dtype {short(entry['torch_dtype'])}")
        assert info is not None
        require(entry["zarr_dtype"] == info.zarr_dtype, f"{where}: zarr_dtype mismatch")
        require(entry["itemsize"] == info.itemsize, f"{where}: itemsize mismatch")
        length = int_in(entry["length"], f"{where}: length", 0, MAX_ELEMENTS)
        chunk_len = int_in(entry["chunk_len"], f"{where}: chunk_len", 1, MAX_ELEMENTS)
        # Balanced chunking never exceeds chunk_bytes by more than one element; this bounds
        # the scratch memory a reader allocates per chunk.
        raw_nbytes = chunk_len * info.itemsize
        require(
            raw_nbytes <= chunk_bytes + info.itemsize,
            f"{where}: chunk of {raw_nbytes} bytes exceeds chunk_bytes {chunk_bytes}",
        )
        codec = entry["codec"]
        require(codec in ARRAY_CODECS, f"{where}: codec must be one of {ARRAY_CODECS}")
        chunks_raw = entry["chunks"]
        n_chunks = -(-length // chunk_len)
        require(
            isinstance(chunks_raw, list) and len(chunks_raw) == n_chunks,
            f"{where}: expected {n_chunks} chunks",
        )
        total_chunks += n_chunks
        require(total_chunks <= _MAX_CHUNKS, "too many chunks")
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


def _parse_chunk(
    raw: Any, index: int, where: str, codec: str, raw_nbytes: int, ckpt_id: str
) -> ChunkEntry:
    what = f"{where} chunk {index}"
    require(
        isinstance(raw, dict) and (set(raw) == _CHUNK_FIELDS or set(raw) == _DELTA_CHUNK_FIELDS),
        f"{what}: fields",
    )
    require(raw["i"] == index and type(raw["i"]) is int, f"{what}: wrong index")
    enc = raw.get("enc", "raw")
    require((enc in ENCODINGS and enc != "raw") or "enc" not in raw,
             f"{what}: enc must be one of {ENCODINGS[1:]} when present")
    # Delta-encoded files are always Blosc frames, whatever the array's codec.
    lo, hi = _nbytes_range(codec if enc == "raw" else "zstd-1", raw_nbytes)
    nbytes = int_in(raw["nbytes"], f"{what}: nbytes", lo, hi)
    crc = int_in(raw["crc32c"], f"{what}: crc32c", 0, 2**32 - 1)
    digest = hex_digest(raw["blake3"], what)
    src = raw["src"]
    require(
        src is None or (is_checkpoint_id(src) and src != ckpt_id),
        f"{what}: src must be null or another checkpoint's uuid",
    )
    base = None
    if enc != "raw":
        b = raw["base"]
        require(isinstance(b, dict) and set(b) == _BASE_FIELDS, f"{what}: base: bad fields")
        require(is_checkpoint_id(b["src"]) and b["src"] != ckpt_id,
                 f"{what}: base.src must be another checkpoint's uuid")
        base_lo, base_hi = _nbytes_range(codec, raw_nbytes)
        base = BaseChunk(
            b["src"],
            int_in(b["nbytes"], f"{what}: base.nbytes", base_lo, base_hi),
            int_in(b["crc32c"], f"{what}: base.crc32c", 0, 2**32 - 1),
            hex_digest(b["blake3"], f"{what}: base"),
        )
    return ChunkEntry(index, nbytes, crc, digest, src, enc, base)


_TENSOR_FIELDS = frozenset(
    {"key", "array", "offset", "numel", "shape", "torch_dtype", "chunk_start", "chunk_stop"}
)
#: A version-3 entry of a tensor stored as the rounding of its array's elements.
_CAST_FIELDS = _TENSOR_FIELDS | {"cast"}


def _parse_tensors(raw: Any, arrays: dict[str, ArrayEntry],
                   version: int) -> dict[str, TensorEntry]:
    require(isinstance(raw, list), "tensors must be a list")
    require(len(raw) <= MAX_TENSORS, f"more than {MAX_TENSORS} tensors")
    tensors: dict[str, TensorEntry] = {}
    casts = version >= CAST_FORMAT_VERSION
    for entry in raw:
        # Every check is a plain condition; the message (naming the tensor) is built only
        # for the one that fails: this loop runs once per tensor of a fresh process's
        # first read, which docs/FORMAT.md keeps fast.
        if type(entry) is not dict:
            raise Invalid("tensor: bad fields")
        fields = entry.keys()
        cast = fields == _CAST_FIELDS and casts
        if not cast and fields != _TENSOR_FIELDS:
            raise Invalid("tensor: bad fields" + (
                "" if casts or fields != _CAST_FIELDS
                else f" (a cast needs format_version {CAST_FORMAT_VERSION})"))
        if cast and entry["cast"] is not True:
            raise Invalid("tensor: cast must be true where present")
        key = str_max(entry["key"], "tensor key", _MAX_KEY_CHARS)
        name, shape_raw = entry["array"], entry["shape"]
        array = arrays.get(name) if type(name) is str else None
        problem = _tensor_problem(entry, key, tensors, array, shape_raw, cast)
        if problem:
            raise Invalid(f"tensor {key!r}: {problem}")
        assert array is not None
        shape = tuple(shape_raw)
        numel, offset = entry["numel"], entry["offset"]
        span = (entry["chunk_start"], entry["chunk_stop"])
        tensors[key] = TensorEntry(key, array.name, offset, numel, shape,
                                   entry["torch_dtype"] if cast else array.torch_dtype,
                                   *span, cast)
    _check_disjoint(tensors)
    return tensors


def _tensor_problem(entry: dict[str, Any], key: str, seen: dict[str, TensorEntry],
                    array: ArrayEntry | None, shape_raw: Any, cast: bool = False) -> str:
    """What is wrong with one tensor entry, or ``""``."""
    if key in seen:
        return "listed twice"
    if array is None:
        return f"unknown array {short(entry['array'])}"
    if cast:
        if (array.torch_dtype, entry["torch_dtype"]) not in CAST_PAIRS:
            return (f"cannot be a cast of array {array.name}: {short(entry['torch_dtype'])} "
                    f"from {array.torch_dtype} is not one of {sorted(CAST_PAIRS)}")
    elif entry["torch_dtype"] != array.torch_dtype:
        return "dtype differs from its array"
    if type(shape_raw) is not list or len(shape_raw) > MAX_DIMS:
        return f"shape must be a list of at most {MAX_DIMS} dims"
    product = 1
    for dim in shape_raw:
        if type(dim) is not int or not 0 <= dim <= MAX_ELEMENTS:
            return f"shape must hold ints in [0, {MAX_ELEMENTS}], got {short(dim)}"
        product *= dim
        # Bail out early so a hostile shape cannot make us multiply huge ints.
        if product > MAX_ELEMENTS:
            return "shape has too many elements"
    numel, offset = entry["numel"], entry["offset"]
    for field, value in (("numel", numel), ("offset", offset)):
        if type(value) is not int or not 0 <= value <= MAX_ELEMENTS:
            return f"{field} must be an int in [0, {MAX_ELEMENTS}], got {short(value)}"
    if product != numel:
        return f"numel {numel} != product of shape {tuple(shape_raw)}"
    if offset + numel > array.length:
        return f"lies outside array {array.name}"
    if (entry["chunk_start"], entry["chunk_stop"]) != chunk_span(offset, numel,
                                                                  array.chunk_len):
        return "chunk range does not match its offset"
    return ""


def _check_disjoint(tensors: dict[str, TensorEntry]) -> None:
    """Refuse two tensors whose elements overlap in one array.

    The writer places every tensor in its own range (tied weights are stored once and
    referenced), so an overlap means a hand-made manifest: loading it would hand out two
    tensors sharing bytes, and a partial load or a delta against it would be wrong.
    """
    spans: dict[str, list[tuple[int, int, str]]] = {}
    for t in tensors.values():
        # An empty tensor occupies no bytes; a cast reads elements another tensor owns.
        if t.numel and not t.cast:
            spans.setdefault(t.array, []).append((t.offset, t.offset + t.numel, t.key))
    for array, ranges in spans.items():
        ranges.sort()
        # Sorted by start, any overlap shows between neighbours.
        for (_, end, first), (start, _, second) in itertools.pairwise(ranges):
            require(
                start >= end,
                f"tensors {short(first)} and {short(second)} overlap in array {array} "
                f"(elements from {start} to {end})",
            )
