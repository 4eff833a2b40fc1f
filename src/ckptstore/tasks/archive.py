"""Prefect tasks that move checkpoints down the tiers (archive hot → warm, demote warm → cold)."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from prefect import task
from prefect.cache_policies import NO_CACHE

from ckptstore.tasks.retry import TRANSFER_RETRIES, TRANSFER_RETRY_DELAYS, retry_transient
from ckptstore.tasks.summary import to_jsonable

if TYPE_CHECKING:
    from ckptstore.store import CheckpointStore

__all__ = ["archive_task", "demote_task"]

logger = logging.getLogger(__name__)


@task(
    name="archive-checkpoint",
    cache_policy=NO_CACHE,
    retries=TRANSFER_RETRIES,
    retry_delay_seconds=TRANSFER_RETRY_DELAYS,
    retry_condition_fn=retry_transient,
)
def archive_task(
    store: CheckpointStore,
    ref: str | None = None,
    run: str | None = None,
    tier: str = "warm",
    reencode: str | None = None,
) -> dict[str, Any]:
    """Copy checkpoints (one, one run's, or all) to ``tier``, verify them there, record them.

    Already archived checkpoints are skipped, so a retry only redoes what failed.

    Args:
        store: The open store.
        ref: Only this checkpoint.
        run: Only this run.
        tier: Destination tier.
        reencode: Codec preset to re-encode with (None copies as is); see
            :mod:`ckptstore.ops.tiering.reencode`.

    Returns:
        The archive report as a dict.

    Raises:
        StorageError: If a copy fails after the retries.
    """
    from ckptstore.ops.tiering.archive import archive_checkpoints

    report = archive_checkpoints(store, run=run, ref=ref, tier=tier, reencode=reencode)
    logger.info("%s", report.summary())
    return dict(to_jsonable(report))


@task(
    name="demote-checkpoints",
    cache_policy=NO_CACHE,
    retries=TRANSFER_RETRIES,
    retry_delay_seconds=TRANSFER_RETRY_DELAYS,
    retry_condition_fn=retry_transient,
)
def demote_task(
    store: CheckpointStore,
    older_than_days: float,
    src: str = "warm",
    dst: str = "cold",
) -> dict[str, Any]:
    """Move replicas older than ``older_than_days`` from ``src`` to ``dst`` (copy → verify → drop).

    Args:
        store: The open store.
        older_than_days: Age threshold.
        src: Source tier.
        dst: Destination tier.

    Returns:
        The demote report as a dict.
    """
    from ckptstore.ops.tiering.archive import demote_checkpoints

    report = demote_checkpoints(store, older_than_days=older_than_days, src=src, dst=dst)
    logger.info("%s", report.summary())
    return dict(to_jsonable(report))
