"""Merging checkpoints: the operation behind ``store.merge`` and ``ckpt merge``.

The order of a merge, so that bad input leaves nothing behind:

1. Check the request (:mod:`~ckptstore.ops.upkeep.merge.spec`), the output's run and step,
   and resolve every input (missing ones fail here); refuse an input named twice.
2. If these inputs were already merged with the same spec into ``run`` at ``step``, return
   that checkpoint (the flow and the CLI may be run again).
3. Read every input's manifest from its hot copy (restored first when only another tier has
   it) and check that the selected keys, shapes and dtypes agree: the first difference is
   the error, naming the key.
4. Take a ``merge:`` lease on every input, so retention leaves their copies alone while
   they are read, then save a :class:`~ckptstore.format.sources.StreamedState` whose
   :class:`~ckptstore.ops.upkeep.merge.source.MergeSource` computes each chunk of the output
   from the same chunks of the inputs: the regular save transaction
   (:func:`~ckptstore.ops.writing.save.save_checkpoint`), so a damaged input chunk fails the
   save like any write failure (the row is marked FAILED and the directory removed).
5. Record the merged-from edges (weight and position of every input) and the ``merged``
   event, in one catalog transaction.
"""

from __future__ import annotations

import logging
import os
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ckptstore.catalog.lineage import MERGE_EVENT, MERGED_FROM
from ckptstore.core import StoreCore
from ckptstore.errors import CkptError, InvalidNameError
from ckptstore.format import Manifest, read_manifest
from ckptstore.format.dtypes import dtype_by_name
from ckptstore.format.keys import render_path
from ckptstore.format.reader import RangeReader
from ckptstore.format.sources import StreamedState, StreamedTensor
from ckptstore.format.tree import iter_tensor_refs, select_tree
from ckptstore.ops.leases import acquire_lease, lease_owner
from ckptstore.ops.tiering.restore import ensure_hot, hot_digest
from ckptstore.ops.upkeep.merge.source import MergeSource
from ckptstore.ops.upkeep.merge.spec import MergeSpec, accumulation_dtype, merge_spec
from ckptstore.ops.writing.save import check_save, save_checkpoint
from ckptstore.progress import Progress, announce_total
from ckptstore.records import Checkpoint, CheckpointState
from ckptstore.save_options import SaveOptions

__all__ = ["MAX_MERGE_THREADS", "merge_checkpoints", "merge_threads"]

logger = logging.getLogger(__name__)

#: How long a merge's leases on its inputs last unless renewed (renewed as chunks are written).
_LEASE_TTL_S = 600.0
#: Most writer threads a merge uses (see :func:`merge_threads`).
MAX_MERGE_THREADS = 8


@dataclass(frozen=True)
class _Input:
    ck: Checkpoint
    manifest: Manifest
    reader: RangeReader


def merge_checkpoints(
    core: StoreCore,
    refs: Sequence[str],
    *,
    run: str,
    step: int,
    method: str | None = None,
    weights: Sequence[float] | None = None,
    weights_from_metric: str | None = None,
    keys: Sequence[str] | None = None,
    accumulate: str = "auto",
    metrics: dict[str, float] | None = None,
    tags: Sequence[str] = (),
    codec: str | None = None,
    progress: Progress | None = None,
) -> Checkpoint:
    """Merge checkpoints into a new one: the weighted mean of every floating-point tensor.

    See :meth:`ckptstore.store.CheckpointStore.merge` for the arguments.

    Returns:
        The merged checkpoint (COMMITTED), or the one an identical earlier merge made.

    Raises:
        InvalidNameError: For a bad request (see
            :func:`~ckptstore.ops.upkeep.merge.spec.merge_spec`), an input named twice, a
            missing metric, inputs whose keys, shapes or dtypes differ, or key patterns that
            match nothing.
        CheckpointNotFoundError: If an input does not resolve.
        IntegrityError: If an input chunk is damaged (it is named); nothing is committed.
        StorageError: If the hot tier fails; nothing is committed.
    """
    # Nothing is read, restored or written before the request is known to make sense.
    refs = _check_refs(refs)
    if method is None:
        method = "weighted" if weights is not None or weights_from_metric else "mean"
    if weights is not None and weights_from_metric:
        raise InvalidNameError("give weights or weights_from_metric, not both")
    if weights_from_metric and method != "weighted":
        raise InvalidNameError("weights_from_metric goes with the weighted method")
    # A full save (no base): a merge shares no chunks with the run's earlier checkpoints.
    step, options = check_save(core, run, step, SaveOptions(metrics=metrics, tags=tuple(tags),
                                                            codec=codec, base=None))
    cks = [core.catalog.get(ref) for ref in refs]
    _refuse_repeats(refs, cks)
    if weights_from_metric:
        weights = _metric_weights(cks, weights_from_metric)
    spec = merge_spec(len(cks), method=method, weights=weights, accumulate=accumulate,
                      keys=keys, metric=weights_from_metric)
    done = _already_merged(core, cks, spec, run, step)
    if done is not None:
        logger.info("%s were already merged into %s", [ck.ref for ck in cks], done.ref)
        return done
    inputs = [_open_input(core, ck) for ck in cks]
    state = _plan(inputs, spec)
    announce_total(progress, sum(_nbytes(t) for t in state.tensors.values()))
    owner = lease_owner()
    purpose = f"merge:{uuid.uuid4().hex[:12]}"
    try:
        renew = _lease_inputs(core, cks, purpose, owner)
        merged = save_checkpoint(core, run, step, state, options,
                                 progress=_with(progress, renew))
        core.catalog.record_merge(
            merged.id,
            [(ck.id, w) for ck, w in zip(cks, spec.weights, strict=True)],
            {**spec.record(), "inputs": [{"id": ck.id, "ref": ck.ref} for ck in cks]},
        )
    finally:
        _release(core, cks, purpose, owner)
    logger.info("merged %s (%s) into %s", [ck.ref for ck in cks], spec.method, merged.ref)
    return merged


