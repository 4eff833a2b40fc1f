"""Constants of the on-disk checkpoint format (version 2; version 1 is still read).

Everything a reader and a writer must agree on lives here, so a change to the format is a
change to one file plus :data:`FORMAT_VERSION`: file names inside a checkpoint directory,
chunk keys, the DCP layout's group names, the format's keys inside ``manifest.json`` and the
limits applied to what is read back. (The name prefix of temporary files written on the way
to a durable one, ``.ckpt-tmp-``, is :data:`ckptstore.durable.TEMP_PREFIX`: the durable
writer below the format owns it.)
"""

from __future__ import annotations

__all__ = [
    "BUNDLE_FILES",
    "BUNDLE_HEADER",
    "CHUNK_DIR",
    "CHUNK_REF_CODEC",
    "COMMIT_NAME",
    "COMMIT_TMP_NAME",
    "DCP_ARRAY_GROUP",
    "DCP_CHUNK_PREFIX",
    "DCP_INDEX_KEY",
    "DCP_LAYOUT",
    "DCP_PACK_GROUP",
    "DCP_RANK_GROUP",
    "DEFAULT_CHUNK_BYTES",
    "DELTA_CODEC",
    "FILES_KEY",
    "CAST_FORMAT_VERSION",
    "CAST_PAIRS",
    "FORMAT_VERSION",
    "MANIFEST_NAME",
    "MAX_CHUNK_BYTES",
    "MAX_JSON_ITEMS",
    "MAX_MANIFEST_BYTES",
    "MAX_TENSORS",
    "MAX_TREE_DEPTH",
    "MIN_CHUNK_BYTES",
    "ORIGINAL_MANIFEST_NAME",
    "PER_TENSOR_MIN_BYTES",
    "READABLE_VERSIONS",
    "REENCODED_FROM_KEY",
    "RESERVED_NAMES",
    "SIGNATURE_NAME",
    "TENSOR_GROUP",
    "ZARR_JSON",
    "chunk_rel",
]

#: Version of the layout described in docs/FORMAT.md; bumped on any incompatible change.
#: Version 2: one array per tensor of 1 MiB or more, deduplicated chunks hard-linked on
#: local tiers, codecs that refuse plain readers where a copy is not self-contained, and the
#: digest of every ``zarr.json`` in the manifest.
FORMAT_VERSION = 2
#: Version 3 adds tensors stored as the rounding of a wider tensor's elements (``cast`` in
#: the tensor index); a checkpoint is written as version 3 only when it has such a tensor,
#: so every other checkpoint stays readable by builds that read version 2.
CAST_FORMAT_VERSION = 3
#: (array dtype, tensor dtype) pairs a tensor may be stored as a cast of (version 3).
CAST_PAIRS = frozenset({("float32", "bfloat16"), ("float32", "float16")})
#: Versions this build reads (and the writers of older versions wrote).
READABLE_VERSIONS = (1, 2, 3)

#: Group holding the arrays of tensors that get an array of their own (version 2).
TENSOR_GROUP = "tensors"
#: Tensors of at least this many bytes get an array of their own, so their chunks never mix
#: with another tensor's: a frozen tensor's chunks then deduplicate whatever its neighbours
#: do. Smaller tensors are packed together per dtype (a chunk file each would cost more).
PER_TENSOR_MIN_BYTES = 1024 * 1024

#: Names of the Zarr v3 codecs ckptstore declares in a ``zarr.json`` whose array a plain
#: reader cannot reconstruct from that copy alone (docs/FORMAT.md, "Exact or loud"). A reader
#: without ckptstore does not know them and refuses the array; with ckptstore installed they
#: are registered (:mod:`ckptstore.format.zarrcodecs`) and refuse it with an explanation.
#: ``CHUNK_REF_CODEC``: some chunks live in another checkpoint's directory on this tier;
#: ``DELTA_CODEC``: some chunks are stored as deltas against a base checkpoint's chunks.
CHUNK_REF_CODEC = "ckptstore.chunk_ref"
DELTA_CODEC = "ckptstore.delta"

#: Chunk size the writer aims at. 8 MiB measured best for durable saves on the reference
#: machine (4 MiB costs more files and fsyncs, 16 MiB hurts parallel load).
DEFAULT_CHUNK_BYTES = 8 * 1024 * 1024

