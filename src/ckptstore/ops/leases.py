"""Catalog leases as operations take them: unique owners, and takeover from dead holders.

A lease is a flow's time-limited claim on one checkpoint for one purpose (``archive``,
``restore:hot``, ``prune``...), so two flows never move or delete the same thing
(:mod:`ckptstore.catalog.leases` stores them). A SIGKILLed flow never releases its lease;
:func:`acquire_lease` takes such a lease over at once when its holder is a dead process of
this host, instead of waiting for it to expire (up to an hour).
"""

from __future__ import annotations

import logging

from ckptstore.core import StoreCore
from ckptstore.identity import owner_is_dead, unique_owner

__all__ = ["acquire_lease", "lease_owner"]

logger = logging.getLogger(__name__)


def lease_owner(owner: str | None = None) -> str:
    """A lease owner unique to this call (host, pid and a random suffix) unless given."""
    return owner or unique_owner()


def acquire_lease(core: StoreCore, ckpt_id: str, purpose: str, owner: str,
                  ttl_s: float) -> bool:
    """Take a catalog lease; take it over at once when its holder is a dead local process.

    Args:
        core: The open store.
        ckpt_id: The checkpoint.
        purpose: What the lease is for.
        owner: Who takes it (see :func:`lease_owner`).
        ttl_s: Seconds until it expires unless renewed.

    Returns:
        Whether ``owner`` now holds the lease.
    """
    if core.catalog.acquire_lease(ckpt_id, purpose, owner, ttl_s):
        return True
    holder = core.catalog.lease_holder(ckpt_id, purpose)
    if holder is None or not owner_is_dead(holder):
        return False
    logger.info("lease %s on %s was held by %s, which is gone; taking it over",
                purpose, ckpt_id, holder)
    # Releasing as the dead holder, then one atomic acquire: racing takers get one winner.
    core.catalog.release_lease(ckpt_id, purpose, holder)
    return bool(core.catalog.acquire_lease(ckpt_id, purpose, owner, ttl_s))