def _check_refs(refs: Sequence[str]) -> list[str]:
    if isinstance(refs, str) or not all(isinstance(r, str) and r for r in refs):
        raise InvalidNameError(
            "refs must be a list of checkpoint references (two or more), e.g. "
            "['site-a@latest', 'site-b@latest']"
        )
    if len(refs) < 2:
        raise InvalidNameError(
            f"a merge needs at least two checkpoints, got {len(refs)}; name every input "
            "(ckpt merge A B ...)"
        )
    return list(refs)


def _refuse_repeats(refs: Sequence[str], cks: Sequence[Checkpoint]) -> None:
    first: dict[str, str] = {}
    for ref, ck in zip(refs, cks, strict=True):
        if ck.id in first:
            raise InvalidNameError(
                f"{first[ck.id]!r} and {ref!r} are the same checkpoint ({ck.id}): a merge "
                "takes each checkpoint once (to count one twice, give it twice the weight)"
            )
        first[ck.id] = ref


def _metric_weights(cks: Sequence[Checkpoint], metric: str) -> list[float]:
    values = []
    for ck in cks:
        value = ck.metrics.get(metric)
        if value is None:
            raise InvalidNameError(
                f"{ck.ref} has no metric {metric!r} to weigh it by (it records "
                f"{sorted(ck.metrics) or 'none'}); save it with metrics={{{metric!r}: ...}} "
                "or give --weights"
            )
        values.append(float(value))
    return values


def _already_merged(
    core: StoreCore, cks: Sequence[Checkpoint], spec: MergeSpec, run: str, step: int
) -> Checkpoint | None:
    """A committed checkpoint of ``run`` at ``step`` merged from ``cks`` with ``spec``."""
    wanted = [(ck.id, w) for ck, w in zip(cks, spec.weights, strict=True)]
    record = spec.record()
    for link in core.catalog.links(cks[0].id):
        if link.src != cks[0].id or link.kind != MERGED_FROM or link.position != 0:
            continue
        try:
            candidate = core.catalog.get_any(link.dst)
        except CkptError:
            continue
        if (candidate.state != CheckpointState.COMMITTED or candidate.run != run
                or candidate.step != step):
            continue
        parents = [(p.src, p.weight) for p in core.catalog.merge_inputs(candidate.id)]
        if parents != wanted:
            continue
        events = core.catalog.events(candidate.id, kind=MERGE_EVENT)
        if any(all(e.detail.get(k) == v for k, v in record.items()) for e in events):
            return candidate
    return None


def _open_input(core: StoreCore, ck: Checkpoint) -> _Input:
    directory = ensure_hot(core, ck)
    manifest = read_manifest(directory, expected_digest=hot_digest(core, ck))
    if manifest.dcp is not None:
        raise InvalidNameError(
            f"{ck.ref} was saved through torch.distributed.checkpoint, which merging does not "
            "read chunk by chunk; load it and save it with store.save, then merge that"
        )
    return _Input(ck, manifest, RangeReader(directory, manifest, locate=core.locate))


def _selected(inp: _Input, keys: Sequence[str] | None) -> tuple[Any, list[str]]:
    """The part of ``inp``'s tree that ``keys`` selects, and its tensor keys in order."""
    tree = inp.manifest.tree
    if keys is not None:
        tree, matched = select_tree(tree, list(keys))
        missing = [p for p in keys if p not in matched]
        if tree is None or missing:
            raise InvalidNameError(
                f"keys {missing or list(keys)} match nothing in {inp.ck.ref}; list its keys "
                "with `ckpt show` and use fnmatch patterns such as 'model/*'"
            )
    order: dict[str, None] = {}
    for _, _, key in iter_tensor_refs(tree):
        order.setdefault(key)
    return tree, list(order)


