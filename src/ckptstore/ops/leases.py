"""Catalog leases as operations take them: unique owners, and takeover from dead holders.

A lease is a flow's time-limited claim on one checkpoint for one purpose (``archive``,
``restore:hot``, ``prune``...), so two flows never move or delete the same thing
(:mod:`ckptstore.catalog.leases` stores them). A SIGKILLed flow never releases its lease;
:func:`acquire_lease` takes such a lease over at once when its holder is a dead process of
this host, instead of waiting for it to expire (up to an hour). :class:`RenewingLease` is the
lease of a long copy (archive, push): taken once, renewed while the copy makes progress.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from ckptstore.core import StoreCore
from ckptstore.errors import CkptError, LeaseHeldError
from ckptstore.identity import owner_is_dead, unique_owner

__all__ = ["RenewingLease", "acquire_lease", "lease_owner"]

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


class RenewingLease:
    """A catalog lease that renews itself while the work it guards makes progress.

    Call order: :meth:`acquire` once (False: someone else holds it, do not start), then
    :meth:`touch` as the work progresses (from any thread; it renews at most every third of
    the TTL), then :meth:`release` in a ``finally``. A renewal that finds the lease taken
    (it expired while the work stalled and another owner took it over) raises
    :class:`~ckptstore.errors.LeaseHeldError`: two owners must never work on one checkpoint.
    """

    def __init__(self, core: StoreCore, ckpt_id: str, purpose: str, owner: str,
                 ttl_s: float, *, clock: Callable[[], float] = time.monotonic) -> None:
        """Describe the lease; nothing is taken until :meth:`acquire`.

        Args:
            core: The open store whose catalog holds the lease.
            ckpt_id: The checkpoint.
            purpose: What the lease is for (``push``, ``archive:warm``...).
            owner: Who takes it (see :func:`lease_owner`).
            ttl_s: Seconds until it expires unless renewed.
            clock: Seconds, monotonic: when to renew is judged by it (tests step it).
        """
        self.ckpt_id, self.purpose, self.owner = ckpt_id, purpose, owner
        self._core, self._ttl, self._clock = core, ttl_s, clock
        self._renewed = clock()
        # Copies call touch() from their transfer threads: one renewal at a time.
        self._lock = threading.Lock()

    def acquire(self) -> bool:
        """Take (or renew) the lease; whether it is now ours."""
        with self._lock:
            self._renewed = self._clock()
            return acquire_lease(self._core, self.ckpt_id, self.purpose, self.owner,
                                 self._ttl)

    def touch(self) -> None:
        """Renew the lease when a third of its TTL has passed since the last renewal.

        Raises:
            LeaseHeldError: If another owner holds it now.
        """
        if self._clock() - self._renewed <= self._ttl / 3:
            return
        with self._lock:
            if self._clock() - self._renewed <= self._ttl / 3:
                return  # another thread renewed it meanwhile
            self._renewed = self._clock()
            if acquire_lease(self._core, self.ckpt_id, self.purpose, self.owner, self._ttl):
                return
        holder = self._core.catalog.lease_holder(self.ckpt_id, self.purpose)
        raise LeaseHeldError(
            f"lost the {self.purpose} lease on checkpoint {self.ckpt_id} to {holder} (it "
            "expired while the work stalled); stopping: rerun once that holder is done"
        )

    def release(self) -> None:
        """Give the lease back; a catalog failure only logs (expiry frees it anyway)."""
        try:
            self._core.catalog.release_lease(self.ckpt_id, self.purpose, self.owner)
        except CkptError:
            logger.warning("could not release lease %s on %s", self.purpose, self.ckpt_id,
                           exc_info=True)
