"""Timing one operation for the metrics recorder, and telling blocked time from background time.

:meth:`Metrics.timed <ckptstore.observability.metrics.Metrics.timed>` hands out an
:class:`OperationTimer`; the timer reports to the recorder through the small
:class:`Observer` interface, so this module does not depend on the recorder.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator
from contextvars import ContextVar
from types import TracebackType
from typing import Protocol

__all__ = ["Observer", "OperationTimer", "off_training_path"]

logger = logging.getLogger(__name__)

# Set while an operation runs on a background thread on behalf of the training loop (the async
# saver's worker): a "blocking" save there does not block training, so its wall time must not
# be counted as blocked time.
_OFF_PATH: ContextVar[bool] = ContextVar("ckpt_off_training_path", default=False)


class Observer(Protocol):
    """What a timer reports to (:class:`~ckptstore.observability.metrics.Metrics`)."""

    def observe(
        self,
        op: str,
        *,
        seconds: float,
        blocked_seconds: float | None = None,
        bytes_logical: int = 0,
        bytes_stored: int = 0,
        bytes_transferred: int = 0,
        bytes_deduplicated: int = 0,
        run: str | None = None,
        tier: str | None = None,
        step: int | None = None,
        ok: bool = True,
        error_type: str | None = None,
    ) -> None:
        """Record one finished operation."""
        ...


@contextlib.contextmanager
def off_training_path() -> Iterator[None]:
    """Mark operations in this block as not blocking the training loop.

    The async saver wraps its background ``store.save`` in this, so ``timed(...,
    blocking=True)`` inside records no blocked time; the saver reports the real blocked time
    (staging) itself with :meth:`Metrics.observe_blocked`.
    """
    token = _OFF_PATH.set(True)
    try:
        yield
    finally:
        _OFF_PATH.reset(token)


class OperationTimer:
    """Times one operation; observed on exit with ``ok``/``error_type`` set from the outcome.

    Attributes:
        blocked_seconds: Set it to record the caller's blocked time (an async save sets the
            staging time); with ``blocking=True`` it defaults to the wall time.
    """

    __slots__ = (
        "_blocking",
        "_metrics",
        "_op",
        "_run",
        "_started",
        "_step",
        "_tier",
        "blocked_seconds",
        "bytes_deduplicated",
        "bytes_logical",
        "bytes_stored",
        "bytes_transferred",
    )

    def __init__(
        self,
        metrics: Observer,
        op: str,
        *,
        run: str | None,
        tier: str | None,
        step: int | None,
        blocking: bool,
    ) -> None:
        self._metrics = metrics
        self._op = op
        self._run = run
        self._tier = tier
        self._step = step
        self._blocking = blocking
        self._started = 0.0
        self.blocked_seconds: float | None = None
        self.bytes_logical = 0
        self.bytes_stored = 0
        self.bytes_transferred = 0
        self.bytes_deduplicated = 0

    def add(
        self,
        *,
        bytes_logical: int = 0,
        bytes_stored: int = 0,
        bytes_transferred: int = 0,
        bytes_deduplicated: int = 0,
        step: int | None = None,
    ) -> None:
        """Add byte counts (and set the step if it became known inside the block)."""
        self.bytes_logical += bytes_logical
        self.bytes_stored += bytes_stored
        self.bytes_transferred += bytes_transferred
        self.bytes_deduplicated += bytes_deduplicated
        if step is not None:
            self._step = step

    def __enter__(self) -> OperationTimer:
        self._started = time.perf_counter()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        seconds = time.perf_counter() - self._started
        blocked = self.blocked_seconds
        if blocked is None and self._blocking and not _OFF_PATH.get():
            blocked = seconds
        try:
            self._metrics.observe(
                self._op,
                seconds=seconds,
                blocked_seconds=blocked,
                bytes_logical=self.bytes_logical,
                bytes_stored=self.bytes_stored,
                bytes_transferred=self.bytes_transferred,
                bytes_deduplicated=self.bytes_deduplicated,
                run=self._run,
                tier=self._tier,
                step=self._step,
                ok=exc_type is None,
                error_type=None if exc_type is None else exc_type.__name__,
            )
        except Exception:  # recording must never replace the operation's own outcome
            logger.warning("recording %s metrics failed", self._op, exc_info=True)

