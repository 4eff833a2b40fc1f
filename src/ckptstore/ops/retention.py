"""Retention on a store: plan which copies to delete per tier, then apply exactly that plan.

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

Apply takes a ``retention`` lease per checkpoint, re-checks each action against the catalog
(pins, aliases, other flows' leases, remaining copies) and skips what no longer holds; rows and
replicas left in DELETING by a crash are finished by the next plan. Both are idempotent.

Example:
    >>> plan = plan_retention(store, RetentionPolicy(keep_last=3), run="run-a")  # doctest: +SKIP
    >>> print(plan.render())                                                     # doctest: +SKIP
    >>> report = apply_plan(store, plan)                                         # doctest: +SKIP
"""

from __future__ import annotations

import enum
import heapq
import logging
import os
import shutil
import socket
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from ckptstore.core import StoreCore
from ckptstore.errors import CheckpointNotFoundError, CkptError, ConfigError, StorageError
from ckptstore.records import Checkpoint, CheckpointState, ReplicaState
from ckptstore.retention import REASON_LEASED, CandidateInfo, Decision, RetentionPolicy

__all__ = [
    "LEASE_PURPOSES",
    "TIER_ORDER",
    "ActionKind",
    "PlannedAction",
    "PlannedKeep",
    "RetentionPlan",
    "RetentionReport",
    "apply_plan",
    "apply_retention",
    "plan_retention",
]

logger = logging.getLogger(__name__)

#: Tiers from fastest to slowest; a copy moves down this list, never skipping a configured tier.
TIER_ORDER: tuple[str, ...] = ("hot", "warm", "cold")

#: Lease purposes other flows take on a checkpoint; any live one makes retention skip it. The
#: operations qualify some by tier (``archive:warm``, ``restore:hot``).
LEASE_PURPOSES: tuple[str, ...] = (
    *(f"{verb}:{tier}" for verb in ("archive", "restore") for tier in TIER_ORDER),
    "archive", "restore", "verify", "convert", "demote", "save", "prune", "retention",
)

#: Lease purpose and time-to-live used while deleting one checkpoint's copy.
RETENTION_PURPOSE = "retention"
LEASE_TTL_S = 600.0


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
            f"{what:<38} {self.ref:<24} step {self.step:<10} {_human(self.bytes):>10}  "
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
            f"{len(self.actions)} action(s), {_human(self.bytes_to_free)} to free; "
            f"{len(self.kept)} copy(ies) kept",
        ]
        lines.extend(f"  {a.describe()}" for a in self.actions)
        if show_kept:
            lines.extend(
                f"  keep {k.ref:<24} step {k.step:<10} ({'; '.join(k.reasons)})" for k in self.kept
            )
        return "\n".join(lines)

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


