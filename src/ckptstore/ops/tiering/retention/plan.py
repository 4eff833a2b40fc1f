"""Retention planning: which copies on one tier go, and why the others stay (read-only).

The policy (:mod:`ckptstore.retention`) decides per checkpoint; this module turns decisions into
actions on one tier, under the tier rules:

* A copy the policy no longer wants is deleted as a *replica* (the checkpoint stays COMMITTED)
  when a verified PRESENT copy exists on a *later* tier (hot → warm → cold). Only later tiers
  count: a warm copy never goes because a hot copy exists, or hot retention would then wait
  for an archive that warm retention keeps undoing.
* Otherwise, if a later tier is configured, the copy stays ("awaiting archive" / "awaiting
  demotion"): a tier never drops the last verified copy of a checkpoint that is still on its
  way down the tiers.
* Otherwise (this is the last configured tier) the checkpoint itself is deleted, every copy:
  COMMITTED → DELETING → copies removed → DELETED, like ``save_total_limit``.
* A copy that stays on a tier keeps its base's copy on that tier (deltas read their base's
  chunks from the same tier).
* Every copy of a checkpoint whose archival (GLACIER) copy is being thawed stays
  (``ops/tiering/thaw.py``).
* A checkpoint under another flow's live lease stays; rows and replicas left in DELETING by a
  crashed apply are planned again, to be finished.

:mod:`ckptstore.ops.tiering.retention.apply` executes a plan.
"""

from __future__ import annotations

import enum
import heapq
import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from ckptstore.core import StoreCore
from ckptstore.errors import ConfigError
from ckptstore.numeric import counted, human_bytes
from ckptstore.records import TIER_ORDER, Checkpoint, CheckpointState, ReplicaState, ThawState
from ckptstore.retention import (
    REASON_LEASED,
    REASON_PINNED,
    CandidateInfo,
    Decision,
    RetentionPolicy,
)

__all__ = [
    "ActionKind",
    "PlannedAction",
    "REASON_THAWING",
    "PlannedKeep",
    "RetentionPlan",
    "later_copy_present",
    "live_lease",
    "other_copy_present",
    "plan_retention",
]

logger = logging.getLogger(__name__)

#: Why a copy stays while the thaw of the checkpoint's archival copy is PENDING.
REASON_THAWING = "a thaw of its archival copy is pending"


class ActionKind(enum.StrEnum):
    """What apply does to one checkpoint."""

    DELETE_CHECKPOINT = "delete-checkpoint"
    """Every copy goes; the row ends DELETED."""
    DELETE_REPLICA = "delete-replica"
    """Only the copy on the plan's tier goes; the checkpoint stays COMMITTED elsewhere."""


@dataclass(frozen=True)
class PlannedAction:
    """One deletion the plan will execute.

    Attributes:
        checkpoint_id: Catalog id.
        ref: ``run@v<version>``.
        step: Training step (for display).
        kind: Delete the checkpoint or only its copy on ``tier``.
        tier: The tier the plan is for.
        bytes: Bytes this frees (stored bytes of the affected copies).
        reasons: Why (the policy's prune reasons, or "finish interrupted delete").
        resume: True when it finishes a delete a crashed run started.
    """

    checkpoint_id: str
    ref: str
    step: int
    kind: ActionKind
    tier: str
    bytes: int
    reasons: tuple[str, ...]
    resume: bool = False

    def describe(self) -> str:
        """One line for the dry-run output."""
        what = (
            "delete checkpoint (all copies)"
            if self.kind == ActionKind.DELETE_CHECKPOINT
            else f"delete {self.tier} copy"
        )
        if self.resume:
            what = "finish: " + what
        return (
            f"{what:<38} {self.ref:<24} step {self.step:<10} {human_bytes(self.bytes):>10}  "
            f"{self.checkpoint_id}  ({'; '.join(self.reasons)})"
        )

    def to_dict(self) -> dict[str, Any]:
        """JSON-able form."""
        return {
            "checkpoint_id": self.checkpoint_id,
            "ref": self.ref,
            "step": self.step,
            "kind": str(self.kind),
            "tier": self.tier,
            "bytes": self.bytes,
            "reasons": list(self.reasons),
            "resume": self.resume,
        }


