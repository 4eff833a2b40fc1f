"""Names and geometry of the DCP layout inside a checkpoint directory.

A checkpoint saved through :class:`~ckptstore.ops.dcp.ZarrStorageWriter` is one Zarr
v3 group like every ckptstore checkpoint (``zarr.json``, ``manifest.json``, ``COMMITTED``),
but its tensors are not in the packed per-dtype arrays. Instead::

    dcp/zarr.json                 group
    dcp/<escaped fqn>/zarr.json   one N-d array per large tensor, its global shape
    dcp/<escaped fqn>/c.<i>.<j>   chunks; the chunk grid is the shard grid (refined along
                                  dim 0 to about ``chunk_bytes``), so each chunk belongs to
                                  exactly one rank's shard
    dcp/<escaped fqn>@<k>         one array per shard, for shard grids that are not regular
    dcp_packs/zarr.json           group
    dcp_packs/r<rank>.<dtype>     small tensors/shards of one rank, packed flat (1-D)
    dcp_packs/r<rank>.bytes       non-tensor items of one rank: DCP's torch.save bytes (uint8)

A save across hosts (or straight to object storage) puts every large shard in an array of
its own inside its rank's group instead of the shared ``dcp/`` arrays, so every file belongs
to exactly one rank, hence to one host's part, and object keys spread over one prefix per
rank::

    dcp_ranks/zarr.json                     group
    dcp_ranks/r<rank>/zarr.json             group of one rank (written by that rank)
    dcp_ranks/r<rank>/<escaped fqn>[@<k>]   one array per shard (its origin: the shard's
                                            global offsets), chunked to about chunk_bytes

Every chunk is ``bytes`` [+ ``blosc``] + ``crc32c`` with zarr's default chunk-key encoding
(separator ``.``), so ``zarr.open_group(dir)`` reads every array. The index that says which
piece of which tensor lives where is :attr:`Manifest.dcp
<ckptstore.format.manifest.Manifest.dcp>` (JSON under the manifest's ``extra["dcp"]``,
covered by the manifest digest). Its records and the chunk-key geometry it is checked with
are defined with the manifest (:mod:`ckptstore.format.manifest.dcpindex`), which parses
them, and are re-exported here as part of the layout.

This module is pure geometry and bookkeeping: no I/O, no process group.
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Sequence

from ckptstore.format.constants import DCP_ARRAY_GROUP, DCP_PACK_GROUP, DCP_RANK_GROUP
from ckptstore.format.keys import escape_node_name
from ckptstore.format.manifest import Manifest
from ckptstore.format.manifest.dcpindex import (
    INDEX_VERSION,
    ArrayInfo,
    BlobItem,
    Box,
    DcpIndex,
    Piece,
    TensorItem,
    chunk_file,
    chunk_grid,
    chunk_key,
    chunks_of_piece,
)

__all__ = [
    "INDEX_VERSION",
    "ArrayInfo",
    "BlobItem",
    "Box",
    "DcpIndex",
    "Piece",
    "TensorItem",
    "array_path",
    "chunk_file",
    "chunk_grid",
    "chunk_key",
    "chunks_of_piece",
    "escape_fqn",
    "grid_pitch",
    "is_dcp_manifest",
    "pack_path",
    "rank_array_path",
    "rank_group",
    "rank_of_file",
    "refine_chunk_shape",
]

logger = logging.getLogger(__name__)



def is_dcp_manifest(manifest: Manifest) -> bool:
    """Whether a checkpoint was saved through DCP (its tensors are in this layout).

    Cheap (no torch.distributed import), for the store's load/verify dispatch.
    """
    return manifest.dcp is not None


def escape_fqn(fqn: str) -> str:
    """Zarr node name for a fully qualified name (see ``format.keys.escape_node_name``)."""
    return escape_node_name(fqn)


def array_path(fqn: str, piece: int | None = None) -> str:
    """Relative path of a tensor's array (``piece``: the k-th array of an irregular grid)."""
    name = escape_fqn(fqn)
    return f"{DCP_ARRAY_GROUP}/{name}" if piece is None else f"{DCP_ARRAY_GROUP}/{name}@{piece}"


