"""Prefect task that pushes one run's new checkpoints to one remote store."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from prefect import task
from prefect.cache_policies import NO_CACHE

from ckptstore.tasks.retry import TRANSFER_RETRIES, TRANSFER_RETRY_DELAYS, retry_transient

if TYPE_CHECKING:
    from ckptstore.store import CheckpointStore

__all__ = ["sync_task"]

logger = logging.getLogger(__name__)


@task(
    name="sync-run",
    cache_policy=NO_CACHE,
    retries=TRANSFER_RETRIES,
    retry_delay_seconds=TRANSFER_RETRY_DELAYS,
    retry_condition_fn=retry_transient,
)
def sync_task(
    store: CheckpointStore,
    remote: str,
    run: str,
    best: str | None = None,
    mode: str = "min",
    tag: str | None = None,
) -> dict[str, Any]:
    """Push the committed checkpoints of ``run`` (or only its best) that ``remote`` lacks.

    What the remote already holds is skipped, so a retry or the next scheduled run only
    sends what is missing (see :func:`ckptstore.ops.sharing.sync.sync_run`).

    Args:
        store: The open store.
        remote: The remote's name.
        run: The run.
        best: Only the run's best checkpoint by this metric.
        mode: ``min`` or ``max`` for ``best``.
        tag: Only checkpoints with this tag.

    Returns:
        The push report as a dict.
    """
    from ckptstore.ops.sharing.remote import open_remote
    from ckptstore.ops.sharing.sync import sync_run

    other = open_remote(store, remote)
    try:
        report = sync_run(store, other, run, remote=remote, best=best, mode=mode, tag=tag)
    finally:
        other.close()
    logger.info("%s", report.summary())
    return report.to_json()