@dataclass(frozen=True)
class PlannedKeep:
    """A copy on the plan's tier that stays, with why."""

    checkpoint_id: str
    ref: str
    step: int
    reasons: tuple[str, ...]


@dataclass
class RetentionPlan:
    """Everything one retention run on one tier will do (and keep).

    Attributes:
        tier: The tier planned for.
        policy: The policy used.
        run: The run planned for, or None for every run.
        created_at: When the plan was made (the ``now`` of ``max_age_days``).
        actions: Deletions, dependents before their bases.
        kept: Copies on the tier that stay, with reasons.
    """

    tier: str
    policy: RetentionPolicy
    run: str | None
    created_at: datetime
    actions: list[PlannedAction] = field(default_factory=list)
    kept: list[PlannedKeep] = field(default_factory=list)

    @property
    def bytes_to_free(self) -> int:
        """Sum of the bytes the actions free."""
        return sum(a.bytes for a in self.actions)

    def render(self, *, show_kept: bool = True) -> str:
        """The dry-run text: exactly the actions :func:`apply_plan` executes, in order.

        Args:
            show_kept: Also list the copies that stay, with their reasons.

        Returns:
            Multi-line text.
        """
        scope = f"run {self.run}" if self.run else "all runs"
        lines = [
            f"retention plan for tier {self.tier}, {scope}; policy: {self.policy.describe()}",
            f"{counted(len(self.actions), 'action')}, {human_bytes(self.bytes_to_free)} to "
            f"free; {self.kept_text()}",
        ]
        lines.extend(f"  {a.describe()}" for a in self.actions)
        if show_kept:
            lines.extend(
                f"  keep {k.ref:<24} step {k.step:<10} ({'; '.join(k.reasons)})" for k in self.kept
            )
        return "\n".join(lines)

    def kept_text(self) -> str:
        """How many copies stay, the protected ones counted apart: ``keep_last`` counts
        among the unprotected (ckptstore/retention.py), so ``--keep-last 3`` with one pinned
        checkpoint keeps "3 + 1 pinned", never a silent 4."""
        protected = {"pinned": 0, "aliased": 0, "leased": 0}
        for k in self.kept:
            if REASON_PINNED in k.reasons:
                protected["pinned"] += 1
            elif any(r.startswith("alias ") for r in k.reasons):
                protected["aliased"] += 1
            elif REASON_LEASED in k.reasons:
                protected["leased"] += 1
        extra = "".join(f" + {n} {what}" for what, n in protected.items() if n)
        by_policy = len(self.kept) - sum(protected.values())
        return f"{counted(len(self.kept), 'copy', 'copies')} kept ({by_policy}{extra})" \
            if extra else f"{counted(len(self.kept), 'copy', 'copies')} kept"

    def to_dict(self) -> dict[str, Any]:
        """JSON-able form (flow results)."""
        return {
            "tier": self.tier,
            "run": self.run,
            "policy": self.policy.to_dict(),
            "created_at": self.created_at.isoformat(),
            "actions": [a.to_dict() for a in self.actions],
            "kept": [
                {"checkpoint_id": k.checkpoint_id, "ref": k.ref, "reasons": list(k.reasons)}
                for k in self.kept
            ],
            "bytes_to_free": self.bytes_to_free,
        }


