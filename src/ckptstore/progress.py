"""How long operations report progress: a plain callback, told the total when known.

A ``progress`` argument is any callable taking the amount of work just done (bytes, unless
the function says otherwise). A callback that also has a ``set_total(total)`` method is told
how much work the whole operation will take, before the first advance (and again if the
estimate changes), which is what a progress bar needs for its ETA. Plain functions such as
``list.append`` keep working: they are simply never told the total.

Reporting costs one call per file, chunk or item, never per byte.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol, runtime_checkable

__all__ = ["Progress", "ProgressWithTotal", "announce_total"]

#: Called with the amount of work just done.
Progress = Callable[[int], None]


@runtime_checkable
class ProgressWithTotal(Protocol):
    """A progress callback that also wants to know the total (a progress bar)."""

    def __call__(self, amount: int, /) -> None:
        """Record ``amount`` more units of work done."""

    def set_total(self, total: int, /) -> None:
        """Record that the whole operation takes ``total`` units."""


def announce_total(progress: Progress | None, total: int) -> None:
    """Tell ``progress`` the operation's total, if it is a :class:`ProgressWithTotal`.

    Args:
        progress: The caller's callback, or None.
        total: Units of work the whole operation takes.
    """
    if isinstance(progress, ProgressWithTotal):
        progress.set_total(total)
