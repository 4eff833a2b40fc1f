"""The bytes of a merged checkpoint, computed chunk by chunk from the inputs' chunks.

:class:`MergeSource` is the :class:`~ckptstore.format.sources.TensorSource` the writer asks
for each chunk it writes: it reads the same element ranges from every input
(:class:`~ckptstore.format.reader.RangeReader`, every chunk verified), sums them weighted in
the accumulation dtype, and rounds once into the output's dtype. Integer and bool ranges are
the first input's bytes.

Memory: per writer thread, one chunk-sized buffer per input, reused for every chunk (the
result is written over the first input's, piece by piece, once every input's piece was
added), plus an accumulator and a conversion buffer of :data:`_PIECE` elements
(:data:`_NUMPY_PIECE` for the dtypes numpy sums); so a merge
holds ``threads x inputs`` chunks of buffers (threads: 2 to 8,
:func:`~ckptstore.ops.upkeep.merge.run.merge_threads`), whatever the size of the tensors or
the state. Float32 and float64 tensors summed in their own dtype (``auto``) need two of those
buffers per thread, whatever the number of inputs: each input is added to the first as soon
as it is read (:meth:`MergeSource._sum_as_read`).
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

#: Elements summed at a time: an accumulator piece (128 KiB in float64) stays in cache while
#: every input's piece is added to it, and stays under torch's intra-op grain (32768
#: elements), so each writer thread sums on its own instead of waking torch's thread pool
#: for every piece (measured on 2 cores: a 64Ki-element piece kept the calling thread busy
#: 4-5x longer with torch's 2 threads than with 1).
_PIECE = 1 << 14
#: Elements summed at a time by :meth:`MergeSource._sum_numpy`: the accumulator, the product
#: buffer and every input's piece (512 KiB each in float64, 256 KiB in float32) stay in a
#: core's L2 while every input is added. 256Ki-element pieces overflowed it: on the 2-core
#: box, one thread summing an 8 MiB chunk of three fp32 inputs took 5.3 ms (float32) and
#: 15.6 ms (float64) at 256Ki, 4.1 ms and 10.5 ms at 64Ki; smaller pieces pay numpy's
#: per-call cost.
_NUMPY_PIECE = 1 << 16
#: The torch dtypes numpy sums (bfloat16 and the complex types stay on torch's path).
_NUMPY_DTYPES: dict[torch.dtype, np.dtype[Any]] = {
    torch.float16: np.dtype(np.float16),
    torch.float32: np.dtype(np.float32),
    torch.float64: np.dtype(np.float64),
}


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
        """The merged bytes of each range (views of this thread's first input buffer)."""
        if not ranges:
            return []
        dtype = self._dtypes[ranges[0][0]]
        isz = torch.empty((), dtype=dtype).element_size()
        sizes = [(stop - first) * isz for _, first, stop in ranges]
        total = sum(sizes)
        acc_dtype = self._accumulate[ranges[0][0]]
        if acc_dtype == dtype and dtype in _NUMPY_DTYPES:
            return self._sum_as_read(ranges, sizes, _NUMPY_DTYPES[dtype])
        inputs = self._inputs if acc_dtype is not None else self._inputs[:1]
        buffers = []
        for j, reader in enumerate(inputs):
            buf = self._buffer(f"in{j}", total)
            self._read_into(reader, ranges, buf, sizes)
            buffers.append(buf)
        if acc_dtype is not None:
            self._sum([_typed(b, dtype) for b in buffers], acc_dtype)
        return _split(buffers[0], sizes)

    @staticmethod
    def _read_into(
        reader: RangeReader, ranges: Sequence[Range], buf: ByteBuffer, sizes: Sequence[int]
    ) -> None:
        """Read ``ranges`` of one input into consecutive parts of ``buf``."""
        views = _split(buf, sizes)
        reader.read([(key, first, stop, view)
                     for (key, first, stop), view in zip(ranges, views, strict=True)])

    def _sum_as_read(
        self, ranges: Sequence[Range], sizes: Sequence[int], dtype: np.dtype[Any]
    ) -> list[ByteBuffer]:
        """The weighted sum of ranges summed in their own dtype, each input added once read.

        The same operations in the same order as :meth:`_sum_numpy` (so the same bits), but
        each input is added while its bytes are still in cache from the read, into the
        first input's buffer, and its buffer is reused for the next input: two chunk-sized
        buffers per thread whatever the number of inputs, instead of one per input.
        Measured on one thread of the 2-core box: reading (copying) and summing an 8 MiB
        chunk of three fp32 inputs took 5.9 ms this way, 6.2-7.0 ms reading all first.
        """
        total = sum(sizes)
        acc_buf = self._buffer("in0", total)
        self._read_into(self._inputs[0], ranges, acc_buf, sizes)
        acc = acc_buf.view(dtype)
        m = min(len(acc), _NUMPY_PIECE)
        product = self._buffer("product", m * dtype.itemsize).view(dtype)
        first = self._weights[0]
        others = list(zip(self._inputs[1:], self._weights[1:], strict=True))
        if not others:
            np.multiply(acc, first, out=acc, dtype=dtype)
        scratch = self._buffer("in1", total)
        for k, (reader, weight) in enumerate(others):
            self._read_into(reader, ranges, scratch, sizes)
            x = scratch.view(dtype)
            for lo in range(0, len(acc), _NUMPY_PIECE):
                hi = min(lo + _NUMPY_PIECE, len(acc))
                out = acc[lo:hi]
                if k == 0:  # the first input's weight, applied while its piece is in cache
                    np.multiply(out, first, out=out, dtype=dtype)
                tmp = product[: hi - lo]
                np.multiply(x[lo:hi], weight, out=tmp, dtype=dtype)
                np.add(out, tmp, out=out)
        return _split(acc_buf, sizes)

    def _sum(self, xs: list[torch.Tensor], acc_dtype: torch.dtype) -> None:
        """``xs[0] = sum(w_i * xs[i])``, summed in ``acc_dtype`` piece by piece.

        Piece by piece, so the accumulator stays in cache and no chunk-sized temporary is
        ever allocated: torch would allocate one for every mixed-dtype add, and glibc keeps
        such freed blocks, which made the process grow by a chunk per chunk written.
        """
        n = len(xs[0])
        if xs[0].dtype in _NUMPY_DTYPES and acc_dtype in _NUMPY_DTYPES:
            self._sum_numpy([x.numpy() for x in xs], _NUMPY_DTYPES[acc_dtype])
            return
        acc_full = self._tensor("acc", min(n, _PIECE), acc_dtype)
        convert = xs[0].dtype != acc_dtype
        tmp_full = self._tensor("convert", min(n, _PIECE), acc_dtype) if convert else None
        first, rest = self._weights[0], list(zip(xs[1:], self._weights[1:], strict=True))
        for lo in range(0, n, _PIECE):
            hi = min(lo + _PIECE, n)
            acc = acc_full[: hi - lo]
            acc.copy_(xs[0][lo:hi])
            acc.mul_(first)
            for x, weight in rest:
                if tmp_full is None:
                    acc.add_(x[lo:hi], alpha=weight)
                else:
                    tmp = tmp_full[: hi - lo]
                    tmp.copy_(x[lo:hi])
                    acc.add_(tmp, alpha=weight)
            xs[0][lo:hi].copy_(acc)  # rounded once, into the tensor's own dtype

    def _sum_numpy(self, xs: list[np.ndarray[Any, Any]], acc_dtype: np.dtype[Any]) -> None:
        """:meth:`_sum` for the dtypes numpy has (float16, float32, float64).

        numpy rather than torch: its loops release the GIL and never wake a thread pool, so
        the writer threads sum in parallel, in pieces large enough (:data:`_NUMPY_PIECE`) that
        the cost of a call does not count. Each input piece is converted and weighted in one
        call into a reused buffer, then added; the sum is rounded once into ``xs[0]``.
        """
        n = len(xs[0])
        m = min(n, _NUMPY_PIECE)
        wide = xs[0].dtype != acc_dtype
        product = self._buffer("product", m * acc_dtype.itemsize).view(acc_dtype)
        acc_full = self._buffer("acc", m * acc_dtype.itemsize).view(acc_dtype) if wide else None
        first, rest = self._weights[0], list(zip(xs[1:], self._weights[1:], strict=True))
        for lo in range(0, n, _NUMPY_PIECE):
            hi = min(lo + _NUMPY_PIECE, n)
            out = xs[0][lo:hi]
            acc = out if acc_full is None else acc_full[: hi - lo]
            np.multiply(out, first, out=acc, dtype=acc_dtype)
            tmp = product[: hi - lo]
            for x, weight in rest:
                np.multiply(x[lo:hi], weight, out=tmp, dtype=acc_dtype)
                np.add(acc, tmp, out=acc)
            if acc_full is not None:
                np.copyto(out, acc, casting="same_kind")  # rounded once, into its own dtype

    def _tensor(self, name: str, n: int, dtype: torch.dtype) -> torch.Tensor:
        isz = torch.empty((), dtype=dtype).element_size()
        return _typed(self._buffer(name, n * isz), dtype)


def _split(buf: ByteBuffer, sizes: Sequence[int]) -> list[ByteBuffer]:
    """Consecutive views of ``buf``, of ``sizes`` bytes each."""
    views = []
    pos = 0
    for size in sizes:
        views.append(buf[pos : pos + size])
        pos += size
    return views


def _typed(buf: ByteBuffer, dtype: torch.dtype) -> torch.Tensor:
    """``buf`` as a 1-d tensor of ``dtype`` sharing its memory."""
    raw: Any = torch.from_numpy(buf)
    typed: torch.Tensor = raw.view(dtype)
    return typed
