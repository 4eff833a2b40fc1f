"""Zarr v3 metadata documents (``zarr.json``) of a checkpoint: its groups and arrays.

The documents are built here, key for key and byte for byte as zarr-python writes them
(``tests/format/test_zarrmeta.py`` has zarr write every dtype and codec and compares, so a
zarr release that writes differently fails there), without importing zarr: its import
alone cost ~165 ms of CPU, the first save's in every fresh process. The writer puts the
bytes on disk with its own exclusive-create and fsync discipline.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ckptstore.errors import CkptError
from ckptstore.format.codecs import CodecSpec, codec_spec
from ckptstore.format.constants import (
    CHUNK_REF_CODEC,
    DELTA_CODEC,
    FORMAT_VERSION,
    MANIFEST_NAME,
    TENSOR_GROUP,
    ZARR_JSON,
)
from ckptstore.format.dtypes import DtypeInfo, dtype_by_name

if TYPE_CHECKING:
    from ckptstore.format.manifest import Manifest
    from ckptstore.format.manifest.records import ChunkEntry

__all__ = [
    "ArrayMeta",
    "add_refusing_codec",
    "array_metas",
    "array_template",
    "build_metadata",
    "digest",
    "document_variants",
    "group_document",
    "ref_document",
    "refusing_codec_doc",
    "strip_refusing_codec",
]

logger = logging.getLogger(__name__)

@dataclass(frozen=True)
class ArrayMeta:
    """What the ``zarr.json`` of one array says.

    Attributes:
        name: Array path inside the checkpoint group (``float32``, ``tensors/<key>``).
        length: Number of elements (the arrays are flat, 1-D).
        chunk_len: Elements per chunk.
        info: How the torch dtype is stored.
        spec: Codec preset of its plain chunks.
        tensor: For an array of one tensor, its key (recorded in the attributes, with the
            shape, so a foreign reader can reshape it).
        shape: That tensor's shape.
    """

    name: str
    length: int
    chunk_len: int
    info: DtypeInfo
    spec: CodecSpec
    tensor: str | None = None
    shape: tuple[int, ...] | None = None


def build_metadata(
    ckpt_id: str, arrays: Sequence[ArrayMeta], format_version: int = FORMAT_VERSION
) -> dict[str, bytes]:
    """Return relative path -> ``zarr.json`` bytes for the group, its subgroups and arrays.

    The documents are the plain ones: every chunk a plain chunk file of the array's own
    codec chain. :func:`add_refusing_codec` makes the variants of arrays a plain reader
    must not read alone.

    Args:
        ckpt_id: Checkpoint id, recorded in the group attributes.
        arrays: The arrays.
        format_version: The version recorded in the group attributes (an older checkpoint's
            documents are rebuilt with its own).
    """
    docs = {ZARR_JSON: group_document({"ckptstore": {
        "format_version": format_version,
        "id": ckpt_id,
        "manifest": MANIFEST_NAME,
    }})}
    groups: set[str] = set()
    for meta in arrays:
        parts = meta.name.split("/")
        groups.update("/".join(parts[:i]) for i in range(1, len(parts)))
    for group in sorted(groups):
        docs[f"{group}/{ZARR_JSON}"] = group_document({})
    templates: dict[tuple[str, str, int], dict[str, Any]] = {}
    for meta in arrays:
        docs[f"{meta.name}/{ZARR_JSON}"] = _array_document(meta, templates)
    return docs


def _array_document(
    meta: ArrayMeta, templates: dict[tuple[str, str, int], dict[str, Any]]
) -> bytes:
    """One array's ``zarr.json``: the template of its dtype and codec chain, made once per
    save and (dtype, codec), given this array's shape, chunk shape and attributes."""
    key = (meta.info.zarr_dtype, meta.spec.name, meta.info.itemsize)
    template = templates.get(key)
    if template is None:
        template = templates[key] = array_template(meta.info, meta.spec)
    attributes: dict[str, Any] = {} if meta.info.native else {"torch_dtype": meta.info.name}
    if meta.tensor is not None:
        attributes["tensor"] = meta.tensor
        attributes["shape"] = list(meta.shape or ())
        attributes["torch_dtype"] = meta.info.name
    doc = dict(template)
    doc["shape"] = [meta.length]
    grid = dict(template["chunk_grid"])
    grid["configuration"] = {"chunk_shape": [meta.chunk_len]}
    doc["chunk_grid"] = grid
    doc["attributes"] = attributes
    return _dumps(doc)


def group_document(attributes: dict[str, Any]) -> bytes:
    """A group's ``zarr.json``, as zarr-python writes it."""
    return _dumps({"attributes": attributes, "zarr_format": 3, "node_type": "group"})


def array_template(info: DtypeInfo, spec: CodecSpec, separator: str = "/") -> dict[str, Any]:
    """The document of a 1-element array of ``info``'s stored dtype with ``spec``'s codecs.

    Keys, order and defaults are those zarr-python writes for ``bytes`` → optional ``blosc``
    (bit-shuffle, the stored dtype's width) → ``crc32c`` and ``fill_value`` 0; callers fill
    in the shape, the chunk shape and the attributes.

    Args:
        info: How the torch dtype is stored.
        spec: The codec preset.
        separator: Of the default chunk key encoding (``/``: ``c/0``; the DCP layout: ``.``).
    """
    dtype = info.zarr_dtype
    fill: Any = 0
    if dtype == "bool":
        fill = False
    elif dtype.startswith("complex"):
        fill = [0.0, 0.0]
    elif dtype.startswith("float"):
        fill = 0.0
    # zarr omits the byte order where there is none to choose.
    serializer: dict[str, Any] = {"name": "bytes"}
    if info.itemsize > 1:
        serializer["configuration"] = {"endian": "little"}
    codecs: list[dict[str, Any]] = [serializer]
    if spec.cname is not None:
        codecs.append({"name": "blosc", "configuration": {
            "typesize": info.itemsize, "cname": spec.cname, "clevel": spec.clevel,
            "shuffle": "bitshuffle", "blocksize": 0,
        }})
    codecs.append({"name": "crc32c"})
    return {
        "shape": [1],
        "data_type": dtype,
        "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": [1]}},
        "chunk_key_encoding": {"name": "default", "configuration": {"separator": separator}},
        "fill_value": fill,
        "codecs": codecs,
        "attributes": {},
        "zarr_format": 3,
        "node_type": "array",
        "storage_transformers": [],
    }