# ---------------------------------------------------------------------- planning
def plan_retention(
    store: StoreCore,
    policy: RetentionPolicy | None = None,
    *,
    run: str | None = None,
    tier: str = "hot",
) -> RetentionPlan:
    """Plan retention for one tier (read-only).

    Decisions are made over every run's COMMITTED checkpoints (so a delta in another run still
    protects its base), but actions are only planned for ``run`` when given.

    Args:
        store: The open store.
        policy: The policy; default from the store's settings.
        run: Only plan for this run.
        tier: ``hot``, ``warm`` or ``cold`` (must be configured).

    Returns:
        The :class:`RetentionPlan`.

    Raises:
        ConfigError: If ``tier`` is unknown or not configured.
        CheckpointNotFoundError: If ``run`` does not exist.
    """
    tiers = _configured_tiers(store, tier)
    if policy is None:
        policy = RetentionPolicy.from_settings(store.settings)
    if run is not None:
        store.catalog.get_run(run)  # raises CheckpointNotFoundError with a useful message
    now = datetime.now(UTC)
    plan = RetentionPlan(tier=tier, policy=policy, run=run, created_at=now)

    everything = _list(store, None)
    committed = [ck for ck in everything if ck.state == CheckpointState.COMMITTED]
    pending = [ck for ck in everything if ck.state == CheckpointState.PENDING]
    by_id = {ck.id: ck for ck in everything}
    decisions = _decide_with_leases(
        store, policy, committed, pending, now, scope=None if run is None else {run}
    )

    thawing = {t.checkpoint_id for t in store.catalog.thaws(state=ThawState.PENDING)}
    later_tier = _next_tier(tier, tiers)
    actions: dict[str, PlannedAction] = {}
    keeps: dict[str, list[str]] = {}
    for ck in committed:
        if run is not None and ck.run != run:
            continue
        replica = ck.replica(tier)
        if replica is None or replica.state in (ReplicaState.DELETED, ReplicaState.COPYING):
            continue
        decision = decisions[ck.id]
        if replica.state == ReplicaState.DELETING:
            # A crashed apply already decided this copy goes; finish it if that stays safe.
            if other_copy_present(ck, tier):
                actions[ck.id] = _action(ck, ActionKind.DELETE_REPLICA, tier, resume=True,
                                         reasons=("finish interrupted delete",))
            else:
                keeps[ck.id] = ["copy marked DELETING but it is the last one; run verify"]
            continue
        if ck.id in thawing:
            # Its archival copy is being thawed because no other copy could be read; the
            # copy here may be the one a repair needs, and the thaw's restore reads the
            # chunks its bases hold here: nothing of it goes until the thaw is done.
            keeps[ck.id] = [REASON_THAWING]
        elif decision.keep:
            keeps[ck.id] = list(decision.reasons)
        elif later_copy_present(ck, tier):
            actions[ck.id] = _action(ck, ActionKind.DELETE_REPLICA, tier,
                                     reasons=decision.reasons)
        elif later_tier is not None:
            word = "archive" if tier == "hot" else "demotion"
            keeps[ck.id] = [f"awaiting {word} to {later_tier}"]
        else:
            actions[ck.id] = _action(ck, ActionKind.DELETE_CHECKPOINT, tier,
                                     reasons=decision.reasons)

    _protect_bases(actions, keeps, everything, tier)

    for ck in everything:
        if ck.state != CheckpointState.DELETING or (run is not None and ck.run != run):
            continue
        actions[ck.id] = _action(ck, ActionKind.DELETE_CHECKPOINT, tier, resume=True,
                                 reasons=("finish interrupted delete",))

    # Resumed deletes first, then newest first, with every delta before its base (the catalog
    # refuses to delete a base while a live delta uses it).
    plan.actions = _dependents_first(sorted(actions.values(), key=_newest_first(by_id)), by_id)
    plan.kept = [
        PlannedKeep(cid, by_id[cid].ref, by_id[cid].step, tuple(why))
        for cid, why in sorted(keeps.items(), key=lambda kv: _order(by_id[kv[0]]), reverse=True)
    ]
    logger.info(
        "retention plan for %s (%s): %d action(s), %d kept",
        tier, run or "all runs", len(plan.actions), len(plan.kept),
    )
    return plan


def _configured_tiers(store: StoreCore, tier: str) -> dict[str, str]:
    tiers = store.settings.tier_urls()
    if tier not in TIER_ORDER:
        raise ConfigError(f"unknown tier {tier!r}; use one of {', '.join(TIER_ORDER)}")
    if tier not in tiers:
        raise ConfigError(
            f"tier {tier!r} is not configured for this store; set it under [tiers] in the "
            "config or with CKPT_" + tier.upper()
        )
    return tiers


def _next_tier(tier: str, tiers: dict[str, str]) -> str | None:
    later = TIER_ORDER[TIER_ORDER.index(tier) + 1 :]
    return next((t for t in later if t in tiers), None)


def _list(store: StoreCore, state: CheckpointState | None) -> list[Checkpoint]:
    return list(store.catalog.list(state=state, limit=None))


