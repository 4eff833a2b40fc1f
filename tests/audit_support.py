"""What a block of code does on its own thread: files, sockets, imports, subprocesses.

Tests that a call is cheap check this instead of a wall clock: on a shared machine a clock
measures the load, while "no file, socket, import or subprocess on the caller's thread" is
what makes the call cheap, and it holds or not whatever else runs.
"""

from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Iterator
from typing import Any

__all__ = ["io_events"]

_WATCH = threading.local()
_EVENTS: list[str] = []
_HOOKED: list[bool] = []


def _audit(event: str, args: tuple[Any, ...]) -> None:
    if getattr(_WATCH, "on", False) and (
            event in ("open", "import") or event.startswith(("socket.", "subprocess."))):
        _EVENTS.append(f"{event} {args[:1]!r}")


@contextlib.contextmanager
def io_events() -> Iterator[list[str]]:
    """The audit events of file opens, sockets, imports and subprocesses that this thread
    raises inside the block (other threads are not watched)."""
    if not _HOOKED:
        sys.addaudithook(_audit)  # cannot be removed: inert outside these blocks
        _HOOKED.append(True)
    _EVENTS.clear()
    _WATCH.on = True
    try:
        yield _EVENTS
    finally:
        _WATCH.on = False
