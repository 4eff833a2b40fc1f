"""Prefetch and thaw flows: bring a checkpoint to a host's fast tier ahead of need.

Thin: the rules are in ``ops/reading/prefetch.py`` and ``ops/tiering/thaw_poll.py``. A
prefetch for another host runs on that host's work queue (``ckpt prefetch REF --host H``, served by
``ckpt agent``
there, docs/MULTINODE.md), since hot tiers are node-local. When the only copy is in GLACIER,
the prefetch flow (with ``wait_thaw``) goes on to wait for the thaw and restore it.
"""

from __future__ import annotations

import logging
from typing import Any

from prefect import flow

from ckptstore.errors import ThawPendingError
from ckptstore.flows.common import open_store
from ckptstore.tasks.prefetch import prefetch_task, thaw_task

__all__ = ["prefetch_flow", "thaw_flow"]

logger = logging.getLogger(__name__)


@flow(name="ckpt-prefetch")
def prefetch_flow(
    ref: str,
    to: str = "hot",
    hold_s: float = 6 * 3600.0,
    wait_thaw: bool = True,
    poll_s: float = 300.0,
    store_root: str | None = None,
    config: str | None = None,
) -> dict[str, Any]:
    """Prefetch ``ref`` to this host's ``to`` tier (``hot`` or ``memory``).

    Args:
        ref: Checkpoint reference.
        to: ``hot`` or ``memory``.
        hold_s: Seconds the prefetch lease keeps retention away if nobody loads it.
        wait_thaw: When the only copy is in GLACIER, wait for its thaw, then prefetch.
        poll_s: Seconds between two looks at a thawing copy.
        store_root: Store directory.
        config: Config file path.

    Returns:
        What the prefetch did (``PrefetchResult.to_dict``).

    Raises:
        ThawPendingError: If the copy is thawing and ``wait_thaw`` is False.
    """
    with open_store(store_root, config) as store:
        try:
            result: dict[str, Any] = prefetch_task(store, ref, to=to, hold_s=hold_s)
        except ThawPendingError as exc:
            if not wait_thaw:
                raise
            logger.info("%s; waiting for it", exc)
            thaw_task(store, ref, poll_s=poll_s)
            result = prefetch_task(store, ref, to=to, hold_s=hold_s)
    return result


@flow(name="ckpt-thaw")
def thaw_flow(
    ref: str,
    poll_s: float = 300.0,
    timeout_s: float | None = None,
    store_root: str | None = None,
    config: str | None = None,
) -> dict[str, Any]:
    """Thaw ``ref``'s GLACIER copy if needed, wait until readable, restore it to hot.

    Returns:
        ``{"ref": ..., "path": ...}``.

    Raises:
        ThawPendingError: If ``timeout_s`` passed first.
    """
    with open_store(store_root, config) as store:
        result: dict[str, Any] = thaw_task(store, ref, poll_s=poll_s, timeout_s=timeout_s)
    return result
