"""Sync: push what a run has that a remote lacks, as a schedule does it.

:func:`sync_selection` says what one sync pushes (its arguments, else the config's ``[sync]``
table, else everything); :func:`sync_run` pushes one run's selection with
:func:`ckptstore.ops.sharing.push.push_checkpoints`. The ``sync`` flow (``flows/sync.py``)
runs one task per remote and run.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ckptstore.core import StoreCore
from ckptstore.ops.sharing.push import PushReport, push_checkpoints
from ckptstore.records import CheckpointState

__all__ = ["SyncSelection", "sync_run", "sync_selection"]


@dataclass(frozen=True)
class SyncSelection:
    """What one sync pushes: to which remotes, which runs, and of each run which checkpoints.

    Attributes:
        remotes: Remote names.
        runs: Run names.
        best: Only each run's best checkpoint by this metric (None: every committed one).
        mode: ``min`` or ``max`` for ``best``.
        tag: Only checkpoints with this tag.
    """

    remotes: list[str]
    runs: list[str]
    best: str | None
    mode: str
    tag: str | None


def sync_selection(
    store: StoreCore,
    *,
    remote: str | None = None,
    runs: list[str] | None = None,
    best: str | None = None,
    mode: str | None = None,
    tag: str | None = None,
) -> SyncSelection:
    """What a sync pushes: each argument given, else the store's ``sync`` setting, else all.

    A scheduled sync is started without arguments, so the config's ``[sync]`` table is how
    an operator selects runs and bests for it.

    Raises:
        RemoteError: If the remote (given or configured) is not a remote of the store.
    """
    config = store.settings.sync
    remote = remote if remote is not None else config.get("remote")
    if remote is not None:
        store.catalog.remote(remote)  # unknown: fails before anything is pushed
        remotes = [remote]
    else:
        remotes = [r.name for r in store.catalog.remotes()]
    chosen = runs if runs is not None else config.get("runs")
    names = list(chosen) if chosen is not None else [r.name for r in store.catalog.runs()]
    return SyncSelection(
        remotes=remotes,
        runs=names,
        best=best if best is not None else config.get("best"),
        mode=mode if mode is not None else config.get("mode", "min"),
        tag=tag if tag is not None else config.get("tag"),
    )


def sync_run(
    src: StoreCore,
    dst: StoreCore,
    run: str,
    *,
    remote: str,
    tag: str | None = None,
    best: str | None = None,
    mode: str = "min",
    **options: Any,
) -> PushReport:
    """Push the committed checkpoints of ``run`` the destination lacks.

    A checkpoint the destination pruned is left pruned (``pruned_there`` in the report):
    its retention decided, and a scheduled sync must not send it back on every run. A base
    a new checkpoint needs is sent again all the same (``revived``).

    Args:
        src: The store the checkpoints come from.
        dst: The store they go to.
        run: The run.
        remote: The remote's name.
        tag: Only checkpoints with this tag.
        best: Only the run's best checkpoint by this metric (``mode`` ``min`` or ``max``).
        mode: ``min`` or ``max`` for ``best``.
        **options: Passed on to :func:`push_checkpoints`.

    Returns:
        The :class:`PushReport`.

    Raises:
        CheckpointNotFoundError: If the run does not exist (or has no ``best`` metric).
        As :func:`push_checkpoints`.
    """
    src.catalog.get_run(run)
    if best is not None:
        todo = [src.catalog.best(run, best, mode)]
    else:
        todo = src.catalog.list(run=run, state=CheckpointState.COMMITTED,
                                order_by="created_at")
    if tag is not None:
        todo = [ck for ck in todo if tag in ck.tags]
    # What the destination has is reported as present, not sent again; what it pruned is
    # left pruned (its retention decided), not sent again on every run.
    return push_checkpoints(src, dst, [ck.id for ck in todo], remote=remote,
                            keep_pruned=True, **options)
