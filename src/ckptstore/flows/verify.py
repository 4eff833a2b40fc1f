"""Verify flow: scrub replicas (one checkpoint, or every run in parallel), mark damage, repair."""

from __future__ import annotations

import logging
from typing import Any

from prefect import flow, unmapped
from prefect.task_runners import ThreadPoolTaskRunner

from ckptstore.errors import IntegrityError
from ckptstore.flows.common import collect, open_store
from ckptstore.tasks.verify import verify_task

__all__ = ["verify_flow"]

logger = logging.getLogger(__name__)


@flow(name="ckpt-verify", task_runner=ThreadPoolTaskRunner(max_workers=4))  # type: ignore[arg-type]
def verify_flow(
    ref: str | None = None,
    tier: str | None = None,
    repair: bool = True,
    deep: bool = True,
    store_root: str | None = None,
    config: str | None = None,
    run: str | None = None,
) -> dict[str, Any]:
    """Verify replicas; with ``repair``, re-copy damaged ones from a verified replica.

    One task for ``ref``, else one task per run, in parallel (within a run the operation goes
    oldest first so a base is repaired before the deltas that read it).

    Args:
        ref: One checkpoint, or None for every committed checkpoint (of ``run``).
        tier: One tier, or None for every tier.
        repair: Repair damaged replicas from a verified one.
        deep: Re-hash every chunk.
        store_root: Store directory.
        config: Config file path.
        run: With ``ref=None``, only this run.

    Returns:
        ``{"checked", "damaged", "repaired", "unrepaired", "reports", "failed"}``.

    Raises:
        IntegrityError: If damage remains unrepaired or a task could not run.
    """
    with open_store(store_root, config) as store:
        if ref is not None:
            futures = [verify_task.submit(store, ref=ref, tier=tier, repair=repair, deep=deep)]
            labels = [ref]
        else:
            runs = [run] if run is not None else sorted({ck.run for ck in store.list()})
            futures = list(
                verify_task.map(
                    unmapped(store), run=runs, tier=unmapped(tier), repair=unmapped(repair),
                    deep=unmapped(deep),
                )
            ) if runs else []
            labels = [f"run {r}" for r in runs]
        reports, failures = collect(futures, labels)
    summary: dict[str, Any] = {
        "checked": sum(len(rep.get("checked", [])) for rep in reports),
        "damaged": {k: v for rep in reports for k, v in rep.get("damaged", {}).items()},
        "repaired": [r for rep in reports for r in rep.get("repaired", [])],
        "unrepaired": {k: v for rep in reports for k, v in rep.get("unrepaired", {}).items()},
        "reports": reports,
        "failed": failures,
    }
    if failures or summary["unrepaired"] or not all(rep.get("clean", True) for rep in reports):
        details = [*failures, *(f"{k}: {v}" for k, v in summary["unrepaired"].items())]
        raise IntegrityError(
            f"verify found {len(summary['damaged'])} damaged replica(s), "
            f"{len(summary['unrepaired'])} unrepaired, {len(failures)} task failure(s): "
            + "; ".join(details[:5])
            + "; restore from another tier or rerun verify with repair"
        )
    return summary