def _candidate(ck: Checkpoint, leased: bool, required_by: tuple[str, ...] = ()) -> CandidateInfo:
    return CandidateInfo(
        checkpoint_id=ck.id,
        run=ck.run,
        step=ck.step,
        version=ck.version,
        created_at=ck.created_at,
        metrics=dict(ck.metrics),
        pinned=ck.pinned,
        aliases=tuple(ck.aliases),
        base_id=ck.base_id,
        leased=leased,
        required_by=required_by,
    )


def _decide_with_leases(
    store: StoreCore,
    policy: RetentionPolicy,
    committed: Sequence[Checkpoint],
    pending: Sequence[Checkpoint],
    now: datetime,
    *,
    scope: set[str] | None,
) -> dict[str, Decision]:
    """Decide, asking about leases only for checkpoints the policy would prune.

    A leased checkpoint is protected, which can change what ``keep_last`` counts, so the
    decision is repeated until no newly pruned checkpoint turns out to be leased (at most one
    round per checkpoint; in practice one or two). With ``scope``, leases are only looked up
    for checkpoints of those runs (the only ones the plan may act on).
    """
    # Saves in flight (PENDING) may be writing a delta against a committed base.
    required: dict[str, list[str]] = {}
    for ck in pending:
        if ck.base_id is not None:
            required.setdefault(ck.base_id, []).append(ck.id)
    run_of = {ck.id: ck.run for ck in committed}
    leased: set[str] = set()
    checked: set[str] = set()
    for _round in range(len(committed) + 1):
        candidates = [
            _candidate(ck, ck.id in leased, tuple(required.get(ck.id, ()))) for ck in committed
        ]
        decisions = {d.checkpoint_id: d for d in policy.decide(candidates, now=now)}
        newly = [
            cid
            for cid, d in decisions.items()
            if not d.keep and cid not in checked and (scope is None or run_of[cid] in scope)
        ]
        if not newly:
            return decisions
        checked.update(newly)
        now_leased = set(_leased(store, newly))
        leased |= now_leased
        if not now_leased:
            return decisions
    return decisions  # unreachable in practice: each round checks at least one new id


def live_lease(store: StoreCore, ckpt_id: str, *, ignore: str | None = None) -> str | None:
    """``purpose:owner`` of a live lease on the checkpoint held by anyone but ``ignore``."""
    held = _leased(store, [ckpt_id], ignore=ignore)
    return held.get(ckpt_id)


def _leased(
    store: StoreCore, ckpt_ids: Iterable[str], *, ignore: str | None = None
) -> dict[str, str]:
    """``{checkpoint id: "purpose:owner"}`` for those of ``ckpt_ids`` under a live lease.

    Any purpose counts: a lease means another flow works on the checkpoint now. Leases owned
    by ``ignore`` (this retention run) do not count.
    """
    held: dict[str, str] = {}
    for lease in store.catalog.leases(checkpoint_ids=ckpt_ids):
        if lease.owner != ignore:
            held.setdefault(lease.checkpoint_id, f"{lease.purpose}:{lease.owner}")
    return held


def later_copy_present(ck: Checkpoint, tier: str) -> bool:
    """Whether a verified PRESENT copy exists on a tier after ``tier`` in :data:`TIER_ORDER`."""
    rank = TIER_ORDER.index(tier)
    return any(
        r.tier in TIER_ORDER
        and TIER_ORDER.index(r.tier) > rank
        and r.state == ReplicaState.PRESENT
        and r.verified_at is not None
        for r in ck.replicas
    )


def other_copy_present(ck: Checkpoint, tier: str) -> bool:
    """Whether a verified PRESENT copy exists on another tier."""
    return any(
        r.tier != tier and r.state == ReplicaState.PRESENT and r.verified_at is not None
        for r in ck.replicas
    )


def _action(
    ck: Checkpoint,
    kind: ActionKind,
    tier: str,
    *,
    reasons: Iterable[str],
    resume: bool = False,
) -> PlannedAction:
    if kind == ActionKind.DELETE_CHECKPOINT:
        size = sum(r.bytes or 0 for r in ck.replicas if r.state != ReplicaState.DELETED)
    else:
        replica = ck.replica(tier)
        size = replica.bytes if replica is not None and replica.bytes else 0
    # Replica rows may not carry sizes; the checkpoint's stored bytes is the best estimate.
    size = size or ck.stored_bytes
    return PlannedAction(
        checkpoint_id=ck.id,
        ref=ck.ref,
        step=ck.step,
        kind=kind,
        tier=tier,
        bytes=int(size),
        reasons=tuple(reasons),
        resume=resume,
    )


