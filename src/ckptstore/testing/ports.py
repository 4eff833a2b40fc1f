"""Loopback TCP ports for the servers a test or benchmark starts and then names to others.

Binding port 0 picks a port from the kernel's ephemeral range, the range every outgoing
connection takes its local port from. The port is free only at the moment of the pick:
until the server binds it itself (seconds later for a Prefect server, which migrates its
database first, or for torchrun's rendezvous store), any connection on the machine may
take it, and the server then fails to start (uvicorn exits with status 3). Ports below the
ephemeral range are never handed to outgoing connections, so one picked there stays free
unless another process picks the same one on purpose.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

from ckptstore.errors import CkptError

__all__ = ["free_port"]

#: Where Linux keeps the ephemeral range ("low high").
_EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
#: Lowest port handed out; below are the well-known and registered services people run.
_LOWEST = 10_000
#: Start of the ephemeral range where it cannot be read (Linux's default; macOS and the
#: IANA range start higher).
_DEFAULT_EPHEMERAL_LOW = 32_768


def _ephemeral_low() -> int:
    try:
        return int(_EPHEMERAL_RANGE.read_text(encoding="ascii").split()[0])
    except (OSError, ValueError, IndexError):
        return _DEFAULT_EPHEMERAL_LOW


def free_port(host: str = "127.0.0.1", *, attempts: int = 200) -> int:
    """A TCP port on ``host`` that is free now and outside the ephemeral range.

    Args:
        host: The address the server will listen on.
        attempts: Random ports tried before giving up.

    Raises:
        CkptError: If no port in ``[10000, start of the ephemeral range)`` could be bound
            (the range is empty, or ``attempts`` picks were all taken).
    """
    high = _ephemeral_low()
    if high <= _LOWEST:
        raise CkptError(
            f"no ports below the ephemeral range to pick from (it starts at {high}, read "
            f"from {_EPHEMERAL_RANGE}); raise its lower end above {_LOWEST}"
        )
    rng = random.SystemRandom()
    for _ in range(attempts):
        port = rng.randrange(_LOWEST, high)
        with socket.socket() as sock:
            try:
                sock.bind((host, port))
            except OSError:
                continue
            return port
    raise CkptError(
        f"none of {attempts} random ports in [{_LOWEST}, {high}) on {host} could be bound; "
        "free some ports or widen the range below the ephemeral ports"
    )
