"""Compact flow: rewrite a delta checkpoint as a full, self-contained one."""

from __future__ import annotations

import logging
from typing import Any

from prefect import flow, task
from prefect.cache_policies import NO_CACHE

from ckptstore.flows.common import open_store
from ckptstore.store import CheckpointStore

__all__ = ["compact_flow", "compact_task"]

logger = logging.getLogger(__name__)


@task(name="compact-checkpoint", cache_policy=NO_CACHE)
def compact_task(store: CheckpointStore, ref: str) -> dict[str, Any]:
    """Run :func:`ckptstore.ops.writing.delta.compact_checkpoint` and summarise the result."""
    from ckptstore.ops.upkeep.compact import compact_checkpoint

    new = compact_checkpoint(store, ref)
    return {"source": ref, "compacted": new.id, "ref": new.ref, "kind": new.kind}


@flow(name="ckpt-compact")
def compact_flow(
    ref: str,
    store_root: str | None = None,
    config: str | None = None,
) -> dict[str, Any]:
    """Rewrite ``ref`` as a full checkpoint (new version, ``converted-from`` edge); idempotent.

    Args:
        ref: The checkpoint to compact.
        store_root: Store directory.
        config: Config file path.

    Returns:
        ``{"source", "compacted", "ref", "kind"}``.
    """
    with open_store(store_root, config) as store:
        result: dict[str, Any] = compact_task(store, ref)
    return result
