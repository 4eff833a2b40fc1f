"""Helpers every flow shares: open the store from plain parameters, collect task results."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Sequence
from typing import Any

from ckptstore.store import CheckpointStore

__all__ = ["collect", "open_store"]

logger = logging.getLogger(__name__)


@contextlib.contextmanager
def open_store(store_root: str | None, config: str | None) -> Iterator[CheckpointStore]:
    """Open the store a flow works on, and close it when the flow ends.

    Flow parameters are plain paths: credentials come from the environment of the process
    that runs the flow, never from parameters.

    Args:
        store_root: Store directory (default ``$CKPT_ROOT`` / the config's ``root``).
        config: Config file path (default ``$CKPT_CONFIG``).

    Yields:
        The open store.

    Raises:
        ConfigError: If the configuration is invalid.
    """
    store = CheckpointStore.open(store_root, config=config)
    try:
        yield store
    finally:
        store.close()


def collect(futures: Sequence[Any], labels: Sequence[str]) -> tuple[list[Any], list[str]]:
    """Wait for task futures; return (results, failures) without stopping at the first error.

    Args:
        futures: Prefect futures.
        labels: One label per future (used in the failure texts).

    Returns:
        The results of the successful futures, and ``"label: error"`` for the failed ones.
    """
    results: list[Any] = []
    failures: list[str] = []
    for future, label in zip(futures, labels, strict=True):
        try:
            results.append(future.result())
        except Exception as exc:  # each failure is reported; the flow decides to fail at the end
            logger.warning("%s failed: %s", label, exc)
            failures.append(f"{label}: {type(exc).__name__}: {exc}")
    return results, failures
