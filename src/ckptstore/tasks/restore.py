"""Prefect task that restores a checkpoint onto the hot tier from the fastest verified copy."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from prefect import task
from prefect.cache_policies import NO_CACHE

from ckptstore.tasks.retry import TRANSFER_RETRIES, TRANSFER_RETRY_DELAYS, retry_transient

if TYPE_CHECKING:
    from ckptstore.store import CheckpointStore

__all__ = ["restore_task"]

logger = logging.getLogger(__name__)


@task(
    name="restore-checkpoint",
    cache_policy=NO_CACHE,
    retries=TRANSFER_RETRIES,
    retry_delay_seconds=TRANSFER_RETRY_DELAYS,
    retry_condition_fn=retry_transient,
)
def restore_task(store: CheckpointStore, ref: str, to: str | None = None) -> dict[str, Any]:
    """Restore ``ref`` (to the hot tier, or to the directory ``to``) and verify it.

    Args:
        store: The open store.
        ref: The checkpoint reference.
        to: Target directory (default: the hot tier).

    Returns:
        ``{"ref": ..., "path": ...}``.

    Raises:
        CheckpointNotFoundError: If no verified copy exists anywhere.
    """
    from ckptstore.ops.tiering.restore import restore_checkpoint

    path = restore_checkpoint(store, ref, to=to)
    logger.info("restored %s to %s", ref, path)
    return {"ref": ref, "path": str(path)}
