"""Prefect task that merges checkpoints (model soups, federated averaging)."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from prefect import task
from prefect.cache_policies import NO_CACHE

if TYPE_CHECKING:
    from ckptstore.store import CheckpointStore

__all__ = ["merge_task"]

logger = logging.getLogger(__name__)


@task(name="merge-checkpoints", cache_policy=NO_CACHE)
def merge_task(
    store: CheckpointStore,
    refs: list[str],
    run: str,
    step: int,
    *,
    method: str | None = None,
    weights: list[float] | None = None,
    weights_from_metric: str | None = None,
    keys: list[str] | None = None,
    accumulate: str = "auto",
) -> dict[str, Any]:
    """Run :meth:`ckptstore.store.CheckpointStore.merge` and summarise the result.

    Args:
        store: The open store.
        refs: The inputs.
        run: Run of the merged checkpoint.
        step: Its step.
        method: ``mean`` or ``weighted``.
        weights: One weight per input.
        weights_from_metric: Take the weights from this metric of each input.
        keys: fnmatch patterns selecting what is merged.
        accumulate: ``auto``, ``float32`` or ``float64``.

    Returns:
        ``{"merged": id, "ref", "merge": what ``ckpt show`` says of the merge}``.
    """
    from ckptstore.ops.reading.show import merge_record

    merged = store.merge(refs, run=run, step=step, method=method, weights=weights,
                         weights_from_metric=weights_from_metric, keys=keys,
                         accumulate=accumulate)
    return {"merged": merged.id, "ref": merged.ref, "merge": merge_record(store, merged)}
