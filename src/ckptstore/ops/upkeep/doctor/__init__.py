"""Doctor: reconcile the catalog with what is really on every tier, and repair what is safe.

What it looks for (each is a :class:`Finding` of one ``kind``):

* ``missing-replica``: the catalog says a copy is PRESENT, but its directory, marker,
  manifest or files are not there (a row without data); a copy with no file left at all is
  reported as lost.
* ``damaged-replica``: a PRESENT copy whose bytes differ from the manifest (size or hash).
* ``zarr-metadata``: a local copy whose ``zarr.json`` documents do not describe the arrays
  the manifest records (a planted codec, a changed dtype or shape), or that holds Zarr v2
  metadata (``.zarray``/``.zgroup``) that ``zarr.open_group`` would prefer to trust.
* ``orphan-data``: files on a tier with no catalog row, or left behind by a row that no
  longer owns them (FAILED/DELETED checkpoints, DELETED replicas, killed copies).
* ``dead-pending``: PENDING rows whose writer process (on this host) is gone.
* ``stale-copying``: a replica stuck in COPYING: its copy was killed.
* ``dead-lease``: a lease held by a process (on this host) that is gone; until it expires it
  blocks every rerun of the flow that took it.
* ``stray-temp``: temporary files of killed writes inside a committed copy.
* ``interrupted-delete``: a copy or checkpoint left in DELETING (``ckpt prune`` finishes it).
* ``lost-part``: a part of a checkpoint saved across hosts held by a host not heard from for
  longer than ``host_timeout_s`` (reported with the part's other copies, never repaired).

``fix=True`` applies only repairs that cannot lose data: it records the truth (DAMAGED, FAILED,
DELETED for copies that are not there), releases leases of dead local processes, removes
files that no catalog row needs and that carry no commit marker (plus leftovers of rows the
catalog already gave up), and rewrites derived Zarr metadata from the manifest. It never
deletes a committed copy the catalog still counts on, never deletes marked data without a
row (that may be a checkpoint from another catalog: adopt or remove it by hand), and takes
the same leases as the flows, so it cannot pull files from under a running restore or copy.

The checks run in four phases, one module each: rows whose process or flow is gone
(:mod:`~ckptstore.ops.upkeep.doctor.rows`), copies the catalog claims
(:mod:`~ckptstore.ops.upkeep.doctor.replicas`), data nobody owns
(:mod:`~ckptstore.ops.upkeep.doctor.orphans`), and parts on hosts gone silent
(:mod:`~ckptstore.ops.upkeep.doctor.hosts`); :mod:`~ckptstore.ops.upkeep.doctor.run` records
findings and applies repairs, :mod:`~ckptstore.ops.upkeep.doctor.report` is what a run returns.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable

from ckptstore.core import StoreCore
from ckptstore.keyfiles import load_decryption_key
from ckptstore.ops.upkeep.doctor.hosts import check_hosts
from ckptstore.ops.upkeep.doctor.orphans import check_hot_dirs, check_tier_keys
from ckptstore.ops.upkeep.doctor.replicas import check_replicas
from ckptstore.ops.upkeep.doctor.report import FINDING_KINDS, DoctorReport, Finding
from ckptstore.ops.upkeep.doctor.rows import (
    check_copying,
    check_deleting,
    check_leases,
    check_pending,
)
from ckptstore.ops.upkeep.doctor.run import DoctorRun
from ckptstore.progress import Progress

__all__ = ["FINDING_KINDS", "DoctorReport", "Finding", "doctor"]

logger = logging.getLogger(__name__)


def doctor(
    store: StoreCore,
    *,
    fix: bool = False,
    deep: bool = False,
    tiers: Iterable[str] | None = None,
    grace_s: float = 60.0,
    progress: Progress | None = None,
    key: str | os.PathLike[str] | None = None,
) -> DoctorReport:
    """Reconcile the catalog with storage; with ``fix``, apply the safe repairs.

    Args:
        store: The open store.
        fix: Apply the repairs that cannot lose data (see the module docstring).
        deep: Re-hash every chunk of every copy (remote copies are downloaded); otherwise
            presence and sizes (local) or presence (remote).
        tiers: Only these tiers (default: every configured tier).
        grace_s: Unfinished files and directories younger than this are left alone (a
            writer may still be working on them).
        progress: Called with 1 after each copy checked; one with ``set_total``
            (:mod:`ckptstore.progress`) is first told how many copies there are to check.
        key: X25519 private key that opens encrypted copies, for ``deep`` (default:
            ``$CKPT_DECRYPT_KEY``, else the config's ``decrypt_key``); without one, a sealed
            copy's envelope, objects and sizes are checked.

    Returns:
        The :class:`DoctorReport`; ``report.ok`` is True when nothing is wrong any more.

    Raises:
        StorageError: If the catalog cannot be reached.
        ConfigError: If ``key`` is not a readable X25519 private key (checked first).
    """
    if key is not None:
        load_decryption_key(key)  # a bad --key fails before anything is checked or fixed
    job = DoctorRun(store, fix=fix, deep=deep, grace_s=grace_s, tiers=tiers, key=key)
    check_leases(job)
    everything = store.catalog.list(state=None)
    check_pending(job, everything)
    check_copying(job, everything)
    check_deleting(job, everything)
    check_replicas(job, everything, progress)
    # Repairs above changed rows: look again before judging what owns which files.
    everything = store.catalog.list(state=None) if fix else everything
    by_id = {ck.id: ck for ck in everything}
    check_hot_dirs(job, by_id)
    check_tier_keys(job, by_id)
    check_hosts(job, everything)
    report = job.report
    if fix and report.findings:
        store.catalog.record_event(
            "doctor",
            actor=job.owner,
            detail={"fixed": sum(1 for f in report.findings if f.fixed),
                    "findings": [f"{f.kind} {f.subject}" for f in report.findings[:50]]},
        )
    logger.info("%s", report.render().splitlines()[0])
    return report
