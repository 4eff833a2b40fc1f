"""Compaction: rewrite a delta (or dedup) checkpoint as a full, self-contained one.

The new version keeps the source's run, step, metrics, tags and parent and gets a
``converted-from`` edge from it; it reads no chunk of any other checkpoint, so the source and
its bases can then be pruned (``ckpt compact``).
"""

from __future__ import annotations

import logging
from typing import Any

from ckptstore.core import StoreCore
from ckptstore.errors import CheckpointNotFoundError, CkptError
from ckptstore.ops.reading.load import load_checkpoint
from ckptstore.ops.tiering.replicas import manifest_of
from ckptstore.ops.writing.save import save_checkpoint
from ckptstore.progress import Progress, announce_total
from ckptstore.records import Checkpoint, CheckpointState
from ckptstore.save_options import SaveOptions

__all__ = ["compact_checkpoint"]

logger = logging.getLogger(__name__)


def compact_checkpoint(store: StoreCore, ref: str, *, progress: Progress | None = None
                       ) -> Checkpoint:
    """Rewrite a checkpoint as a full, self-contained one: a new version, same run and step.

    The new version keeps the source's metrics, tags and parent, and gets a
    ``converted-from`` edge from it; it reads no chunk of any other checkpoint, so the
    source and its bases can then be pruned. Idempotent: a source already compacted returns
    the existing compacted version, and a full source (that references no other checkpoint)
    is returned as is. Lossy values stay as they were stored (compaction cannot restore
    what a lossy save dropped): the ``compacted`` event records the source's error bound.

    Args:
        store: The open store.
        ref: The checkpoint to compact.
        progress: Called with the tensor bytes of each chunk written; one with
            ``set_total`` (:mod:`ckptstore.progress`) is first told the checkpoint's logical
            bytes. Nothing is reported when there is nothing to write.

    Returns:
        The compacted (or already self-contained) checkpoint.

    Raises:
        CheckpointNotFoundError: If ``ref`` does not resolve.
        MissingBaseError: If a chunk the source needs is gone (nothing is written).
        IntegrityError: If the source is damaged.
    """
    src = store.catalog.get(ref)
    manifest = manifest_of(store, src)
    if not manifest.referenced_checkpoints():
        logger.info("%s references no other checkpoint; nothing to compact", src.ref)
        return src
    done = _compacted(store, src)
    if done is not None:
        logger.info("%s was already compacted as %s", src.ref, done.ref)
        return done
    # Loading first means a missing base fails here, before anything is written.
    announce_total(progress, src.logical_bytes)
    state = load_checkpoint(store, src.id)
    options = SaveOptions(metrics=src.metrics, tags=src.tags, parent=src.parent_id,
                          codec=src.codec, delta=False, base=None)
    new = save_checkpoint(store, src.run, src.step, state, options, progress=progress)
    del state
    store.catalog.add_edge(src.id, new.id, "converted-from")
    detail: dict[str, Any] = {"from": src.id, "kind": manifest.kind}
    if manifest.delta is not None and manifest.delta.lossy:
        detail.update(lossy=True, max_abs_error=manifest.delta.max_abs_error)
        logger.warning("%s holds lossy values (max abs error %g); %s keeps them as stored",
                       src.ref, manifest.delta.max_abs_error, new.ref)
    store.catalog.record_event("compacted", checkpoint_id=new.id, detail=detail)
    logger.info("compacted %s (%s) as %s", src.ref, manifest.kind, new.ref)
    return new


def _compacted(store: StoreCore, src: Checkpoint) -> Checkpoint | None:
    for a, b, kind in store.catalog.edges(src.id):
        if a != src.id or kind != "converted-from":
            continue
        try:
            target = store.catalog.get_any(b)
        except CheckpointNotFoundError:
            continue
        if target.state != CheckpointState.COMMITTED or target.codec != src.codec:
            continue
        try:
            if not manifest_of(store, target).referenced_checkpoints():
                return target
        except CkptError:
            continue
    return None
