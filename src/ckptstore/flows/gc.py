"""GC flow: remove what dead saves left behind on the hot tier."""

from __future__ import annotations

import logging
from typing import Any

from prefect import flow

from ckptstore.flows.common import open_store
from ckptstore.tasks.maintenance import gc_task

__all__ = ["gc_flow"]

logger = logging.getLogger(__name__)


@flow(name="ckpt-gc")
def gc_flow(
    dry_run: bool = False,
    store_root: str | None = None,
    config: str | None = None,
) -> dict[str, Any]:
    """Run :meth:`CheckpointStore.gc`: dead PENDING saves → FAILED, orphaned dirs removed.

    Args:
        dry_run: Only report what would be removed.
        store_root: Store directory.
        config: Config file path.

    Returns:
        The gc report as a dict.
    """
    with open_store(store_root, config) as store:
        result: dict[str, Any] = gc_task(store, dry_run=dry_run)
    return result
