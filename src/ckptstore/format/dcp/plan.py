"""The coordinator's storage plan for a DCP save: which rank writes which array, and how.

DCP gathers every rank's :class:`~torch.distributed.checkpoint.planner.SavePlan` on the
coordinator (after its planner removed duplicate replicated items), so the coordinator sees
every shard of every tensor and can choose, per tensor:

* a **grid array** (one N-d array of the global shape) when the shards form a regular grid:
  its chunks are the shard grid, refined along dim 0 to about ``chunk_bytes``, so every chunk
  lies inside one shard and exactly one rank writes it;
* **one array per shard** when they do not (e.g. nested sharding of one dimension);
* the rank's **pack** for shards smaller than ``pack_below``: small tensors must not cost one
  file each (biases, norms, optimizer steps), so each rank packs its small shards by dtype
  into flat arrays, as the regular format does.

With ``per_rank`` (saves across hosts, or straight to object storage) no array is shared
between ranks: each large shard gets an array of its own in its rank's group
(:func:`~ckptstore.format.dcp.layout.rank_array_path`), so every file belongs to one rank.

The result is one :class:`RankTask` per rank, sent back to the ranks inside
``SavePlan.storage_data`` by DCP's own scatter, so no extra collective is needed. It also
carries the checkpoint id the coordinator allocated in the catalog.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field

import torch
from torch.distributed.checkpoint.planner import SavePlan, WriteItemType

from ckptstore.errors import CkptError, UnsafeObjectError
from ckptstore.format.dcp.layout import (
    Box,
    array_path,
    grid_pitch,
    rank_array_path,
    refine_chunk_shape,
)
from ckptstore.format.dtypes import dtype_info

__all__ = ["ArraySpec", "RankTask", "Slot", "SlotKey", "assign_slots", "item_dtype_name"]

logger = logging.getLogger(__name__)

#: (fqn, global offsets of the shard): identifies one write item across ranks.
SlotKey = tuple[str, tuple[int, ...]]


@dataclass(frozen=True)
class ArraySpec:
    """An N-d array whose geometry the coordinator fixed.

    Attributes:
        path: Relative path (``dcp/<name>`` or ``dcp/<name>@<k>``).
        dtype: Torch dtype name.
        shape: Array shape.
        chunk_shape: Chunk shape.
        origin: Global offsets of the array's element 0 (zeros for a grid array).
    """

    path: str
    dtype: str
    shape: tuple[int, ...]
    chunk_shape: tuple[int, ...]
    origin: tuple[int, ...]


@dataclass(frozen=True)
class Slot:
    """Where one shard goes: an array of its own (grid or per-shard). Packed shards have none.

    Attributes:
        array: The array.
        write_meta: Whether this rank writes the array's ``zarr.json`` (exactly one does).
    """

    array: ArraySpec
    write_meta: bool


@dataclass(frozen=True)
class RankTask:
    """Everything one rank needs to write its part (sent in ``SavePlan.storage_data``).

    Attributes:
        ckpt_id: Checkpoint id from the catalog.
        directory: The checkpoint directory (shared by all ranks).
        rank: This rank's position in the save's process group.
        codec: Codec preset.
        chunk_bytes: Target chunk size (also the pack chunk size).
        threads: Writer threads per rank.
        slots: Shards written into arrays of their own; every other tensor item is packed.
    """

    ckpt_id: str
    directory: str
    rank: int
    codec: str
    chunk_bytes: int
    threads: int
    slots: dict[SlotKey, Slot] = field(default_factory=dict)


def item_dtype_name(dtype: object, fqn: str) -> str:
    """Name of a supported torch dtype, or UnsafeObjectError naming the item."""
    info = dtype_info(dtype) if isinstance(dtype, torch.dtype) else None
    if info is None:
        raise UnsafeObjectError(
            f"tensor {fqn!r} has dtype {dtype}, which ckptstore cannot store bit-exactly; "
            "cast it to a supported dtype before saving"
        )
    return info.name


def assign_slots(
    plans: list[SavePlan], *, chunk_bytes: int, pack_below: int, per_rank: bool = False
) -> tuple[list[dict[SlotKey, Slot]], dict[str, ArraySpec]]:
    """Decide the array of every large shard in the global plan.

    Args:
        plans: The deduplicated plans, one per rank, in rank order.
        chunk_bytes: Target chunk size.
        pack_below: Shards smaller than this many bytes are packed by their rank.
        per_rank: Give every large shard an array of its own in its rank's group, never an
            array another rank writes to (the layout of saves across hosts).

    Returns:
        Per rank, its slots; and every array by path.

    Raises:
        CkptError: If two ranks plan the same shard (a planner that does not deduplicate
            replicated tensors) — they would both write the same chunk files.
        UnsafeObjectError: If a tensor has a dtype the format cannot store.
    """
    by_fqn: dict[str, list[tuple[int, Box]]] = {}
    meta: dict[str, tuple[str, tuple[int, ...], int]] = {}
    for rank, plan in enumerate(plans):
        for item in plan.items:
            if item.type == WriteItemType.BYTE_IO or item.tensor_data is None:
                continue
            fqn = item.index.fqn
            data = item.tensor_data
            box = (tuple(data.chunk.offsets), tuple(data.chunk.sizes))
            name = item_dtype_name(data.properties.dtype, fqn)
            meta.setdefault(fqn, (name, tuple(data.size), data.properties.dtype.itemsize))
            by_fqn.setdefault(fqn, []).append((rank, box))
    slots: list[dict[SlotKey, Slot]] = [{} for _ in plans]
    arrays: dict[str, ArraySpec] = {}
    for fqn, owned in by_fqn.items():
        dtype, shape, itemsize = meta[fqn]
        seen: dict[Box, int] = {}
        for rank, box in owned:
            if box in seen:
                raise CkptError(
                    f"shard {box[0]} of {fqn!r} is planned on ranks {seen[box]} and {rank}; "
                    "use a save planner that deduplicates replicated tensors (DCP's "
                    "DefaultSavePlanner does)"
                )
            seen[box] = rank
        nonempty = [(r, b) for r, b in owned if math.prod(b[1]) > 0]
        large = [(r, b) for r, b in nonempty if math.prod(b[1]) * itemsize >= pack_below]
        if not large:
            continue  # every shard is packed by its own rank
        if per_rank:
            _own_arrays(fqn, dtype, itemsize, large, chunk_bytes, slots, arrays)
            continue
        pitch = grid_pitch(shape, [b for _, b in nonempty])
        if pitch is not None:
            spec = ArraySpec(
                array_path(fqn), dtype, shape, refine_chunk_shape(pitch, itemsize, chunk_bytes),
                tuple(0 for _ in shape),
            )
            arrays[spec.path] = spec
            # Exactly one shard's rank writes the array's zarr.json: the lowest rank's first.
            first = min(nonempty, key=lambda rb: (rb[0], rb[1][0]))
            for rank, (offsets, sizes) in nonempty:
                mine = (rank, (offsets, sizes)) == first
                slots[rank][(fqn, offsets)] = Slot(spec, write_meta=mine)
            continue
        logger.info("shards of %s form no regular grid; one array per large shard", fqn)
        for k, (rank, (offsets, sizes)) in enumerate(sorted(large, key=lambda rb: rb[1])):
            spec = ArraySpec(
                array_path(fqn, k), dtype, sizes, refine_chunk_shape(sizes, itemsize, chunk_bytes),
                offsets,
            )
            arrays[spec.path] = spec
            slots[rank][(fqn, offsets)] = Slot(spec, write_meta=True)
    return slots, arrays


def _own_arrays(
    fqn: str,
    dtype: str,
    itemsize: int,
    large: list[tuple[int, Box]],
    chunk_bytes: int,
    slots: list[dict[SlotKey, Slot]],
    arrays: dict[str, ArraySpec],
) -> None:
    """One array per large shard, in its rank's group (``@k`` when a rank holds several)."""
    by_rank: dict[int, list[Box]] = {}
    for rank, box in large:
        by_rank.setdefault(rank, []).append(box)
    for rank, boxes in by_rank.items():
        boxes.sort()
        for k, (offsets, sizes) in enumerate(boxes):
            spec = ArraySpec(
                rank_array_path(rank, fqn, k if len(boxes) > 1 else None), dtype, sizes,
                refine_chunk_shape(sizes, itemsize, chunk_bytes), offsets,
            )
            arrays[spec.path] = spec
            slots[rank][(fqn, offsets)] = Slot(spec, write_meta=True)
