"""What DCP sees of a stored checkpoint: its stored boxes and its ``Metadata``.

The boxes DCP sees as "saved chunks" are our zarr chunks (for per-tensor arrays) and the
packed pieces, so each of DCP's ReadItems touches exactly one stored box, and a rank reads
only the chunks that overlap its shards.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex

from ckptstore.format.dcp.layout import (
    ArrayInfo,
    BlobItem,
    DcpIndex,
    Piece,
    TensorItem,
    chunk_key,
    chunks_of_piece,
)
from ckptstore.format.dtypes import dtype_by_name

__all__ = ["BoxLoc", "build_metadata", "dtype_of", "stored_boxes"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class BoxLoc:
    """One stored box: a whole chunk of a per-tensor array, or a packed piece.

    Attributes:
        fqn: The tensor.
        array: The array holding it.
        offsets: Global offsets of the box.
        sizes: Its sizes (edge chunks are clipped to the tensor).
        key: Chunk key, for a chunk of a per-tensor array.
        at: Element offset in the pack, for a packed piece.
    """

    fqn: str
    array: ArrayInfo
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    key: str | None = None
    at: int | None = None


def _piece_boxes(item: TensorItem, piece: Piece, arrays: dict[str, ArrayInfo]) -> Iterator[BoxLoc]:
    array = arrays[piece.array]
    if piece.at is not None:
        yield BoxLoc(item.fqn, array, piece.offsets, piece.sizes, at=piece.at)
        return
    assert piece.origin is not None
    if piece.numel == 0:
        yield BoxLoc(item.fqn, array, piece.offsets, piece.sizes, key=None, at=0)
        return
    cs = array.chunk_shape
    for coords in chunks_of_piece(piece.origin, cs, piece.offsets, piece.sizes):
        start = tuple(a + c * n for a, c, n in zip(piece.origin, coords, cs, strict=True))
        sizes = tuple(
            min(n, a + s - b)
            for n, a, s, b in zip(cs, piece.origin, array.shape, start, strict=True)
        )
        yield BoxLoc(item.fqn, array, start, sizes, key=chunk_key(coords))


def stored_boxes(index: DcpIndex) -> dict[str, list[BoxLoc]]:
    """Every stored box of every tensor, by fqn."""
    return {
        fqn: [box for piece in item.pieces for box in _piece_boxes(item, piece, index.arrays)]
        for fqn, item in index.tensors.items()
    }


def build_metadata(
    index: DcpIndex, boxes: dict[str, list[BoxLoc]]
) -> tuple[Metadata, dict[MetadataIndex, BoxLoc | BlobItem]]:
    """DCP ``Metadata`` for a checkpoint, and the storage location of every saved chunk."""
    # Imported here: torch.distributed.checkpoint takes most of a second to import (it
    # registers DTensor's ops), and every process that opens the format imports this module.
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata,
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        TensorProperties,
        TensorStorageMetadata,
    )

    sd_meta: dict[str, TensorStorageMetadata | BytesStorageMetadata] = {}
    where: dict[MetadataIndex, BoxLoc | BlobItem] = {}
    for fqn, item in index.tensors.items():
        info = index.arrays[item.pieces[0].array].info if item.pieces else None
        dtype = info.torch_dtype if info is not None else dtype_of(item.dtype)
        chunks = []
        for box in boxes[fqn]:
            chunks.append(ChunkStorageMetadata(torch.Size(box.offsets), torch.Size(box.sizes)))
            where[MetadataIndex(fqn, box.offsets)] = box
        sd_meta[fqn] = TensorStorageMetadata(
            properties=TensorProperties(dtype=dtype, requires_grad=item.requires_grad),
            size=torch.Size(item.shape),
            chunks=chunks,
        )
    for fqn, blob in index.blobs.items():
        sd_meta[fqn] = BytesStorageMetadata()
        where[MetadataIndex(fqn)] = blob
    planner_data = (
        None if index.planner_data is None else {f: tuple(p) for f, p in index.planner_data.items()}
    )
    metadata = Metadata(
        state_dict_metadata=sd_meta,
        planner_data=planner_data,
        storage_data=where,
        version=index.dcp_version,
    )
    return metadata, where


def dtype_of(name: str) -> torch.dtype:
    """The torch dtype of an index dtype name (validated when the index was parsed)."""
    info = dtype_by_name(name)
    assert info is not None
    return info.torch_dtype
