"""Who is writing: the ``host:pid`` tag recorded on rows and leases, and a liveness check.

gc, doctor, lease takeover and the memory tier all decide "is that writer dead?" the same way:
only for processes on this host (a pid means nothing elsewhere), and a pid we may not signal
still counts as alive.
"""

from __future__ import annotations

import os
import socket

__all__ = ["pid_alive", "writer_id"]


def writer_id() -> str:
    """``host:pid`` of this process."""
    return f"{socket.gethostname()}:{os.getpid()}"


def pid_alive(pid: int) -> bool:
    """Whether a process with this pid exists on this host."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True