def _plan(inputs: Sequence[_Input], spec: MergeSpec) -> StreamedState:
    """Check that the inputs agree, and describe the output (the first input's tree)."""
    first = inputs[0]
    tree, order = _selected(first, spec.keys)
    shapes = {key: first.manifest.tensors[key] for key in order}
    for other in inputs[1:]:
        _, theirs = _selected(other, spec.keys)
        _compare(first, other, order, theirs)
    tensors: dict[str, StreamedTensor] = {}
    dtypes: dict[str, torch.dtype] = {}
    accumulate: dict[str, torch.dtype | None] = {}
    for key in order:
        entry = shapes[key]
        info = dtype_by_name(entry.torch_dtype)
        if info is None:
            raise CkptError(f"tensor {render_path(key)} of {first.ck.ref} has dtype "
                            f"{entry.torch_dtype!r}, unknown to this torch build; use a "
                            "newer torch")
        tensors[key] = StreamedTensor(info.torch_dtype, tuple(entry.shape))
        dtypes[key] = info.torch_dtype
        accumulate[key] = accumulation_dtype(info.torch_dtype, spec.accumulate,
                                             render_path(key))
    source = MergeSource([inp.reader for inp in inputs], spec.weights, dtypes, accumulate)
    return StreamedState(tree, tensors, source, threads=merge_threads())


def merge_threads() -> int:
    """Writer threads of a merge: one more than the cores, up to 8.

    Each chunk of a merge reads (and checks) every input's chunk, sums them and hashes and
    writes the result: several times a save's CPU work per byte written, so the save's own
    thread count would leave a merge bound by it. The one thread beyond the cores keeps
    them busy while another waits on a read or a write; more only add buffers that compete
    for the caches (on 2 cores, merging GPT-2 small with 4 threads took ~10% more CPU time
    than with 3, in three interleaved runs). A merge runs off the training path; the cap
    bounds its buffers (threads x inputs x one chunk; 192 MiB for three inputs at the
    default 8 MiB chunks).
    """
    return min(MAX_MERGE_THREADS, (os.cpu_count() or 1) + 1)


def _compare(first: _Input, other: _Input, ours: list[str], theirs: list[str]) -> None:
    """Raise naming the first key whose presence, shape or dtype differs."""
    their_set = set(theirs)
    a, b = first.ck.ref, other.ck.ref
    for key in ours:
        if key not in their_set:
            raise InvalidNameError(
                f"cannot merge {a} and {b}: tensor {render_path(key)} is in {a} but not in "
                f"{b}; merge checkpoints of the same model, or select common keys with keys="
            )
        mine, yours = first.manifest.tensors[key], other.manifest.tensors[key]
        if tuple(mine.shape) != tuple(yours.shape):
            raise InvalidNameError(
                f"cannot merge {a} and {b}: tensor {render_path(key)} has shape "
                f"{list(mine.shape)} in {a} but {list(yours.shape)} in {b}"
            )
        if mine.torch_dtype != yours.torch_dtype:
            raise InvalidNameError(
                f"cannot merge {a} and {b}: tensor {render_path(key)} is {mine.torch_dtype} "
                f"in {a} but {yours.torch_dtype} in {b}; convert one of them first"
            )
    ours_set = set(ours)
    for key in theirs:
        if key not in ours_set:
            raise InvalidNameError(
                f"cannot merge {a} and {b}: tensor {render_path(key)} is in {b} but not in "
                f"{a}; merge checkpoints of the same model, or select common keys with keys="
            )


def _nbytes(spec: StreamedTensor) -> int:
    numel = 1
    for dim in spec.shape:
        numel *= dim
    return numel * torch.empty((), dtype=spec.dtype).element_size()


def _lease_inputs(
    core: StoreCore, cks: Sequence[Checkpoint], purpose: str, owner: str
) -> Callable[[], None]:
    """Lease every input for the merge; return a function that renews them when due."""
    for ck in cks:
        # A purpose of this merge's own: concurrent merges of one input each hold theirs.
        acquire_lease(core, ck.id, purpose, owner, _LEASE_TTL_S)
    renewed = time.monotonic()

    def renew() -> None:
        nonlocal renewed
        if time.monotonic() - renewed > _LEASE_TTL_S / 3:
            renewed = time.monotonic()
            for ck in cks:
                acquire_lease(core, ck.id, purpose, owner, _LEASE_TTL_S)

    return renew


def _release(core: StoreCore, cks: Sequence[Checkpoint], purpose: str, owner: str) -> None:
    for ck in cks:
        try:
            core.catalog.release_lease(ck.id, purpose, owner)
        except CkptError:  # expiry frees it anyway
            logger.warning("could not release lease %s on %s", purpose, ck.id, exc_info=True)


def _with(progress: Progress | None, renew: Callable[[], None]) -> Callable[[int], None]:
    def report(nbytes: int) -> None:
        renew()
        if progress is not None:
            progress(nbytes)

    return report
