"""Prefect tasks for retention: plan (read-only) and apply (deletes)."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from prefect import task
from prefect.cache_policies import NO_CACHE

if TYPE_CHECKING:
    from ckptstore.ops.tiering.retention import RetentionPlan, RetentionReport
    from ckptstore.retention import RetentionPolicy
    from ckptstore.store import CheckpointStore

__all__ = ["apply_retention_plan_task", "plan_retention_task"]

logger = logging.getLogger(__name__)


@task(name="plan-retention", cache_policy=NO_CACHE)
def plan_retention_task(
    store: CheckpointStore,
    policy: RetentionPolicy | None = None,
    run: str | None = None,
    tier: str = "hot",
) -> RetentionPlan:
    """Plan retention on one tier (no changes).

    Args:
        store: The open store.
        policy: The policy (default from the store's settings).
        run: Only this run.
        tier: ``hot``, ``warm`` or ``cold``.

    Returns:
        The plan.

    Raises:
        ConfigError: If the tier is not configured.
    """
    from ckptstore.ops.tiering.retention import plan_retention

    plan = plan_retention(store, policy, run=run, tier=tier)
    logger.info("%s", plan.render(show_kept=False))
    return plan


# Retrying is safe: apply re-checks every action and finishes half-done deletes.
@task(name="apply-retention", cache_policy=NO_CACHE, retries=1, retry_delay_seconds=5)
def apply_retention_plan_task(store: CheckpointStore, plan: RetentionPlan) -> RetentionReport:
    """Execute a retention plan.

    Args:
        store: The open store.
        plan: From :func:`plan_retention_task`.

    Returns:
        The report (failed actions are listed, not raised).
    """
    from ckptstore.ops.tiering.retention import apply_plan

    return apply_plan(store, plan)
