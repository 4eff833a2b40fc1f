"""Which task failures are worth a retry (a ``retry_condition_fn`` for Prefect tasks)."""

from __future__ import annotations

import logging
from typing import Any

from ckptstore.errors import CkptError, ConflictError, StorageError, ThawPendingError

__all__ = ["TRANSFER_RETRIES", "TRANSFER_RETRY_DELAYS", "is_transient", "retry_transient"]

logger = logging.getLogger(__name__)

TRANSFER_RETRIES = 2
# Short first, longer second: throttling and brief connection losses clear within seconds.
TRANSFER_RETRY_DELAYS: list[float] = [2.0, 10.0]


def is_transient(exc: BaseException) -> bool:
    """Whether a failure may go away when the same task runs again.

    Storage failures, lease conflicts and foreign errors (botocore, aiohttp, OS) are retried;
    our definite errors (not found, integrity, invalid names, config, unsafe objects) are not,
    because another attempt would fail the same way.

    Args:
        exc: The exception the task raised.

    Returns:
        True to retry.
    """
    if isinstance(exc, ThawPendingError):
        # S3 takes minutes to hours to thaw a GLACIER copy: the thaw flow polls for it
        # (flows/prefetch.py); retrying within seconds would only ask again.
        return False
    if isinstance(exc, StorageError | ConflictError):
        return True
    if isinstance(exc, CkptError):
        return False
    return isinstance(exc, Exception)


def retry_transient(task: Any, task_run: Any, state: Any) -> bool:
    """Prefect ``retry_condition_fn``: retry only :func:`is_transient` failures.

    Args:
        task: The task (unused).
        task_run: The task run (unused).
        state: The Failed state; its ``data`` holds the exception.

    Returns:
        True to retry.
    """
    exc = getattr(state, "data", None)
    if not isinstance(exc, BaseException):
        return True
    retry = is_transient(exc)
    logger.debug("task failure %s: retry=%s", type(exc).__name__, retry)
    return retry
