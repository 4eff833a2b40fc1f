"""Packing geometry: which tensor goes where in which array, and how arrays are chunked.

Chunk dedup and delta encoding work per chunk, so chunk boundaries follow tensor boundaries
wherever that is affordable:

* a tensor of :data:`~ckptstore.format.constants.PER_TENSOR_MIN_BYTES` (1 MiB) or more gets
  a flat 1-D array of its own, ``tensors/<escaped key>``: a frozen weight's chunks are then
  identical in every save whatever its neighbours do;
* smaller tensors are packed together, one flat array per dtype named after it (``float32``,
  ...), in flatten order: a chunk file each would cost more than it could save. When a
  dtype's packed tensors span several chunks, the ones under 1/16 of a chunk (biases,
  norms, LoRA adapters, step counters) go to ``<dtype>_small``: interleaved with larger
  frozen ones, a few changing small tensors would otherwise touch nearly every chunk;
* in lossy delta mode, the small floating-point tensors the lossy scope selects are packed
  apart (``<dtype>_lossy``), so no chunk mixes approximate and exact values; a large one is
  lossy or not as a whole.

Every array is cut into equal chunks (a regular Zarr grid) whose length is balanced so the
padded tail of the last chunk wastes fewer than ``n_chunks`` elements.
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ckptstore.format.constants import TENSOR_GROUP
from ckptstore.format.dtypes import DtypeInfo, dtype_info
from ckptstore.format.keys import escape_node_name, key_matches

if TYPE_CHECKING:
    import torch

__all__ = [
    "LOSSY_DTYPES",
    "LOSSY_SUFFIX",
    "SMALL_DIVISOR",
    "SMALL_SUFFIX",
    "ArrayPlan",
    "Placement",
    "balanced_chunk_len",
    "chunk_span",
    "plan_layout",
    "tensor_array_name",
]

logger = logging.getLogger(__name__)

#: Array name suffixes of the separately packed groups (see the module docstring).
SMALL_SUFFIX = "_small"
LOSSY_SUFFIX = "_lossy"
#: A packed tensor is small when it is under ``chunk_bytes / SMALL_DIVISOR`` bytes.
SMALL_DIVISOR = 16
#: Dtypes whose values may be stored lossily.
LOSSY_DTYPES = frozenset({"float16", "bfloat16", "float32", "float64"})


def balanced_chunk_len(length: int, itemsize: int, chunk_bytes: int) -> int:
    """Return the chunk length (elements) for an array of ``length`` elements.

    ``n_chunks = ceil(nbytes / chunk_bytes)`` and ``chunk_len = ceil(length / n_chunks)``.
    An empty array gets chunk length 1 (zarr requires a positive chunk shape) and no chunks.
    """
    if length <= 0:
        return 1
    n_chunks = -(-(length * itemsize) // chunk_bytes)
    return -(-length // n_chunks)


def chunk_span(offset: int, numel: int, chunk_len: int) -> tuple[int, int]:
    """Return ``[start, stop)`` chunk indices covering elements ``[offset, offset+numel)``.

    Empty tensors span no chunk: ``start == stop``.
    """
    start = offset // chunk_len
    if numel == 0:
        return start, start
    return start, (offset + numel - 1) // chunk_len + 1


@dataclass(frozen=True, slots=True)
class Placement:
    """Where one tensor lives.

    Attributes:
        key: Tensor key.
        array: Array name (the dtype name).
        offset: First element in the array.
        numel: Number of elements.
        shape: Tensor shape.
    """

    key: str
    array: str
    offset: int
    numel: int
    shape: tuple[int, ...]


@dataclass
class ArrayPlan:
    """One packed array.

    Attributes:
        info: Dtype storage description.
        length: Number of elements.
        chunk_len: Elements per chunk.
        members: Placements in packing order.
        array_name: The array name (default ``info.name``; a suffixed name for a group).
        lossy: Whether it holds tensors of the lossy scope.
        tensor: The key of the one tensor an array of its own holds; None for a packed one.
    """

    info: DtypeInfo
    length: int = 0
    chunk_len: int = 1
    members: list[Placement] = field(default_factory=list)
    array_name: str = ""
    lossy: bool = False
    tensor: str | None = None
    _starts: list[int] = field(default_factory=list, repr=False)

    @property
    def name(self) -> str:
        """The array name."""
        return self.array_name or self.info.name

    @property
    def n_chunks(self) -> int:
        """Number of chunk files."""
        return -(-self.length // self.chunk_len)

    @property
    def chunk_nbytes(self) -> int:
        """Unencoded bytes per chunk, padding included."""
        return self.chunk_len * self.info.itemsize

    def chunk_members(self, index: int) -> Iterator[tuple[Placement, int, int]]:
        """Yield ``(placement, first, stop)`` element ranges, relative to each tensor,
        of the non-empty tensors overlapping chunk ``index``."""
        lo = index * self.chunk_len
        hi = min(lo + self.chunk_len, self.length)
        # Members are sorted by offset; empty tensors never overlap anything.
        pos = max(bisect.bisect_right(self._starts, lo) - 1, 0)
        while pos < len(self.members):
            member = self.members[pos]
            if member.offset >= hi:
                break
            end = member.offset + member.numel
            if member.numel and end > lo:
                yield member, max(lo, member.offset) - member.offset, min(hi, end) - member.offset
            pos += 1


def tensor_array_name(key: str) -> str:
    """Name of the array of its own that tensor ``key`` gets: ``tensors/<escaped key>``."""
    return f"{TENSOR_GROUP}/{escape_node_name(key)}"


def _groups(
    tensors: Mapping[str, torch.Tensor],
    chunk_bytes: int,
    lossy_scope: Sequence[str] | None,
    per_tensor_bytes: int | None,
) -> dict[str, tuple[DtypeInfo, str, bool, bool]]:
    """Tensor key -> (dtype info, array name, lossy, array of its own)."""
    infos: dict[str, DtypeInfo] = {}
    totals: dict[str, int] = {}
    groups: dict[str, tuple[DtypeInfo, str, bool, bool]] = {}
    for key, tensor in tensors.items():
        info = dtype_info(tensor.dtype)
        if info is None:  # flatten_state refuses these; guard direct callers
            raise ValueError(f"tensor {key!r} has unsupported dtype {tensor.dtype}")
        lossy = bool(lossy_scope) and info.name in LOSSY_DTYPES and key_matches(
            key, lossy_scope or ())
        nbytes = tensor.numel() * info.itemsize
        if per_tensor_bytes is not None and nbytes >= per_tensor_bytes:
            groups[key] = (info, tensor_array_name(key), lossy, True)
            continue
        infos[key] = info
        if not lossy:
            totals[info.name] = totals.get(info.name, 0) + nbytes
    names: dict[str, str] = {}
    for key, info in infos.items():
        nbytes = tensors[key].numel() * info.itemsize
        lossy = bool(lossy_scope) and info.name in LOSSY_DTYPES and key_matches(
            key, lossy_scope or ())
        if lossy:
            names[key] = info.name + LOSSY_SUFFIX
        elif nbytes > 0 and nbytes * SMALL_DIVISOR < chunk_bytes < totals[info.name] // 2:
            names[key] = info.name + SMALL_SUFFIX
        else:
            names[key] = info.name
    # A small group with nothing larger beside it is just the dtype's array.
    plain = set(names.values())
    for key, name in names.items():
        if name.endswith(SMALL_SUFFIX) and name[: -len(SMALL_SUFFIX)] not in plain:
            names[key] = name[: -len(SMALL_SUFFIX)]
    for key, name in names.items():
        groups[key] = (infos[key], name, name.endswith(LOSSY_SUFFIX), False)
    return {key: groups[key] for key in tensors}


def plan_layout(
    tensors: Mapping[str, torch.Tensor],
    chunk_bytes: int,
    *,
    lossy_scope: Sequence[str] | None = None,
    per_tensor_bytes: int | None = None,
) -> dict[str, ArrayPlan]:
    """Assign every tensor an array and offset, and pick each array's chunk length.

    The layout depends only on the tensors' keys, dtypes and sizes (and the lossy scope), so
    saving the same structure again yields the same arrays and chunk boundaries: what chunk
    dedup and delta encoding rely on.

    Args:
        tensors: Tensor key -> tensor, in packing order.
        chunk_bytes: Target chunk size in bytes.
        lossy_scope: Key patterns of the tensors of the lossy scope, if any.
        per_tensor_bytes: Tensors of at least this many bytes get an array of their own
            (the checkpoint writer passes
            :data:`~ckptstore.format.constants.PER_TENSOR_MIN_BYTES`); None packs every
            tensor (the DCP layout's per-rank packs).

    Returns:
        Array name -> plan, in order of first appearance.
    """
    plans: dict[str, ArrayPlan] = {}
    for key, (info, name, lossy, own) in _groups(
        tensors, chunk_bytes, lossy_scope, per_tensor_bytes
    ).items():
        tensor = tensors[key]
        plan = plans.get(name)
        if plan is None:
            plan = plans[name] = ArrayPlan(
                info, array_name=name, lossy=lossy, tensor=key if own else None
            )
        numel = tensor.numel()
        plan.members.append(Placement(key, name, plan.length, numel, tuple(tensor.shape)))
        plan._starts.append(plan.length)
        plan.length += numel
    for plan in plans.values():
        plan.chunk_len = balanced_chunk_len(plan.length, plan.info.itemsize, chunk_bytes)
    return plans
