"""Retention applying: execute exactly the actions of a plan, re-checking each one first.

Apply takes a ``retention`` lease per checkpoint, re-checks each action against the catalog
(pins, aliases, other flows' leases, remaining copies) and skips what no longer holds; rows and
replicas left in DELETING by a crash are finished by the next plan. Both are idempotent.
"""

from __future__ import annotations

import logging
import os
import shutil
import socket
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ckptstore.core import StoreCore
from ckptstore.errors import CheckpointNotFoundError, CkptError, StorageError
from ckptstore.format.constants import COMMIT_NAME
from ckptstore.numeric import human_bytes
from ckptstore.ops.tiering.retention.plan import (
    REASON_THAWING,
    ActionKind,
    PlannedAction,
    RetentionPlan,
    later_copy_present,
    live_lease,
    other_copy_present,
    plan_retention,
)
from ckptstore.records import Checkpoint, CheckpointState, ReplicaState, ThawState
from ckptstore.retention import REASON_LEASED, RetentionPolicy

__all__ = ["LEASE_TTL_S", "RETENTION_PURPOSE", "RetentionReport", "apply_plan", "apply_retention"]

logger = logging.getLogger(__name__)

#: Lease purpose and time-to-live used while deleting one checkpoint's copy.
RETENTION_PURPOSE = "retention"
LEASE_TTL_S = 600.0


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
        human_bytes(report.freed_bytes),
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
    holder = live_lease(store, ck.id, ignore=owner)
    if holder is not None:
        return f"{REASON_LEASED} ({holder})"
    if ck.state == CheckpointState.DELETED:
        return "already deleted"
    if store.catalog.thaws(checkpoint_ids=[ck.id], state=ThawState.PENDING):
        return f"{REASON_THAWING} (since planning)"
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
        if not (other_copy_present if action.resume else later_copy_present)(ck, action.tier):
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
    from ckptstore.ops.tiering.replicas import delete_replica

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
    from ckptstore.ops.tiering.replicas import delete_replica

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
        (path / COMMIT_NAME).unlink(missing_ok=True)
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
