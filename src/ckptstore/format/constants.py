"""Constants of the on-disk checkpoint format (version 1).

Everything a reader and a writer must agree on lives here, so a change to the format is a
change to one file plus :data:`FORMAT_VERSION`.
"""

from __future__ import annotations

__all__ = [
    "COMMIT_NAME",
    "COMMIT_TMP_NAME",
    "DEFAULT_CHUNK_BYTES",
    "FORMAT_VERSION",
    "MANIFEST_NAME",
    "MAX_CHUNK_BYTES",
    "MAX_JSON_ITEMS",
    "MAX_MANIFEST_BYTES",
    "MAX_TENSORS",
    "MAX_TREE_DEPTH",
    "MIN_CHUNK_BYTES",
    "ZARR_JSON",
]

#: Version of the layout described in DESIGN.md; bumped on any incompatible change.
FORMAT_VERSION = 1

#: Chunk size the writer aims at. 8 MiB measured best for durable saves on the reference
#: machine (4 MiB costs more files and fsyncs, 16 MiB hurts parallel load).
DEFAULT_CHUNK_BYTES = 8 * 1024 * 1024

#: Bounds accepted for ``chunk_bytes``. The upper bound keeps every chunk well below Blosc's
#: 2 GiB buffer limit and bounds the per-thread scratch buffers a reader allocates.
MIN_CHUNK_BYTES = 16
MAX_CHUNK_BYTES = 1024 * 1024 * 1024

#: File names inside a checkpoint directory.
ZARR_JSON = "zarr.json"
MANIFEST_NAME = "manifest.json"
COMMIT_NAME = "COMMITTED"
#: The marker's temporary name while it is written (then hard-linked to COMMIT_NAME).
COMMIT_TMP_NAME = COMMIT_NAME + ".tmp"

#: Limits applied to manifests read from disk: they may be hostile, and parsing must stay
#: cheap and bounded.
MAX_MANIFEST_BYTES = 256 * 1024 * 1024
#: JSON values (counted as ``,`` + ``{`` + ``[`` bytes) a manifest may hold, checked before
#: parsing: json.loads costs ~75 bytes of Python objects per value, so a 30 MB manifest of
#: 10^7 empty objects would otherwise take 750 MB and 10 s before any other check ran.
#: A real manifest holds ~15 values per tensor: this allows ~160k tensors.
MAX_JSON_ITEMS = 2_500_000
MAX_TENSORS = 1_000_000
MAX_TREE_DEPTH = 64