@dataclass
class RetentionReport:
    """What :func:`apply_plan` did.

    Attributes:
        plan: The plan it executed.
        executed: Actions carried out, in order.
        skipped: Actions not carried out because the catalog changed since planning
            (action, reason): a new pin or alias, another flow's lease, a copy already gone.
        failed: Actions that raised (action, error text); their rows stay DELETING and the next
            run finishes them.
        dry_run: True when nothing was executed on purpose.
    """

    plan: RetentionPlan
    executed: list[PlannedAction] = field(default_factory=list)
    skipped: list[tuple[PlannedAction, str]] = field(default_factory=list)
    failed: list[tuple[PlannedAction, str]] = field(default_factory=list)
    dry_run: bool = False

    @property
    def freed_bytes(self) -> int:
        """Bytes freed by the executed actions."""
        return sum(a.bytes for a in self.executed)

    @property
    def ok(self) -> bool:
        """True when no action failed."""
        return not self.failed

    def to_dict(self) -> dict[str, Any]:
        """JSON-able summary (flow results, ``ckpt prune --json``)."""
        return {
            "tier": self.plan.tier,
            "run": self.plan.run,
            "policy": self.plan.policy.to_dict(),
            "dry_run": self.dry_run,
            "planned": [a.to_dict() for a in self.plan.actions],
            "executed": [a.to_dict() for a in self.executed],
            "skipped": [{**a.to_dict(), "why": why} for a, why in self.skipped],
            "failed": [{**a.to_dict(), "error": err} for a, err in self.failed],
            "freed_bytes": self.freed_bytes,
            "kept": len(self.plan.kept),
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
            if _other_present(ck, tier):
                actions[ck.id] = _action(ck, ActionKind.DELETE_REPLICA, tier, resume=True,
                                         reasons=("finish interrupted delete",))
            else:
                keeps[ck.id] = ["copy marked DELETING but it is the last one; run verify"]
            continue
        if decision.keep:
            keeps[ck.id] = list(decision.reasons)
        elif _later_present(ck, tier):
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
        for cid in newly:
            checked.add(cid)
            if _lease_holder(store, cid) is not None:
                leased.add(cid)
        if not leased.intersection(newly):
            return decisions
    return decisions  # unreachable in practice: each round checks at least one new id


def _lease_holder(store: StoreCore, ckpt_id: str, *, ignore: str | None = None) -> str | None:
    """``purpose:owner`` of a live lease on the checkpoint held by anyone but ``ignore``."""
    listing = getattr(store.catalog, "leases", None)
    if callable(listing):
        # One query when the catalog can list a checkpoint's live leases (any purpose).
        for lease in listing(ckpt_id):
            purpose, owner = lease[1], lease[2]
            if owner != ignore:
                return f"{purpose}:{owner}"
        return None
    for purpose in LEASE_PURPOSES:
        holder = store.catalog.lease_holder(ckpt_id, purpose)
        if holder is not None and holder != ignore:
            return f"{purpose}:{holder}"
    return None


def _later_present(ck: Checkpoint, tier: str) -> bool:
    """Whether a verified PRESENT copy exists on a tier after ``tier`` in :data:`TIER_ORDER`."""
    rank = TIER_ORDER.index(tier)
    return any(
        r.tier in TIER_ORDER
        and TIER_ORDER.index(r.tier) > rank
        and r.state == ReplicaState.PRESENT
        and r.verified_at is not None
        for r in ck.replicas
    )


def _other_present(ck: Checkpoint, tier: str) -> bool:
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


# ---------------------------------------------------------------------- applying
def apply_plan(
    store: StoreCore,
    plan: RetentionPlan,
    *,
    owner: str | None = None,
) -> RetentionReport:
    """Execute exactly the actions of ``plan``, re-checking each one first.

    Args:
        store: The open store.
        plan: A plan from :func:`plan_retention`.
        owner: Lease owner name (default ``retention:<host>:<pid>:<random>``).

    Returns:
        The :class:`RetentionReport`. Failures are reported, not raised: rows stay DELETING
        and the next run finishes them.
    """
    owner = owner or f"retention:{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
    report = RetentionReport(plan=plan)
    for action in plan.actions:
        if not store.catalog.acquire_lease(
            action.checkpoint_id, RETENTION_PURPOSE, owner, LEASE_TTL_S
        ):
            holder = store.catalog.lease_holder(action.checkpoint_id, RETENTION_PURPOSE)
            report.skipped.append((action, f"retention lease held by {holder}"))
            continue
        try:
            ck, why_not = _precheck(store, action, owner)
            if ck is None or why_not is not None:
                report.skipped.append((action, why_not or "gone"))
                logger.info("retention skipped %s: %s", action.ref, why_not)
                continue
            if action.kind == ActionKind.DELETE_CHECKPOINT:
                _delete_checkpoint(store, action, owner, ck)
            else:
                _delete_replica(store, action, owner, ck)
            report.executed.append(action)
        except (CkptError, OSError) as exc:
            logger.warning("retention failed on %s: %s", action.ref, exc, exc_info=True)
            report.failed.append((action, f"{type(exc).__name__}: {exc}"))
        finally:
            store.catalog.release_lease(action.checkpoint_id, RETENTION_PURPOSE, owner)
    logger.info(
        "retention on %s: %d executed, %d skipped, %d failed, %s freed",
        plan.tier, len(report.executed), len(report.skipped), len(report.failed),
        _human(report.freed_bytes),
    )
    return report


def _precheck(
    store: StoreCore, action: PlannedAction, owner: str
) -> tuple[Checkpoint | None, str | None]:
    """The checkpoint, and why ``action`` must not run any more (None when it still holds)."""
    try:
        ck = store.catalog.get_any(action.checkpoint_id)
    except CheckpointNotFoundError:
        return None, "checkpoint row is gone"
    return ck, _why_not(store, action, owner, ck)


def _why_not(
    store: StoreCore, action: PlannedAction, owner: str, ck: Checkpoint
) -> str | None:
    holder = _lease_holder(store, ck.id, ignore=owner)
    if holder is not None:
        return f"{REASON_LEASED} ({holder})"
    if ck.state == CheckpointState.DELETED:
        return "already deleted"
    if action.resume and action.kind == ActionKind.DELETE_CHECKPOINT:
        return None if ck.state == CheckpointState.DELETING else f"state is now {ck.state}"
    if ck.state != CheckpointState.COMMITTED:
        return f"state is now {ck.state}"
    if ck.pinned:
        return "pinned since planning"
    if ck.aliases:
        return f"aliased since planning ({', '.join(ck.aliases)})"
    if action.kind == ActionKind.DELETE_REPLICA:
        replica = ck.replica(action.tier)
        if replica is None or replica.state == ReplicaState.DELETED:
            return f"no {action.tier} copy any more"
        if not (_other_present if action.resume else _later_present)(ck, action.tier):
            return f"no verified copy of it remains on a later tier than {action.tier}"
        return None
    # Deleting the whole checkpoint: it must still not be the newest of its run.
    try:
        newest = store.catalog.latest(ck.run)
    except CheckpointNotFoundError:
        newest = None
    if newest is not None and newest.id == ck.id:
        return "it is the newest checkpoint of its run"
    return None


def _delete_checkpoint(
    store: StoreCore, action: PlannedAction, owner: str, ck: Checkpoint
) -> None:
    from ckptstore.ops.replicas import delete_replica

    if ck.state == CheckpointState.COMMITTED:
        # The catalog refuses here too if a pin, alias or live delta appeared meanwhile.
        ck = store.catalog.mark_deleting(ck.id)
    for replica in ck.replicas:
        if replica.state != ReplicaState.DELETED:
            # force: the checkpoint itself is pruned, so its last copy goes too.
            # keep_referenced: chunk files that kept checkpoints still read (dedup) stay;
            # delete_replica frees them once their last reader is gone.
            delete_replica(store, ck, replica.tier, actor=owner, force=True,
                           keep_referenced=True)
    if ck.replica("hot") is None:
        # A hot directory can exist without a replica row (a crash between mkdir and the
        # row). With a row, delete_replica owns the directory: it may hold chunk files
        # that other checkpoints read, which must not be removed wholesale.
        _remove_local_dir(store.checkpoint_dir(ck.run, ck.id))
    store.catalog.mark_deleted(ck.id)
    _record(store, action, owner)
    logger.info("pruned checkpoint %s (%s): %s", action.ref, ck.id, "; ".join(action.reasons))


def _delete_replica(
    store: StoreCore, action: PlannedAction, owner: str, ck: Checkpoint
) -> None:
    from ckptstore.ops.replicas import delete_replica

    # Not forced: delete_replica refuses the last verified copy. Chunk files other copies on
    # the tier still read (dedup, delta bases) are kept, the rest goes.
    delete_replica(store, ck, action.tier, actor=owner, keep_referenced=True)
    _record(store, action, owner)
    logger.info("pruned the %s copy of %s (%s)", action.tier, action.ref, ck.id)


def _record(store: StoreCore, action: PlannedAction, owner: str) -> None:
    store.catalog.record_event(
        "pruned",
        checkpoint_id=action.checkpoint_id,
        actor=owner,
        detail={
            "action": str(action.kind),
            "tier": action.tier,
            "reasons": list(action.reasons),
            "bytes": action.bytes,
            "resume": action.resume,
        },
    )


def _remove_local_dir(path: Path) -> None:
    try:
        if path.is_symlink():
            # A link planted in the directory's place: remove the link, never its target
            # (rmtree refuses a link, which left the row DELETING for good).
            path.unlink()
            return
        # The commit marker goes first, so a half-deleted directory never looks committed.
        # rmtree unlinks links inside the directory without following them.
        (path / "COMMITTED").unlink(missing_ok=True)
        shutil.rmtree(path)
    except FileNotFoundError:
        return
    except OSError as exc:
        raise StorageError(
            f"cannot delete {path}: {exc.strerror or exc}; check permissions and rerun retention "
            "(the row stays DELETING until then)"
        ) from exc


def apply_retention(
    store: StoreCore,
    *,
    run: str | None = None,
    tier: str = "hot",
    policy: RetentionPolicy | None = None,
    dry_run: bool = False,
    owner: str | None = None,
) -> RetentionReport:
    """Plan and (unless ``dry_run``) apply retention on one tier.

    Args:
        store: The open store.
        run: Only this run (default: every run).
        tier: ``hot``, ``warm`` or ``cold``.
        policy: The policy (default from the settings).
        dry_run: Only plan; ``report.plan.render()`` shows what a real run would execute.
        owner: Lease owner name.

    Returns:
        The :class:`RetentionReport` (``dry_run=True`` with nothing executed for a dry run).

    Raises:
        ConfigError: If the tier is not configured.
        CheckpointNotFoundError: If ``run`` does not exist.
    """
    plan = plan_retention(store, policy, run=run, tier=tier)
    if dry_run:
        return RetentionReport(plan=plan, dry_run=True)
    return apply_plan(store, plan, owner=owner)


def _human(n: int) -> str:
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{n} B"
