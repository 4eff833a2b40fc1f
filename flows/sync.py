"""Sync flow: push new checkpoints of selected runs to remote stores, e.g. on a schedule."""

from __future__ import annotations

import logging
from typing import Any

from prefect import flow

from ckptstore.errors import StorageError
from ckptstore.flows.common import collect, open_store
from ckptstore.tasks.remote import sync_task

__all__ = ["sync_flow"]

logger = logging.getLogger(__name__)


@flow(name="ckpt-sync")
def sync_flow(
    store_root: str | None = None,
    config: str | None = None,
    remote: str | None = None,
    runs: list[str] | None = None,
    best: str | None = None,
    mode: str = "min",
    tag: str | None = None,
) -> dict[str, Any]:
    """Push what the remotes lack: every committed checkpoint (or the best) of each run.

    One task per (remote, run); each is idempotent, so the flow can run on a schedule
    (``[schedules] sync = "@every 1h"``): a run whose best did not change sends nothing.

    Args:
        store_root: Store directory.
        config: Config file path.
        remote: Only this remote (default: every remote of the store).
        runs: Only these runs (default: every run).
        best: Only each run's best checkpoint by this metric.
        mode: ``min`` or ``max`` for ``best``.
        tag: Only checkpoints with this tag.

    Returns:
        ``{"reports": [push reports], "bytes_sent", "pushed": [ids], "failed"}``.

    Raises:
        RemoteError: If ``remote`` is not a remote of the store.
        StorageError: If some (remote, run) could not be synced (the others are done).
    """
    with open_store(store_root, config) as store:
        targets = [remote] if remote is not None else [r.name for r in store.catalog.remotes()]
        for name in targets:
            store.catalog.remote(name)  # an unknown remote fails before any task starts
        names = runs if runs is not None else [r.name for r in store.runs()]
        pairs = [(t, r) for t in targets for r in names]
        futures = [sync_task.submit(store, t, r, best=best, mode=mode, tag=tag)
                   for t, r in pairs]
        reports, failures = collect(futures, [f"{r} -> {t}" for t, r in pairs])
    pushed = [cid for rep in reports for cid in rep.get("pushed", [])]
    sent = sum(int(rep.get("bytes_sent", 0)) for rep in reports)
    summary = {"reports": reports, "bytes_sent": sent, "pushed": pushed, "failed": failures}
    logger.info("sync: %d pushed, %d bytes sent, %d failed", len(pushed), sent, len(failures))
    if failures:
        raise StorageError(
            f"sync failed for {len(failures)} run(s): " + "; ".join(failures[:5])
            + "; fix the cause and rerun (what arrived is kept)"
        )
    return summary
