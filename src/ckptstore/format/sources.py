"""Where the bytes a save writes come from: a state's tensors in memory, or a producer.

:func:`~ckptstore.format.writer.write_checkpoint` writes chunk by chunk; each chunk asks a
:class:`TensorSource` for the element ranges of the tensors it holds. A state passed as
usual is read from the tensors' own memory (:class:`MemorySource`); a
:class:`StreamedState` names its tensors by dtype and shape only and hands over a source
that computes their bytes when a chunk needs them (merging checkpoints averages the inputs'
ranges there: :mod:`ckptstore.ops.upkeep.merge`), so memory holds the chunks being written,
never the state.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ckptstore.errors import InvalidNameError, UnsafeObjectError
from ckptstore.format.dtypes import dtype_info
from ckptstore.format.flatten import FlatState
from ckptstore.format.tree import iter_tensor_refs, validate_tree
from ckptstore.format.validate import Invalid

__all__ = [
    "ByteBuffer",
    "MemorySource",
    "Range",
    "StreamedState",
    "StreamedTensor",
    "TensorSource",
]

logger = logging.getLogger(__name__)

#: A uint8 numpy array.
ByteBuffer = np.ndarray[Any, np.dtype[np.uint8]]
#: ``(tensor key, first element, stop element)``: elements ``[first, stop)`` of one tensor.
Range = tuple[str, int, int]


class TensorSource(ABC):
    """Produces the bytes of ranges of a save's tensors, chunk by chunk.

    Call order: the writer calls :meth:`read` from its writer threads, several at once,
    once for every chunk it writes (the ranges of the tensors that chunk holds, all of one
    dtype, in the chunk's order), plus at most once per array for the array's first
    elements when a codec is chosen by sampling. A thread uses the buffers returned before
    it calls :meth:`read` again, so an implementation may hand out per-thread buffers it
    reuses.
    """

    @abstractmethod
    def read(self, ranges: Sequence[Range]) -> list[ByteBuffer]:
        """The bytes of each range, in order (``(stop - first) * itemsize`` bytes each).

        Raises:
            CkptError: Whatever the source fails with; the save stops and commits nothing.
        """


class MemorySource(TensorSource):
    """Ranges of tensors held in memory, as views of their bytes (no copy)."""

    def __init__(self, views: Mapping[str, ByteBuffer], itemsizes: Mapping[str, int]) -> None:
        """Serve ``views[key]`` (a tensor's bytes) with ``itemsizes[key]`` bytes per element."""
        self._views = views
        self._itemsizes = itemsizes

    def read(self, ranges: Sequence[Range]) -> list[ByteBuffer]:
        """Views of the tensors' own bytes."""
        out = []
        for key, first, stop in ranges:
            isz = self._itemsizes[key]
            out.append(self._views[key][first * isz : stop * isz])
        return out


@dataclass(frozen=True, slots=True)
class StreamedTensor:
    """What the writer must know of a tensor before its bytes exist.

    Attributes:
        dtype: Its torch dtype.
        shape: Its shape.
    """

    dtype: torch.dtype
    shape: tuple[int, ...]


@dataclass(frozen=True)
class StreamedState:
    """A state whose tensors are produced while they are written.

    Attributes:
        tree: The JSON skeleton (:mod:`ckptstore.format.tree`), e.g. a manifest's tree or a
            part of it: every tensor node names a key of ``tensors``.
        tensors: Tensor key -> dtype and shape, in the order the tensors are packed
            (first occurrence in the tree, as :func:`~ckptstore.format.flatten_state`
            orders a state's tensors).
        source: Produces their bytes.
        threads: At least this many writer threads: a source that reads and computes its
            chunks (a merge reads every input's) keeps more threads busy than the writes
            alone; the writer takes the larger of this and its own count.
    """

    tree: Any
    tensors: Mapping[str, StreamedTensor]
    source: TensorSource
    threads: int = 1

    def flat(self) -> FlatState:
        """The state as the writer plans it: meta tensors (dtype and shape, no memory).

        Raises:
            UnsafeObjectError: If a dtype cannot be stored.
            InvalidNameError: If the tree is malformed or its tensor references and
                ``tensors`` disagree.
        """
        names: dict[str, str] = {}
        for key, spec in self.tensors.items():
            info = dtype_info(spec.dtype)
            if info is None:
                raise UnsafeObjectError(f"tensor {key!r} has unsupported dtype {spec.dtype}")
            names[key] = info.name
        try:
            validate_tree(self.tree, names)
        except Invalid as exc:
            raise InvalidNameError(f"the streamed state's tree is malformed: {exc}") from exc
        referenced = {key for _, _, key in iter_tensor_refs(self.tree)}
        if referenced != set(self.tensors):
            extra = sorted(set(self.tensors) - referenced)
            raise InvalidNameError(
                f"the streamed state lists tensors its tree never references: {extra[:5]}"
            )
        tensors = {
            key: torch.empty(spec.shape, dtype=spec.dtype, device="meta")
            for key, spec in self.tensors.items()
        }
        return FlatState(tensors=tensors, tree=self.tree)
