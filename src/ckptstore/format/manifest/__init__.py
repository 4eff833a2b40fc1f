"""The manifest of a checkpoint: its records, its JSON form, its parser and its cache.

* :mod:`~ckptstore.format.manifest.records`: chunk, array, tensor, delta and file records;
* :mod:`~ckptstore.format.manifest.dcpindex`: the DCP index (the manifest's ``dcp`` data);
* :mod:`~ckptstore.format.manifest.model`: :class:`Manifest` itself, canonical JSON, digest;
* :mod:`~ckptstore.format.manifest.parse`: the parser of hostile ``manifest.json`` bytes;
* :mod:`~ckptstore.format.manifest.cache`: the process's cache of parsed manifests.
"""

from __future__ import annotations

from ckptstore.format.manifest.cache import (
    clear_manifest_cache,
    known_manifest,
    parse_verified,
    remember_manifest,
)
from ckptstore.format.manifest.dcpindex import DcpIndex
from ckptstore.format.manifest.model import FORMAT_KEYS, BaseRef, Manifest, manifest_digest
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

__all__ = [
    "DELTA_MODES",
    "ENCODINGS",
    "FORMAT_KEYS",
    "ArrayEntry",
    "BaseChunk",
    "BaseRef",
    "ChunkEntry",
    "DcpIndex",
    "DeltaInfo",
    "FileEntry",
    "Manifest",
    "TensorEntry",
    "clear_manifest_cache",
    "is_checkpoint_id",
    "known_manifest",
    "manifest_digest",
    "parse_verified",
    "remember_manifest",
]
