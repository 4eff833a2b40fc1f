"""Merge flow: average checkpoints into a new one off the training path."""

from __future__ import annotations

import logging
from typing import Any

from prefect import flow

from ckptstore.flows.common import open_store
from ckptstore.tasks.merge import merge_task

__all__ = ["merge_flow"]

logger = logging.getLogger(__name__)


@flow(name="ckpt-merge")
def merge_flow(
    refs: list[str],
    run: str,
    step: int,
    method: str | None = None,
    weights: list[float] | None = None,
    weights_from_metric: str | None = None,
    keys: list[str] | None = None,
    accumulate: str = "auto",
    store_root: str | None = None,
    config: str | None = None,
) -> dict[str, Any]:
    """Merge ``refs`` into a new checkpoint of ``run`` at ``step``; idempotent.

    Running it again with the same parameters returns the checkpoint the first run made
    (see :meth:`ckptstore.store.CheckpointStore.merge`).

    Args:
        refs: Two or more checkpoint references.
        run: Run of the merged checkpoint.
        step: Its step.
        method: ``mean`` or ``weighted`` (default: weighted when weights are given).
        weights: One weight per input.
        weights_from_metric: Weigh each input by this recorded metric (``samples``).
        keys: fnmatch patterns selecting what is merged and kept.
        accumulate: ``auto``, ``float32`` or ``float64``.
        store_root: Store directory.
        config: Config file path.

    Returns:
        ``{"merged", "ref", "merge"}``.
    """
    with open_store(store_root, config) as store:
        result: dict[str, Any] = merge_task(
            store, refs, run, step, method=method, weights=weights,
            weights_from_metric=weights_from_metric, keys=keys, accumulate=accumulate,
        )
    return result
