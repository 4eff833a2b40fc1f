"""Prefect task that scrubs the replicas of one checkpoint (or all) and repairs damage."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from prefect import task
from prefect.cache_policies import NO_CACHE

from ckptstore.tasks.retry import retry_transient
from ckptstore.tasks.summary import to_jsonable

if TYPE_CHECKING:
    from ckptstore.store import CheckpointStore

__all__ = ["verify_task"]

logger = logging.getLogger(__name__)


@task(
    name="verify-replicas",
    cache_policy=NO_CACHE,
    retries=1,
    retry_delay_seconds=5,
    retry_condition_fn=retry_transient,
)
def verify_task(
    store: CheckpointStore,
    ref: str | None = None,
    tier: str | None = None,
    repair: bool = True,
    deep: bool = True,
    run: str | None = None,
) -> dict[str, Any]:
    """Verify replicas (mark DAMAGED, repair from a good copy when ``repair``).

    Args:
        store: The open store.
        ref: One checkpoint, or None for all (of ``run``).
        tier: One tier, or None for all.
        repair: Re-copy damaged replicas from a good one.
        deep: Re-hash every chunk (False: check presence and sizes only).
        run: With ``ref=None``, only this run.

    Returns:
        The verify report as a dict.
    """
    from ckptstore.ops.upkeep.verify import verify_replicas

    report = verify_replicas(store, ref=ref, tier=tier, run=run, repair=repair, deep=deep)
    summary = dict(to_jsonable(report))
    summary["clean"] = report.clean
    return summary
