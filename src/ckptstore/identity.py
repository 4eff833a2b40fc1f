"""Who is working: this process's host and ``host:pid`` tag, and whether a tagged one is dead.

Every process knows its host: ``$CKPT_HOST`` when set (one simulated node per value on a
single machine, or a stable name where hostnames change), else the hostname. Catalog rows,
leases, memory-tier URIs and staging directories record ``host:pid`` tags made here.

gc, doctor, lease takeover and the memory tier decide "is that writer dead?" the same way,
through :func:`owner_is_dead`: only for processes on this host (a pid means nothing
elsewhere), and a pid we may not signal still counts as alive.
"""

from __future__ import annotations

import os
import re
import socket
import uuid

from ckptstore.numeric import decimal_or_none

__all__ = ["HOST_ENV", "host", "owner_is_dead", "pid_alive", "unique_owner", "writer_id"]

#: Environment variable naming this process's host.
HOST_ENV = "CKPT_HOST"


def host() -> str:
    """This process's host name: ``$CKPT_HOST``, else the machine's hostname."""
    return os.environ.get(HOST_ENV) or socket.gethostname()


def writer_id() -> str:
    """``host:pid`` of this process."""
    return f"{host()}:{os.getpid()}"


def unique_owner(prefix: str = "") -> str:
    """An owner tag unique to one call: ``[prefix:]host:pid:<random>`` (for leases)."""
    tag = f"{writer_id()}:{uuid.uuid4().hex[:8]}"
    return f"{prefix}:{tag}" if prefix else tag


def pid_alive(pid: int) -> bool:
    """Whether a process with this pid exists on this host."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def owner_is_dead(owner: str | None, *, on_host: str | None = None) -> bool:
    """Whether ``owner`` names a process of this host that no longer exists.

    Args:
        owner: A tag as recorded on rows and leases: ``host:pid``, ``host:pid:tag`` or
            ``prefix:host:pid:tag``.
        on_host: The host to judge for (default: :func:`host`). Owners on other hosts are
            never judged dead: their leases expire, their rows age out.

    Returns:
        True only when the tag names a pid on ``on_host`` and that process is gone.
    """
    if not owner:
        return False
    here = on_host or host()
    # [0-9], not \d: \d and int() also take non-ASCII digits, and a full-width digit is no pid.
    match = re.search(rf"(?:^|:){re.escape(here)}:([0-9]+)(?::|\Z)", owner)
    pid = decimal_or_none(match.group(1)) if match is not None else None
    return pid is not None and pid > 0 and not pid_alive(pid)
