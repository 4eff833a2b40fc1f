"""Retention on a store: plan which copies to delete per tier, then apply exactly that plan.

Two steps with one job each: :mod:`~ckptstore.ops.tiering.retention.plan` decides (read-only; the
tier rules and the dry-run text), :mod:`~ckptstore.ops.tiering.retention.apply` executes a plan,
re-checking every action under a lease. The policy itself (keep_last, keep_best, ...) is
:mod:`ckptstore.retention`.

Example:
    >>> plan = plan_retention(store, RetentionPolicy(keep_last=3), run="run-a")  # doctest: +SKIP
    >>> print(plan.render())                                                     # doctest: +SKIP
    >>> report = apply_plan(store, plan)                                         # doctest: +SKIP
"""

from __future__ import annotations

from ckptstore.ops.tiering.retention.apply import RetentionReport, apply_plan, apply_retention
from ckptstore.ops.tiering.retention.plan import (
    REASON_THAWING,
    ActionKind,
    PlannedAction,
    PlannedKeep,
    RetentionPlan,
    plan_retention,
)

__all__ = [
    "REASON_THAWING",
    "ActionKind",
    "PlannedAction",
    "PlannedKeep",
    "RetentionPlan",
    "RetentionReport",
    "apply_plan",
    "apply_retention",
    "plan_retention",
]
