"""Prefect tasks that prefetch a checkpoint to this host and finish the thaw of a GLACIER
copy (rules in ``ops/reading/prefetch.py`` and ``ops/tiering/thaw_poll.py``)."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from prefect import task
from prefect.cache_policies import NO_CACHE

from ckptstore.tasks.retry import TRANSFER_RETRIES, TRANSFER_RETRY_DELAYS, retry_transient

if TYPE_CHECKING:
    from ckptstore.store import CheckpointStore

__all__ = ["prefetch_task", "thaw_task"]

logger = logging.getLogger(__name__)


@task(
    name="prefetch-checkpoint",
    cache_policy=NO_CACHE,
    retries=TRANSFER_RETRIES,
    retry_delay_seconds=TRANSFER_RETRY_DELAYS,
    retry_condition_fn=retry_transient,
)
def prefetch_task(store: CheckpointStore, ref: str, to: str = "hot",
                  hold_s: float = 6 * 3600.0) -> dict[str, Any]:
    """Prefetch ``ref`` to this host's ``to`` tier under a lease of ``hold_s`` seconds.

    Returns:
        :meth:`ckptstore.ops.reading.prefetch.PrefetchResult.to_dict`.

    Raises:
        ThawPendingError: If the only copy is archival (not retried: the thaw flow waits).
    """
    result = store.prefetch(ref, to=to, hold_s=hold_s)
    logger.info("prefetched %s to %s (%d bytes moved)", result.ref, to, result.bytes_moved)
    return result.to_dict()


@task(name="thaw-checkpoint", cache_policy=NO_CACHE)
def thaw_task(store: CheckpointStore, ref: str, poll_s: float = 300.0,
              timeout_s: float | None = None) -> dict[str, Any]:
    """Wait until ``ref``'s archival copy has thawed, then restore it to the hot tier.

    Returns:
        ``{"ref": ..., "path": ...}``.
    """
    path = store.thaw(ref, poll_s=poll_s, timeout_s=timeout_s)
    logger.info("thawed and restored %s to %s", ref, path)
    return {"ref": ref, "path": str(path)}
