"""Incremental saves: choosing what a new checkpoint is encoded against, and compaction.

:func:`plan_save` turns a save's ``delta=``/``base=`` arguments into the base the format
writer deduplicates or encodes against, and into what the catalog records:

* ``dedup`` (the default): the base is the run's latest committed checkpoint (or the one
  named). Identical chunks are referenced, not written. References are tracked per chunk
  (retention keeps exactly the chunk files later checkpoints read), so the catalog records no
  base: a dedup checkpoint never pins its base as a whole.
* ``xor`` / ``lossy``: changed chunks are stored encoded against the chain's *keyframe*, a
  full checkpoint written every ``keyframe_every`` saves (or when the chain cannot go on:
  first save, another mode or lossy scope, keyframe gone). The catalog records the keyframe
  as the delta's base, so retention keeps it while a delta of its chain is kept.

:func:`ckptstore.ops.upkeep.compact.compact_checkpoint` turns a delta back into a full checkpoint.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ckptstore.core import StoreCore
from ckptstore.errors import CheckpointNotFoundError, CkptError
from ckptstore.format import BaseRef, Manifest, read_manifest
from ckptstore.format.delta import DeltaSpec, parse_delta
from ckptstore.records import Checkpoint, CheckpointState, ReplicaState, expected_digest
from ckptstore.save_options import LATEST, Latest

__all__ = ["SavePlan", "plan_save"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SavePlan:
    """How one save is encoded.

    Attributes:
        spec: The delta mode (None: a full save without dedup).
        base: What the writer deduplicates or encodes against (None: nothing).
        depth: Position in the keyframe's chain (0: keyframe or dedup).
        kind: Catalog kind: ``delta`` only for chained (xor/lossy) deltas.
        base_id: Catalog base: the keyframe of a chained delta, else None.
        lossy: Whether the save may store approximate values.
    """

    spec: DeltaSpec | None
    base: BaseRef | None = None
    depth: int = 0
    kind: str = "full"
    base_id: str | None = None
    lossy: bool = False


def _hot_manifest(store: StoreCore, ck: Checkpoint) -> tuple[Manifest, Path] | None:
    """The checkpoint's manifest and directory on the hot tier, or None if unusable."""
    replica = ck.replica("hot")
    if ck.state != CheckpointState.COMMITTED or replica is None or (
        replica.state != ReplicaState.PRESENT
    ):
        return None
    directory = store.checkpoint_dir(ck.run, ck.id)
    try:
        # A hot copy restored from a re-encoded archive copy has its own manifest digest.
        return read_manifest(directory, expected_digest=expected_digest(ck, "hot")), directory
    except CkptError as exc:
        logger.warning("cannot use %s (%s) as a base: %s", ck.ref, ck.id, exc)
        return None


def plan_save(
    store: StoreCore,
    run: str,
    delta: Any,
    base: str | Latest | None,
) -> SavePlan:
    """Decide the base and encoding of a save of ``run``.

    Args:
        store: The open store.
        run: The run being saved.
        delta: The ``delta=`` argument (None: the store's ``delta`` setting); see
            :func:`ckptstore.format.delta.parse_delta`.
        base: :data:`LATEST`, a checkpoint reference, or None for a full save.

    Returns:
        The :class:`SavePlan`. A base without a usable hot copy gives a full save (logged).

    Raises:
        InvalidNameError: If ``delta`` is not a valid delta setting.
        CheckpointNotFoundError: If an explicit ``base`` reference does not resolve.
    """
    spec = parse_delta(store.settings.delta if delta is None else delta)
    if spec is None or base is None:
        return SavePlan(spec)
    explicit = base is not LATEST
    if explicit:
        assert isinstance(base, str)
        candidate = store.catalog.get(base)
    else:
        try:
            candidate = store.catalog.latest(run)
        except CheckpointNotFoundError:
            return SavePlan(spec)
    found = _hot_manifest(store, candidate)
    if found is None:
        if explicit:
            logger.warning("base %s has no readable hot copy; saving in full", candidate.ref)
        return SavePlan(spec)
    manifest, directory = found
    if not spec.chained:
        return SavePlan(spec, BaseRef(manifest, directory, store.locate))
    keyframe = (
        (candidate, manifest, directory, 1)
        if explicit
        else _keyframe_of(store, candidate, manifest, spec)
    )
    if keyframe is None:
        return SavePlan(spec)
    key_ck, key_manifest, key_dir, depth = keyframe
    every = spec.keyframe_every or store.settings.keyframe_every
    if depth >= every:
        logger.debug("%s: %d saves since keyframe %s; writing a keyframe", run, depth, key_ck.ref)
        return SavePlan(spec)
    return SavePlan(
        spec,
        BaseRef(key_manifest, key_dir, store.locate),
        depth=depth,
        kind="delta",
        base_id=key_ck.id,
        lossy=spec.lossy,
    )


def _keyframe_of(
    store: StoreCore, ck: Checkpoint, manifest: Manifest, spec: DeltaSpec
) -> tuple[Checkpoint, Manifest, Path, int] | None:
    """The keyframe a new chained save continues from, with the new save's depth."""
    info = manifest.delta
    if info is None or info.mode != spec.mode:
        return None
    if spec.lossy and tuple(info.scope) != tuple(spec.scope):
        # Another scope packs other tensors into the lossy arrays: chunks would not match.
        return None
    if info.depth == 0:
        if manifest.kind != "full":
            return None
        return ck, manifest, store.checkpoint_dir(ck.run, ck.id), 1
    if manifest.base_id is None:
        return None
    try:
        key_ck = store.catalog.get_any(manifest.base_id)
    except CheckpointNotFoundError:
        return None
    found = _hot_manifest(store, key_ck)
    if found is None:
        return None
    return key_ck, found[0], found[1], info.depth + 1
