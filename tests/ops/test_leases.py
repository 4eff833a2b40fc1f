"""The renewing lease of long copies (src/ckptstore/ops/leases.py), shared by archive and push."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from ckptstore.errors import LeaseHeldError
from ckptstore.ops.leases import RenewingLease


def test_a_renewing_lease_renews_once_per_third_and_stops_when_lost(store: Any) -> None:
    ck = store.save("lease", 1, {"x": 1})
    now = [0.0]  # the lease's clock, stepped by the test
    lease = RenewingLease(store, ck.id, "archive:warm", "me:1", ttl_s=30.0,
                          clock=lambda: now[0])
    assert lease.acquire()
    assert not RenewingLease(store, ck.id, "archive:warm", "other:2", 60.0).acquire()

    def expiry() -> Any:
        return store.catalog.leases(checkpoint_ids=[ck.id])[0].expires_at

    first = expiry()
    now[0] = 9.0
    lease.touch()  # within a third of the TTL: nothing renewed
    assert expiry() == first
    now[0] = 11.0
    # Transfer threads touch it at once: renewed, no error.
    threads = [threading.Thread(target=lease.touch) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert expiry() > first
    # It expires while the work stalls and another owner takes it: the next touch stops.
    short = RenewingLease(store, ck.id, "push", "me:1", ttl_s=0.2, clock=lambda: now[0])
    assert short.acquire()
    time.sleep(0.4)  # the catalog's expiry is wall-clock time
    assert RenewingLease(store, ck.id, "push", "other:2", 60.0).acquire()
    now[0] = 100.0
    with pytest.raises(LeaseHeldError, match="other:2"):
        short.touch()
    short.release()  # not ours any more: releasing it does nothing
    assert store.catalog.lease_holder(ck.id, "push") == "other:2"
    lease.release()
    assert store.catalog.lease_holder(ck.id, "archive:warm") is None
