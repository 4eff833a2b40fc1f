"""Compare two checkpoints tensor by tensor: what changed, where and by how much.

:func:`diff_checkpoints` reports, per tensor of the newer checkpoint: how many elements
changed (bit-wise, so ``-0.0`` vs ``0.0`` and NaN payloads count), in how many of its chunks,
and the largest absolute change. Tensors whose chunks have identical content hashes in both
checkpoints are known equal without reading them; the others are read in bounded batches,
so memory stays near ``batch_bytes`` whatever the checkpoint size.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from ckptstore.core import StoreCore
from ckptstore.format import Manifest, TensorEntry, read_tensors
from ckptstore.format.keys import render_path
from ckptstore.ops.tiering.replicas import manifest_of
from ckptstore.ops.tiering.restore import ensure_hot

__all__ = ["DiffReport", "TensorDiff", "diff_checkpoints"]

logger = logging.getLogger(__name__)

#: Tensors read per batch (bytes of one side); bounds the memory of a diff.
DEFAULT_BATCH_BYTES = 256 * 1024 * 1024

_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@dataclass(frozen=True)
class TensorDiff:
    """How one tensor differs.

    Attributes:
        key: Tensor key.
        status: ``same``, ``changed``, ``added`` (only in B), ``removed`` (only in A) or
            ``retyped`` (dtype or shape differs; not compared element-wise).
        dtype: Torch dtype name (B's, or A's when removed).
        shape: Shape (B's, or A's when removed).
        numel: Elements.
        elements_changed: Elements whose bits differ (None when not compared).
        chunks: Chunks of B holding the tensor.
        chunks_changed: Chunks of B holding at least one changed element of it.
        max_abs_change: Largest finite ``|b - a|`` (0.0 when unchanged; None when not
            compared).
        nonfinite_changes: Changed elements whose difference is not finite (NaN/inf).
    """

    key: str
    status: str
    dtype: str
    shape: tuple[int, ...]
    numel: int
    elements_changed: int | None = None
    chunks: int = 0
    chunks_changed: int | None = None
    max_abs_change: float | None = None
    nonfinite_changes: int = 0


@dataclass
class DiffReport:
    """Result of :func:`diff_checkpoints`.

    Attributes:
        a: Reference and id of the first checkpoint (``run@vN (uuid)``).
        b: Reference and id of the second.
        tensors: One entry per tensor key of either checkpoint (B's order, removed last).
        lossy: Whether either side holds lossily stored values (differences then include
            quantization error).
    """

    a: str
    b: str
    tensors: list[TensorDiff] = field(default_factory=list)
    lossy: bool = False

    @property
    def changed(self) -> list[TensorDiff]:
        """Entries that are not ``same``."""
        return [t for t in self.tensors if t.status != "same"]

    def summary(self) -> dict[str, Any]:
        """Totals: tensors by status, elements and chunks changed, largest change."""
        by_status: dict[str, int] = {}
        for t in self.tensors:
            by_status[t.status] = by_status.get(t.status, 0) + 1
        compared = [t for t in self.tensors if t.elements_changed is not None]
        changes = [t.max_abs_change for t in compared if t.max_abs_change is not None]
        return {
            "tensors": by_status,
            "elements": sum(t.numel for t in compared),
            "elements_changed": sum(t.elements_changed or 0 for t in compared),
            "chunks_changed": sum(t.chunks_changed or 0 for t in compared),
            "max_abs_change": max(changes, default=0.0),
        }

    def to_dict(self) -> dict[str, Any]:
        """JSON-able form."""
        return {
            "a": self.a,
            "b": self.b,
            "lossy": self.lossy,
            "summary": self.summary(),
            "tensors": [asdict(t) for t in self.tensors],
        }


def _numel(shape: tuple[int, ...]) -> int:
    return math.prod(shape)


def _same_chunks(ma: Manifest, mb: Manifest, ta: TensorEntry, tb: TensorEntry) -> bool:
    """Whether every chunk holding the tensor has the same content hash on both sides."""
    if ta.array != tb.array or ta.offset != tb.offset:
        return False
    aa, ab = ma.arrays[ta.array], mb.arrays[tb.array]
    if aa.chunk_len != ab.chunk_len:
        return False
    return all(
        aa.chunks[i].blake3 == ab.chunks[i].blake3 for i in range(tb.chunk_start, tb.chunk_stop)
    )


def _batches(keys: list[str], sizes: dict[str, int], limit: int) -> Iterator[list[str]]:
    batch: list[str] = []
    total = 0
    for key in keys:
        if batch and total + sizes[key] > limit:
            yield batch
            batch, total = [], 0
        batch.append(key)
        total += sizes[key]
    if batch:
        yield batch


def _compare(a: torch.Tensor, b: torch.Tensor, entry: TensorEntry, chunk_len: int) -> TensorDiff:
    fa, fb = a.reshape(-1), b.reshape(-1)
    size = fa.element_size()
    if size in _INT_VIEW and fa.dtype != torch.bool:
        changed = fa.view(_INT_VIEW[size]) != fb.view(_INT_VIEW[size])
    else:
        width = fa.view(torch.uint8).view(-1, size)
        changed = (width != fb.view(torch.uint8).view(-1, size)).any(dim=1)
    index = torch.nonzero(changed).view(-1)
    n_changed = int(index.numel())
    max_change, nonfinite = 0.0, 0
    if n_changed:
        if fa.dtype == torch.bool:
            max_change = 1.0
        else:
            wide = torch.complex128 if fa.is_complex() else torch.float64
            diff = (fb[index].to(wide) - fa[index].to(wide)).abs()
            finite = torch.isfinite(diff)
            nonfinite = int((~finite).sum())
            if bool(finite.any()):
                max_change = float(diff[finite].max())
    chunks = torch.unique((index + entry.offset) // chunk_len).numel() if n_changed else 0
    return TensorDiff(
        key=entry.key,
        status="changed" if n_changed else "same",
        dtype=entry.torch_dtype,
        shape=entry.shape,
        numel=entry.numel,
        elements_changed=n_changed,
        chunks=entry.chunk_stop - entry.chunk_start,
        chunks_changed=int(chunks),
        max_abs_change=max_change,
        nonfinite_changes=nonfinite,
    )


def diff_checkpoints(
    store: StoreCore, a: str, b: str, *, batch_bytes: int = DEFAULT_BATCH_BYTES
) -> DiffReport:
    """Compare checkpoint ``a`` (older) with ``b`` (newer), tensor by tensor.

    Args:
        store: The open store.
        a: Reference of the first checkpoint.
        b: Reference of the second.
        batch_bytes: Bytes of tensors read at once from each side.

    Returns:
        The :class:`DiffReport`.

    Raises:
        CheckpointNotFoundError: If a reference does not resolve.
        MissingBaseError: If a chunk either side needs is gone.
        IntegrityError: If either side is damaged.
    """
    ca, cb = store.catalog.get(a), store.catalog.get(b)
    ma, mb = manifest_of(store, ca), manifest_of(store, cb)
    report = DiffReport(a=f"{ca.ref} ({ca.id})", b=f"{cb.ref} ({cb.id})",
                        lossy=ma.lossy or mb.lossy)
    rows: dict[str, TensorDiff | None] = {}
    todo: list[str] = []
    sizes: dict[str, int] = {}
    for key, tb in mb.tensors.items():
        ta = ma.tensors.get(key)
        chunks = tb.chunk_stop - tb.chunk_start
        if ta is None:
            rows[key] = TensorDiff(key, "added", tb.torch_dtype, tb.shape, tb.numel, chunks=chunks)
        elif ta.torch_dtype != tb.torch_dtype or ta.shape != tb.shape:
            rows[key] = TensorDiff(key, "retyped", tb.torch_dtype, tb.shape, tb.numel,
                                   chunks=chunks)
        elif _same_chunks(ma, mb, ta, tb):
            rows[key] = TensorDiff(key, "same", tb.torch_dtype, tb.shape, tb.numel, 0, chunks,
                                   0, 0.0)
        else:
            rows[key] = None
            todo.append(key)
            sizes[key] = tb.numel * mb.arrays[tb.array].itemsize
    if todo:
        # Only tensors whose chunks differ are read (restored to the hot tier if needed).
        dir_a, dir_b = ensure_hot(store, ca), ensure_hot(store, cb)
    for batch in _batches(todo, sizes, batch_bytes):
        left = read_tensors(dir_a, ma, batch, locate=store.locate)
        right = read_tensors(dir_b, mb, batch, locate=store.locate)
        for key in batch:
            tb = mb.tensors[key]
            rows[key] = _compare(left[key], right[key], tb, mb.arrays[tb.array].chunk_len)
        del left, right
    report.tensors = [row for row in rows.values() if row is not None]
    report.tensors += [
        TensorDiff(key, "removed", ta.torch_dtype, ta.shape, ta.numel)
        for key, ta in ma.tensors.items()
        if key not in mb.tensors
    ]
    logger.info("diff %s -> %s: %d of %d tensors differ", ca.ref, cb.ref,
                len(report.changed), len(report.tensors))
    return report


def render_rows(report: DiffReport, *, all_tensors: bool = False) -> list[list[str]]:
    """Table rows for the CLI: tensor, status, dtype, shape, elements and chunks changed,
    largest change."""
    rows = []
    for t in report.tensors if all_tensors else report.changed:
        pct = (
            f"{t.elements_changed:,} ({100 * t.elements_changed / t.numel:.1f}%)"
            if t.elements_changed is not None and t.numel
            else "-" if t.elements_changed is None else "0"
        )
        rows.append([
            render_path(t.key),
            t.status,
            t.dtype,
            "x".join(map(str, t.shape)) or "()",
            pct,
            f"{t.chunks_changed}/{t.chunks}" if t.chunks_changed is not None else "-",
            f"{t.max_abs_change:.3g}" if t.max_abs_change is not None else "-",
        ])
    return rows
