"""Doctor phase A: catalog rows whose process or flow is gone.

Dead leases, PENDING rows of dead writers, replicas stuck in COPYING, and copies or
checkpoints left in DELETING.
"""

from __future__ import annotations

import logging
from pathlib import Path

from ckptstore.core import StoreCore
from ckptstore.identity import owner_is_dead
from ckptstore.ops.tiering.gc import DEFAULT_PENDING_GRACE_S, writer_is_dead
from ckptstore.ops.upkeep.doctor.run import DoctorRun, remove_tree
from ckptstore.records import Checkpoint, CheckpointState, ReplicaState

__all__ = ["check_copying", "check_deleting", "check_leases", "check_pending"]

logger = logging.getLogger(__name__)


def _live_leases(store: StoreCore) -> list[tuple[str, str, str]]:
    """``(checkpoint id, purpose, owner)`` of every unexpired lease."""
    return [(x.checkpoint_id, x.purpose, x.owner) for x in store.catalog.leases()]


def check_leases(job: DoctorRun) -> None:
    """Find live leases held by processes of this host that are gone."""
    for ckpt_id, purpose, owner in _live_leases(job.store):
        job.count("leases")
        if not owner_is_dead(owner, on_host=job.host):
            continue

        def release(ckpt_id: str = ckpt_id, purpose: str = purpose,
                    owner: str = owner) -> None:
            job.store.catalog.release_lease(ckpt_id, purpose, owner)

        job.find("dead-lease", ckpt_id,
                 f"lease {purpose!r} is held by {owner}, a process that is gone; it "
                 "blocks reruns until it expires", repair=release)


def check_pending(job: DoctorRun, everything: list[Checkpoint]) -> None:
    """Find PENDING rows whose writer is gone (repair: FAILED, directory removed)."""
    for ck in everything:
        if ck.state != CheckpointState.PENDING or not writer_is_dead(
            job.store, ck, older_than_s=DEFAULT_PENDING_GRACE_S
        ):
            continue
        directory = job.store.checkpoint_dir(ck.run, ck.id)

        def fail(ck: Checkpoint = ck, directory: Path = directory) -> None:
            job.store.catalog.fail_checkpoint(ck.id, "writer died; cleaned by doctor")
            if directory.exists():
                remove_tree(directory, job.store.hot)

        job.find("dead-pending", ck.id,
                 f"{ck.ref} is PENDING but its writer {ck.writer} is gone", repair=fail)


def check_copying(job: DoctorRun, everything: list[Checkpoint]) -> None:
    """Find copies stuck in COPYING with no flow holding their lease."""
    for ck in everything:
        if ck.state != CheckpointState.COMMITTED:
            continue
        for replica in ck.replicas:
            if replica.state != ReplicaState.COPYING or replica.tier not in job.tiers:
                continue
            purpose = f"archive:{replica.tier}"
            holder = job.store.catalog.lease_holder(ck.id, purpose)
            if holder is not None:
                continue  # a live copy is under way
            if ck.parted and any(
                p.tier == replica.tier and p.state in (ReplicaState.PRESENT,
                                                       ReplicaState.COPYING)
                for p in job.store.catalog.parts(ck.id)
            ):
                # Saved across hosts: the copy is assembled part by part, one upload per
                # host, possibly hours apart; it is not stuck while parts are in.
                continue

            def drop(ck: Checkpoint = ck, tier: str = replica.tier) -> None:
                job.store.catalog.set_replica(ck.id, tier, state=ReplicaState.DELETED,
                                              bytes=0)

            job.find("stale-copying", ck.id,
                     f"the {replica.tier} copy of {ck.ref} is COPYING but no flow holds "
                     f"{purpose}: the copy was killed; rerun the archive",
                     tier=replica.tier,
                     repair=job.with_lease(ck.id, purpose, drop))


def check_deleting(job: DoctorRun, everything: list[Checkpoint]) -> None:
    """Report checkpoints and copies an interrupted prune left in DELETING."""
    for ck in everything:
        if ck.state == CheckpointState.DELETING:
            job.find("interrupted-delete", ck.id,
                     f"{ck.ref} is DELETING: a prune was interrupted; `ckpt prune` "
                     "finishes it")
            continue
        for replica in ck.replicas:
            if replica.state == ReplicaState.DELETING:
                job.find("interrupted-delete", ck.id,
                         f"the {replica.tier} copy of {ck.ref} is DELETING: a prune was "
                         "interrupted; `ckpt prune --tier "
                         f"{replica.tier}` finishes it", tier=replica.tier)