#: Bounds accepted for ``chunk_bytes``. The upper bound keeps every chunk well below Blosc's
#: 2 GiB buffer limit and bounds the per-thread scratch buffers a reader allocates.
MIN_CHUNK_BYTES = 16
MAX_CHUNK_BYTES = 1024 * 1024 * 1024

#: File names inside a checkpoint directory: Zarr v3 metadata of the group and of each array,
#: the manifest, and the commit marker (the manifest's digest, written last).
ZARR_JSON = "zarr.json"
MANIFEST_NAME = "manifest.json"
COMMIT_NAME = "COMMITTED"
#: The marker's temporary name while it is written (then hard-linked to COMMIT_NAME).
COMMIT_TMP_NAME = COMMIT_NAME + ".tmp"
#: In a copy re-encoded with another codec: the checkpoint's original ``manifest.json``
#: bytes, so the copy proves which content it holds (signatures sign the original digest).
ORIGINAL_MANIFEST_NAME = "manifest.orig.json"
#: The Ed25519 signature of a checkpoint's manifest digest (``ckpt sign``).
SIGNATURE_NAME = "SIGNATURE"
#: Names no data file of any layout may take.
RESERVED_NAMES = frozenset(
    {ZARR_JSON, MANIFEST_NAME, COMMIT_NAME, COMMIT_TMP_NAME, ORIGINAL_MANIFEST_NAME,
     SIGNATURE_NAME}
)

#: Folder of a packed array's chunk files (zarr v3 default chunk key encoding, separator
#: ``/``): chunk ``i`` of array ``a`` is ``a/c/i``.
CHUNK_DIR = "c"
#: Prefix of a DCP array's chunk files (separator ``.``): ``dcp/<name>/c.<i>.<j>``, or
#: just ``c`` for a 0-d array.
DCP_CHUNK_PREFIX = CHUNK_DIR + "."

#: The DCP layout's groups: one array per large tensor (or per shard of an irregular grid),
#: and each rank's packed small items.
DCP_ARRAY_GROUP = "dcp"
DCP_PACK_GROUP = "dcp_packs"
#: Saves across hosts (or straight to object storage) put each rank's arrays in a group of
#: its own, ``dcp_ranks/r<rank>/<name>``: every file then belongs to one rank (so to one
#: host's part), and object keys spread over one prefix per rank (S3 throttles per prefix).
DCP_RANK_GROUP = "dcp_ranks"
#: Value of the root group's ``ckptstore.layout`` attribute in a DCP checkpoint.
DCP_LAYOUT = "dcp"

#: The format's own keys inside the manifest's ``extra`` object (parsed into the typed
#: fields :attr:`~ckptstore.format.manifest.Manifest.dcp`, ``files`` and
#: ``reencoded_from``; caller metadata may not use them).
DCP_INDEX_KEY = "dcp"
FILES_KEY = "files"
REENCODED_FROM_KEY = "reencoded_from"


def chunk_rel(array: str, index: int) -> str:
    """Relative path of chunk ``index`` of packed (1-D) array ``array``: ``<array>/c/<index>``."""
    return f"{array}/{CHUNK_DIR}/{index}"

#: Limits applied to manifests read from disk: they may be hostile, and parsing must stay
#: cheap and bounded.
MAX_MANIFEST_BYTES = 256 * 1024 * 1024

#: First member of a bundle and of every sealed copy: the header saying what it holds
#: (ops/sharing/bundle.py writes it; format/sealed.py requires it first).
BUNDLE_HEADER = "ckptstore-bundle.json"
#: Directory of a bundle (or sealed copy) under which the checkpoint's own files are members.
BUNDLE_FILES = "checkpoint/"
#: JSON values (counted as ``,`` + ``{`` + ``[`` bytes) a manifest may hold, checked before
#: parsing: json.loads costs ~75 bytes of Python objects per value, so a 30 MB manifest of
#: 10^7 empty objects would otherwise take 750 MB and 10 s before any other check ran.
#: A real manifest holds ~15 values per tensor: this allows ~160k tensors.
MAX_JSON_ITEMS = 2_500_000
MAX_TENSORS = 1_000_000
MAX_TREE_DEPTH = 64
