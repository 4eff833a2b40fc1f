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

from typing import TYPE_CHECKING

from ckptstore.lazy import lazy_attributes

if TYPE_CHECKING:
    from ckptstore.format.basecache import KeyframeCache
    from ckptstore.format.codecs import CODEC_PRESETS
    from ckptstore.format.committed import read_manifest
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
    from ckptstore.format.reader import (
        iter_tensors,
        iteration_order,
        read_checkpoint,
        read_tensors,
    )
    from ckptstore.format.verify import chunk_files, verify_checkpoint
    from ckptstore.format.writer import PHASES, write_checkpoint

# Each name by the module that is its home. They load on first use: the delta codec and the
# writer import torch, and the catalog-only commands (`ckpt show`, `ckpt ls`) read manifests
# through this package without it (tests/cli/test_startup.py).
_LAZY = {
    "KeyframeCache": "ckptstore.format.basecache",
    "CODEC_PRESETS": "ckptstore.format.codecs",
    "DEFAULT_CHUNK_BYTES": "ckptstore.format.constants",
    "FORMAT_VERSION": "ckptstore.format.constants",
    "DeltaSpec": "ckptstore.format.delta",
    "parse_delta": "ckptstore.format.delta",
    "FlatState": "ckptstore.format.flatten",
    "as_flat": "ckptstore.format.flatten",
    "flatten_state": "ckptstore.format.flatten",
    "unflatten_state": "ckptstore.format.flatten",
    "ArrayEntry": "ckptstore.format.manifest",
    "BaseChunk": "ckptstore.format.manifest",
    "BaseRef": "ckptstore.format.manifest",
    "ChunkEntry": "ckptstore.format.manifest",
    "DeltaInfo": "ckptstore.format.manifest",
    "FileEntry": "ckptstore.format.manifest",
    "Manifest": "ckptstore.format.manifest",
    "TensorEntry": "ckptstore.format.manifest",
    "iter_tensors": "ckptstore.format.reader",
    "iteration_order": "ckptstore.format.reader",
    "read_checkpoint": "ckptstore.format.reader",
    "read_manifest": "ckptstore.format.committed",
    "read_tensors": "ckptstore.format.reader",
    "chunk_files": "ckptstore.format.verify",
    "verify_checkpoint": "ckptstore.format.verify",
    "PHASES": "ckptstore.format.writer",
    "write_checkpoint": "ckptstore.format.writer",
}


__getattr__ = lazy_attributes(__name__, _LAZY)

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
    "iteration_order",
    "parse_delta",
    "read_checkpoint",
    "read_manifest",
    "read_tensors",
    "unflatten_state",
    "verify_checkpoint",
    "write_checkpoint",
]
