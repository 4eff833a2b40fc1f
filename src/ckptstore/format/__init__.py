"""The ckptstore checkpoint format: one Zarr v3 group per checkpoint.

Layout of a checkpoint directory::

    zarr.json            group metadata; attributes {"ckptstore": {format_version, id, manifest}}
    <dtype>/zarr.json    one flat 1-D array per torch dtype present (float32, bfloat16, ...)
    <dtype>/c/<i>        its chunks: bytes [+ blosc] + crc32c trailer (zarr v3 default keys)
    manifest.json        the index: tensors, chunk hashes, non-tensor state (see manifest)
    COMMITTED            the manifest's blake3 digest, written last (the commit point)

Every array is plain Zarr v3 (``zarr.open_group(dir, mode="r")`` reads it); the manifest says
which tensor lives where. A checkpoint saved through torch.distributed.checkpoint uses the DCP
layout instead of the packed arrays (:mod:`ckptstore.format.dcp`). The names of every file
are in :mod:`ckptstore.format.constants`.
"""

from __future__ import annotations

from ckptstore.format.basecache import KeyframeCache
from ckptstore.format.codecs import CODEC_PRESETS
from ckptstore.format.constants import DEFAULT_CHUNK_BYTES, FORMAT_VERSION
from ckptstore.format.delta import DeltaSpec, parse_delta
from ckptstore.format.flatten import FlatState, as_flat, flatten_state, unflatten_state
from ckptstore.format.manifest import (
    ArrayEntry,
    BaseChunk,
    BaseRef,
    ChunkEntry,
    DeltaInfo,
    FileEntry,
    Manifest,
    TensorEntry,
)
from ckptstore.format.reader import iter_tensors, read_checkpoint, read_manifest, read_tensors
from ckptstore.format.verify import chunk_files, verify_checkpoint
from ckptstore.format.writer import PHASES, write_checkpoint

__all__ = [
    "CODEC_PRESETS",
    "DEFAULT_CHUNK_BYTES",
    "FORMAT_VERSION",
    "PHASES",
    "ArrayEntry",
    "BaseChunk",
    "BaseRef",
    "ChunkEntry",
    "DeltaInfo",
    "DeltaSpec",
    "FileEntry",
    "FlatState",
    "KeyframeCache",
    "Manifest",
    "TensorEntry",
    "as_flat",
    "chunk_files",
    "flatten_state",
    "iter_tensors",
    "parse_delta",
    "read_checkpoint",
    "read_manifest",
    "read_tensors",
    "unflatten_state",
    "verify_checkpoint",
    "write_checkpoint",
]
