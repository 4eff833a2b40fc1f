"""Retention flow: plan per tier, then apply exactly that plan (or only show it)."""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from prefect import flow

from ckptstore.flows.common import open_store
from ckptstore.retention import RetentionPolicy
from ckptstore.tasks.retention import apply_retention_plan_task, plan_retention_task
from ckptstore.tasks.summary import to_jsonable

__all__ = ["retention_flow"]

logger = logging.getLogger(__name__)


@flow(name="ckpt-retention")
def retention_flow(
    store_root: str | None = None,
    config: str | None = None,
    run: str | None = None,
    tier: str = "hot",
    dry_run: bool = False,
    keep_last: int | None = None,
    keep_every: int | None = None,
    keep_best: tuple[str, str, int] | None = None,
    max_age_days: float | None = None,
) -> dict[str, Any]:
    """Apply the retention policy on one tier.

    The policy comes from the config; the ``keep_*`` / ``max_age_days`` parameters override
    single rules. Running it twice, or after a crash, ends in the same place: the second
    plan is empty or finishes the interrupted deletes.

    Args:
        store_root: Store directory.
        config: Config file path.
        run: Only this run (default: every run).
        tier: ``hot``, ``warm`` or ``cold``.
        dry_run: Only plan; the result's ``plan_text`` is what a real run would execute.
        keep_last: Override: keep the newest N per run.
        keep_every: Override: keep steps that are multiples of K.
        keep_best: Override: ``(metric, "min"|"max", N)``.
        max_age_days: Override: keep checkpoints younger than this.

    Returns:
        The retention report as a dict, plus ``plan_text``.

    Raises:
        ConfigError: If the tier is not configured or a rule is invalid.
    """
    with open_store(store_root, config) as store:
        policy = RetentionPolicy.from_settings(store.settings)
        overrides: dict[str, Any] = {
            "keep_last": keep_last,
            "keep_every": keep_every,
            "keep_best": tuple(keep_best) if keep_best is not None else None,
            "max_age_days": max_age_days,
        }
        policy = dataclasses.replace(
            policy, **{k: v for k, v in overrides.items() if v is not None}
        )
        plan = plan_retention_task(store, policy, run=run, tier=tier)
        if dry_run:
            summary: dict[str, Any] = {
                "tier": tier,
                "run": run,
                "dry_run": True,
                "policy": policy.to_dict(),
                "planned": [a.to_dict() for a in plan.actions],
                "executed": [],
                "skipped": [],
                "failed": [],
                "freed_bytes": 0,
                "kept": len(plan.kept),
            }
        else:
            report = apply_retention_plan_task(store, plan)
            summary = dict(to_jsonable(report))
        summary["plan_text"] = plan.render()
    logger.info(
        "retention on %s: %d planned, %d executed%s",
        tier, len(summary["planned"]), len(summary["executed"]), " (dry run)" if dry_run else "",
    )
    return summary
