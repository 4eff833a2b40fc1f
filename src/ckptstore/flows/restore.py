"""Restore flow: bring a checkpoint back to the hot tier from the fastest verified copy."""

from __future__ import annotations

import logging
from typing import Any

from prefect import flow

from ckptstore.flows.common import open_store
from ckptstore.tasks.restore import restore_task

__all__ = ["restore_flow"]

logger = logging.getLogger(__name__)


@flow(name="ckpt-restore")
def restore_flow(
    ref: str,
    to: str | None = None,
    store_root: str | None = None,
    config: str | None = None,
) -> dict[str, Any]:
    """Restore ``ref`` onto the hot tier (or into ``to``) and verify it.

    Args:
        ref: Checkpoint reference (uuid, ``run@latest``, ``run@v3``, alias, ...).
        to: Target directory (default: the hot tier, where ``load`` finds it).
        store_root: Store directory.
        config: Config file path.

    Returns:
        ``{"ref": ..., "path": ...}``.

    Raises:
        CheckpointNotFoundError: If the reference does not resolve or has no verified copy.
    """
    with open_store(store_root, config) as store:
        result: dict[str, Any] = restore_task(store, ref, to=to)
    return result
