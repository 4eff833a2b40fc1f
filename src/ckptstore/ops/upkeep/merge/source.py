"""The bytes of a merged checkpoint, computed chunk by chunk from the inputs' chunks.

:class:`MergeSource` is the :class:`~ckptstore.format.sources.TensorSource` the writer asks
for each chunk it writes: it reads the same element ranges from every input
(:class:`~ckptstore.format.reader.RangeReader`, every chunk verified), sums them weighted in
the accumulation dtype, and rounds once into the output's dtype. Integer and bool ranges are
the first input's bytes.

Memory: per writer thread, one output buffer and one accumulator of one chunk each (the
accumulator twice as wide for float64 sums; a conversion buffer too for float8, which torch
cannot add across dtypes), reused for every chunk; so a merge holds ``threads`` chunks'
worth of buffers, whatever the size of the tensors or the number of inputs.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from ckptstore.format.reader import RangeReader
from ckptstore.format.sources import ByteBuffer, Range, TensorSource

__all__ = ["MergeSource"]

logger = logging.getLogger(__name__)

# Dtypes torch will not promote in a mixed-dtype add: converted through a buffer first.
_NO_PROMOTION = frozenset({
    torch.float8_e4m3fn, torch.float8_e4m3fnuz, torch.float8_e5m2, torch.float8_e5m2fnuz,
})


class MergeSource(TensorSource):
    """Weighted sums of the inputs' ranges (see the module docstring).

    Call order: as any :class:`~ckptstore.format.sources.TensorSource`; :meth:`read` may run
    on several threads at once.
    """

    def __init__(
        self,
        inputs: Sequence[RangeReader],
        weights: Sequence[float],
        dtypes: Mapping[str, torch.dtype],
        accumulate: Mapping[str, torch.dtype | None],
    ) -> None:
        """Merge ``inputs`` with ``weights`` (same order, summing to 1).

        Args:
            inputs: A reader per input; the first also supplies the copied tensors.
            weights: The normalised weights.
            dtypes: Tensor key -> dtype (the same in every input).
            accumulate: Tensor key -> accumulation dtype; None: copied from the first input.
        """
        self._inputs = list(inputs)
        self._weights = [float(w) for w in weights]
        self._dtypes = dtypes
        self._accumulate = accumulate
        self._local = threading.local()

    def _buffer(self, name: str, nbytes: int) -> ByteBuffer:
        # Reused per thread: a fresh chunk-sized allocation per call would page-fault at
        # ~2 GB/s (docs/ARCHITECTURE.md, "the path of a save").
        buf: ByteBuffer | None = getattr(self._local, name, None)
        if buf is None or len(buf) < nbytes:
            buf = np.empty(nbytes, dtype=np.uint8)
            setattr(self._local, name, buf)
        return buf[:nbytes]

    def read(self, ranges: Sequence[Range]) -> list[ByteBuffer]:
        """The merged bytes of each range (views of this thread's output buffer)."""
        if not ranges:
            return []
        dtype = self._dtypes[ranges[0][0]]
        isz = torch.empty((), dtype=dtype).element_size()
        sizes = [(stop - first) * isz for _, first, stop in ranges]
        out = self._buffer("out", sum(sizes))
        views: list[ByteBuffer] = []
        pos = 0
        for size in sizes:
            views.append(out[pos : pos + size])
            pos += size
        wanted = [(key, first, stop, view)
                  for (key, first, stop), view in zip(ranges, views, strict=True)]
        acc_dtype = self._accumulate[ranges[0][0]]
        if acc_dtype is None:
            self._inputs[0].read(wanted)
            return views
        n = len(out) // isz
        acc = self._tensor("acc", n, acc_dtype)
        values = _typed(out, dtype)
        acc.zero_()
        for reader, weight in zip(self._inputs, self._weights, strict=True):
            # Each input lands in the output buffer, is added into the accumulator, and the
            # buffer is reused for the next: two chunk buffers whatever the input count.
            reader.read(wanted)
            if dtype in _NO_PROMOTION:
                wide = self._tensor("convert", n, acc_dtype)
                wide.copy_(values)
                acc.add_(wide, alpha=weight)
            else:
                acc.add_(values, alpha=weight)
        values.copy_(acc)  # rounded once, into the tensor's own dtype
        return views

    def _tensor(self, name: str, n: int, dtype: torch.dtype) -> torch.Tensor:
        isz = torch.empty((), dtype=dtype).element_size()
        return _typed(self._buffer(name, n * isz), dtype)


def _typed(buf: ByteBuffer, dtype: torch.dtype) -> torch.Tensor:
    """``buf`` as a 1-d tensor of ``dtype`` sharing its memory."""
    raw: Any = torch.from_numpy(buf)
    typed: torch.Tensor = raw.view(dtype)
    return typed
