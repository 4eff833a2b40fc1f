"""Fault points: named places in long operations where a test can kill the process.

Set ``CKPT_FAULT_POINT=<name>`` (optionally ``<name>:<n>`` to fire on the n-th pass) and the
process SIGKILLs itself when it reaches that point. Unset, a fault point costs one dict lookup.
This is how the crash-consistency tests kill a save at every phase boundary for real.
"""

from __future__ import annotations

import os
import signal
import threading

from ckptstore.numeric import decimal_or_none

__all__ = ["fault_point"]

_counts: dict[str, int] = {}
_lock = threading.Lock()


def fault_point(name: str) -> None:
    """Kill the process if ``$CKPT_FAULT_POINT`` names this point (no-op otherwise).

    Args:
        name: The phase that was just reached, e.g. ``"save.chunks_written"``.
    """
    wanted = os.environ.get("CKPT_FAULT_POINT")
    if not wanted:
        return
    target, _, nth = wanted.partition(":")
    if target != name:
        return
    with _lock:
        _counts[name] = _counts.get(name, 0) + 1
        count = _counts[name]
    if count >= (decimal_or_none(nth) or 1):
        os.kill(os.getpid(), signal.SIGKILL)
