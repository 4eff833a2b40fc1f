"""Packing geometry: which tensor goes where in which array, and how arrays are chunked.

Tensors are grouped by dtype into one flat 1-D array per dtype, in flatten order. Each
array is cut into equal chunks (a regular Zarr grid) whose length is balanced so the padded
tail of the last chunk wastes fewer than ``n_chunks`` elements.
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

import torch

from ckptstore.format.dtypes import DtypeInfo, dtype_info

__all__ = [
    "ArrayPlan",
    "Placement",
    "balanced_chunk_len",
    "chunk_span",
    "plan_layout",
]

logger = logging.getLogger(__name__)


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
        info: Dtype storage description (``info.name`` is the array name).
        length: Number of elements.
        chunk_len: Elements per chunk.
        members: Placements in packing order.
    """

    info: DtypeInfo
    length: int = 0
    chunk_len: int = 1
    members: list[Placement] = field(default_factory=list)
    _starts: list[int] = field(default_factory=list, repr=False)

    @property
    def name(self) -> str:
        """The array name."""
        return self.info.name

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


def plan_layout(tensors: Mapping[str, torch.Tensor], chunk_bytes: int) -> dict[str, ArrayPlan]:
    """Assign every tensor an array and offset, and pick each array's chunk length.

    Args:
        tensors: Tensor key -> tensor, in packing order.
        chunk_bytes: Target chunk size in bytes.

    Returns:
        Array name -> plan, in order of first appearance.
    """
    plans: dict[str, ArrayPlan] = {}
    for key, tensor in tensors.items():
        info = dtype_info(tensor.dtype)
        if info is None:  # flatten_state refuses these; guard direct callers
            raise ValueError(f"tensor {key!r} has unsupported dtype {tensor.dtype}")
        plan = plans.get(info.name)
        if plan is None:
            plan = plans[info.name] = ArrayPlan(info)
        numel = tensor.numel()
        plan.members.append(Placement(key, info.name, plan.length, numel, tuple(tensor.shape)))
        plan._starts.append(plan.length)
        plan.length += numel
    for plan in plans.values():
        plan.chunk_len = balanced_chunk_len(plan.length, plan.info.itemsize, chunk_bytes)
    return plans