def pack_path(rank: int, kind: str) -> str:
    """Relative path of a rank's pack array (``kind``: a dtype name or ``bytes``)."""
    return f"{DCP_PACK_GROUP}/r{rank}.{kind}"


def rank_group(rank: int) -> str:
    """Relative path of one rank's group in the per-rank layout (``dcp_ranks/r<rank>``)."""
    return f"{DCP_RANK_GROUP}/r{rank}"


def rank_array_path(rank: int, fqn: str, piece: int | None = None) -> str:
    """Relative path of one shard's array in its rank's group (``piece``: the k-th shard of
    ``fqn`` this rank holds, when it holds more than one)."""
    name = escape_fqn(fqn)
    return f"{rank_group(rank)}/{name}" if piece is None else f"{rank_group(rank)}/{name}@{piece}"


_RANK_FILE = re.compile(
    rf"^(?:{re.escape(DCP_RANK_GROUP)}/r([0-9]{{1,9}})/|{re.escape(DCP_PACK_GROUP)}/r([0-9]{{1,9}})\.)"
)


def rank_of_file(rel: str) -> int | None:
    """The rank that wrote a file of the per-rank layout, or None for a file every part
    shares (the root and group documents, ``manifest.json``, ``COMMITTED``) or one of the
    shared ``dcp/`` arrays."""
    match = _RANK_FILE.match(rel)
    if match is None:
        return None
    return int(match.group(1) or match.group(2))


def grid_pitch(shape: Sequence[int], boxes: Sequence[Box]) -> tuple[int, ...] | None:
    """The regular grid the shards of one tensor form, or None if they form none.

    A grid is regular when, along every dimension, every shard starts at a multiple of the
    largest shard size and is that size, except at the tensor's upper edge. DTensor ``Shard``
    placements (``torch.chunk`` semantics, FSDP2 included) always are; nested shardings of one
    dimension and hand-made ShardedTensor specs may not be.

    Args:
        shape: The tensor's global shape.
        boxes: Its non-empty shards.
    """
    if not boxes:
        return None
    pitch = tuple(max(sizes[d] for _, sizes in boxes) for d in range(len(shape)))
    for offsets, sizes in boxes:
        dims = zip(offsets, sizes, pitch, shape, strict=True)
        for d, (off, size, step, total) in enumerate(dims):
            if step <= 0 or off % step or (size != step and off + size != total):
                logger.debug("irregular shard grid on dim %d: offset %d size %d", d, off, size)
                return None
    return pitch


def _divisors(n: int) -> list[int]:
    small, large = [], []
    i = 1
    while i * i <= n:
        if n % i == 0:
            small.append(i)
            if i * i != n:
                large.append(n // i)
        i += 1
    return small + large[::-1]


def refine_chunk_shape(pitch: Sequence[int], itemsize: int, chunk_bytes: int) -> tuple[int, ...]:
    """Split a shard-sized chunk into about ``chunk_bytes`` pieces that keep the grid aligned.

    Each dimension is divided only by a divisor of its size, so every chunk still lies in
    one shard. Dimensions are tried in order (dim 0 first keeps chunks contiguous in a
    row-major shard); a dimension whose divisors are all far above what is needed is split
    by the largest divisor below it and the next dimension finishes the job.

    Args:
        pitch: The shard grid's chunk shape.
        itemsize: Bytes per element.
        chunk_bytes: Target chunk size.
    """
    shape = list(pitch)
    for d in range(len(shape)):
        nbytes = math.prod(shape) * itemsize
        need = -(-nbytes // chunk_bytes)
        if need <= 1:
            break
        divisors = _divisors(shape[d])
        above = [k for k in divisors if k >= need]
        if above and above[0] <= 2 * need:
            shape[d] //= above[0]
            break
        below = [k for k in divisors if k <= need]
        shape[d] //= below[-1]
    return tuple(shape)
