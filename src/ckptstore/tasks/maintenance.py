"""Prefect task for store garbage collection (dead saves, orphaned directories)."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from prefect import task
from prefect.cache_policies import NO_CACHE

from ckptstore.tasks.summary import to_jsonable

if TYPE_CHECKING:
    from ckptstore.store import CheckpointStore

__all__ = ["gc_task"]

logger = logging.getLogger(__name__)


@task(name="gc", cache_policy=NO_CACHE)
def gc_task(store: CheckpointStore, dry_run: bool = False) -> dict[str, Any]:
    """Remove what dead saves left behind (see :meth:`CheckpointStore.gc`).

    Args:
        store: The open store.
        dry_run: Only report.

    Returns:
        The gc report as a dict.
    """
    report = store.gc(dry_run=dry_run)
    return dict(to_jsonable(report))