def refusing_codec_doc(name: str, checkpoint: str, needs: list[str]) -> dict[str, Any]:
    """The codec entry a ``zarr.json`` declares (``name``: one of the two codec names).

    Args:
        name: :data:`~ckptstore.format.constants.CHUNK_REF_CODEC` or ``DELTA_CODEC``.
        checkpoint: The id of the checkpoint the array belongs to.
        needs: Ids of the checkpoints whose chunks the array reads, sorted.
    """
    return {"name": name, "configuration": {"checkpoint": checkpoint, "needs": needs}}


def _dumps(doc: Any) -> bytes:
    # zarr-python's own formatting of zarr.json, so a transformed document reads like one
    # zarr wrote; the bytes only need to be deterministic (their digest is recorded).
    return json.dumps(doc, indent=2).encode("utf-8")


def add_refusing_codec(plain: bytes, entry: dict[str, Any]) -> bytes:
    """An array document with ``entry`` first among its bytes-to-bytes codecs.

    Deterministic in ``plain``: the writer records the digest of the result, and a transfer
    that derives the document again from the same plain bytes gets the same bytes.
    """
    doc = json.loads(plain)
    codecs = doc["codecs"]
    doc["codecs"] = [codecs[0], entry, *codecs[1:]]
    return _dumps(doc)


def strip_refusing_codec(doc_bytes: bytes) -> bytes:
    """The plain document an :func:`add_refusing_codec` result was made from."""
    doc = json.loads(doc_bytes)
    doc["codecs"] = [
        c for c in doc["codecs"] if c.get("name") not in (CHUNK_REF_CODEC, DELTA_CODEC)
    ]
    return _dumps(doc)


def digest(data: bytes) -> str:
    """Hex blake3 of a document, as manifests record it."""
    import blake3

    return blake3.blake3(data).hexdigest()


def array_metas(manifest: Manifest) -> list[ArrayMeta]:
    """What each array's ``zarr.json`` says, from a manifest of the regular layout.

    Gives the same :class:`ArrayMeta` the writer built, so :func:`build_metadata` of it
    reproduces the plain documents.
    """
    metas: list[ArrayMeta] = []
    # A cast reads another tensor's array; the array's document names that tensor.
    owners = {t.array: t for t in manifest.tensors.values() if not t.cast}
    for name, entry in manifest.arrays.items():
        info = dtype_by_name(entry.torch_dtype)
        if info is None:  # a parsed manifest has only known dtypes
            raise CkptError(f"array {name}: unknown dtype {entry.torch_dtype}")
        own = owners.get(name) if name.startswith(f"{TENSOR_GROUP}/") else None
        metas.append(ArrayMeta(
            name, entry.length, entry.chunk_len, info, codec_spec(entry.codec),
            own.key if own is not None else None, own.shape if own is not None else None,
        ))
    return metas


def ref_document(manifest: Manifest, array: str, plain: bytes) -> bytes:
    """The chunk-reference variant of an array's plain ``zarr.json`` (a copy that lacks
    some of its chunk files declares it). Deterministic in ``plain``.
    """
    entry = manifest.arrays[array]
    owners = sorted({c.src for c in entry.chunks if c.src is not None})
    return add_refusing_codec(plain, refusing_codec_doc(CHUNK_REF_CODEC, manifest.id, owners))


def document_variants(
    ckpt_id: str,
    docs: dict[str, bytes],
    chunks: dict[str, list[ChunkEntry]],
    incomplete: set[str],
) -> tuple[dict[str, bytes], dict[str, str], dict[str, str]]:
    """The ``zarr.json`` documents of a new checkpoint and the digests its manifest records.

    Args:
        ckpt_id: The checkpoint id.
        docs: Relative path -> plain document, as :func:`build_metadata` made them.
        chunks: Array name -> its chunk entries.
        incomplete: Arrays some of whose chunks are referenced but not in this directory.

    Returns:
        ``(documents to write, metadata digests, metadata_ref digests)``: an array with
        delta-encoded chunks always declares the delta codec; one with chunks of other
        checkpoints has a chunk-reference variant, which this copy uses when it does not
        hold those chunk files itself.
    """
    on_disk = dict(docs)
    metadata: dict[str, str] = {}
    metadata_ref: dict[str, str] = {}
    for name, entries in chunks.items():
        rel = f"{name}/{ZARR_JSON}"
        owners = sorted({o for c in entries for o in c.owners() if o is not None})
        if any(c.enc != "raw" for c in entries):
            entry = refusing_codec_doc(DELTA_CODEC, ckpt_id, owners)
            on_disk[rel] = add_refusing_codec(docs[rel], entry)
        elif owners:
            ref = add_refusing_codec(docs[rel], refusing_codec_doc(CHUNK_REF_CODEC, ckpt_id,
                                                                   owners))
            metadata_ref[rel] = digest(ref)
            if name in incomplete:
                on_disk[rel] = ref
                metadata[rel] = digest(docs[rel])
    for rel, data in on_disk.items():
        metadata.setdefault(rel, digest(data))
    return on_disk, metadata, metadata_ref
