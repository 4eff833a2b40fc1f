"""Sync flow: push new checkpoints of selected runs to remote stores, e.g. on a schedule."""

from __future__ import annotations

import logging
from typing import Any

from prefect import flow

from ckptstore.errors import StorageError
from ckptstore.flows.common import collect, open_store
from ckptstore.ops.sharing.sync import sync_selection
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
    mode: str | None = None,
    tag: str | None = None,
) -> dict[str, Any]:
    """Push what the remotes lack: every committed checkpoint (or the best) of each run.

    One task per (remote, run); each is idempotent, so the flow can run on a schedule
    (``[schedules] sync = "@every 1h"``): a run whose best did not change sends nothing.
    Arguments not given come from the config's ``[sync]`` table (what a schedule uses).

    Args:
        store_root: Store directory.
        config: Config file path.
        remote: Only this remote (default: ``sync.remote``, else every remote of the store).
        runs: Only these runs (default: ``sync.runs``, else every run).
        best: Only each run's best checkpoint by this metric (default: ``sync.best``).
        mode: ``min`` or ``max`` for ``best`` (default: ``sync.mode``, else ``min``).
        tag: Only checkpoints with this tag (default: ``sync.tag``).

    Returns:
        ``{"reports": [push reports], "bytes_sent", "pushed": [ids], "failed"}``.

    Raises:
        RemoteError: If ``remote`` is not a remote of the store.
        StorageError: If some (remote, run) could not be synced (the others are done).
    """
    with open_store(store_root, config) as store:
        chosen = sync_selection(store, remote=remote, runs=runs, best=best, mode=mode, tag=tag)
        pairs = [(t, r) for t in chosen.remotes for r in chosen.runs]
        futures = [sync_task.submit(store, t, r, best=chosen.best, mode=chosen.mode,
                                    tag=chosen.tag)
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