def _protect_bases(
    actions: dict[str, PlannedAction],
    keeps: dict[str, list[str]],
    everything: Sequence[Checkpoint],
    tier: str,
) -> None:
    """Cancel deletions a live delta still needs, until nothing changes.

    A checkpoint is not deleted while a live (COMMITTED or PENDING) delta uses it as its base,
    and its copy on ``tier`` is not deleted while a delta's copy stays on ``tier`` (a save in
    flight counts as staying on the hot tier).
    """
    dependents: dict[str, list[Checkpoint]] = {}
    for ck in everything:
        if ck.base_id is not None and ck.state in (
            CheckpointState.COMMITTED, CheckpointState.PENDING
        ):
            dependents.setdefault(ck.base_id, []).append(ck)

    def deleted(ck: Checkpoint) -> bool:
        action = actions.get(ck.id)
        return action is not None and action.kind == ActionKind.DELETE_CHECKPOINT

    def stays_on_tier(ck: Checkpoint) -> bool:
        if ck.state == CheckpointState.PENDING:
            return tier == "hot"
        if ck.id in actions:
            return False
        replica = ck.replica(tier)
        return replica is not None and replica.state not in (
            ReplicaState.DELETED, ReplicaState.DELETING
        )

    # Bounded: every round that continues cancels at least one action.
    for _round in range(len(actions) + 1):
        changed = False
        for cid, action in list(actions.items()):
            if action.resume:
                continue
            for dep in dependents.get(cid, ()):
                if action.kind == ActionKind.DELETE_CHECKPOINT and not deleted(dep):
                    why = f"base of {dep.ref} which is still live"
                elif action.kind == ActionKind.DELETE_REPLICA and stays_on_tier(dep):
                    why = f"base of {dep.ref} which stays on {tier}"
                else:
                    continue
                del actions[cid]
                keeps.setdefault(cid, []).append(why)
                changed = True
                break
        if not changed:
            return


def _dependents_first(
    ordered: list[PlannedAction], everything: dict[str, Checkpoint]
) -> list[PlannedAction]:
    """Reorder so an action on a delta comes before the action on its base.

    Kahn's algorithm over "delta → base" edges, taking the earliest ready action of ``ordered``
    each time, so the given order is kept wherever the dependencies allow.
    """
    index = {a.checkpoint_id: i for i, a in enumerate(ordered)}
    base_of: dict[int, int] = {}
    waiting = [0] * len(ordered)  # dependents of each action not emitted yet
    for i, a in enumerate(ordered):
        ck = everything.get(a.checkpoint_id)
        if ck is not None and ck.base_id in index and index[ck.base_id] != i:
            base_of[i] = index[ck.base_id]
            waiting[base_of[i]] += 1
    ready = [i for i in range(len(ordered)) if waiting[i] == 0]
    heapq.heapify(ready)
    out: list[PlannedAction] = []
    emitted: set[int] = set()
    while ready:
        i = heapq.heappop(ready)
        out.append(ordered[i])
        emitted.add(i)
        if i in base_of:
            b = base_of[i]
            waiting[b] -= 1
            if waiting[b] == 0:
                heapq.heappush(ready, b)
    # A base cycle (corrupt catalog) leaves actions unemitted; keep them, in the given order.
    out.extend(a for i, a in enumerate(ordered) if i not in emitted)
    return out


def _order(ck: Checkpoint) -> tuple[int, int]:
    return (int(ck.step), int(ck.version))


def _newest_first(by_id: dict[str, Checkpoint]) -> Any:
    def key(a: PlannedAction) -> tuple[int, int, int, str]:
        ck = by_id.get(a.checkpoint_id)
        step, version = _order(ck) if ck is not None else (a.step, 0)
        # Resumed deletes first (they were already decided), then newest first.
        return (0 if a.resume else 1, -step, -version, a.checkpoint_id)

    return key
