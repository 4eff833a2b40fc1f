"""SlowDown backoff per key prefix: a throttled prefix pauses, the others go on.

S3 throttles per prefix; saves across many hosts spread their objects over one prefix per
rank, so a SlowDown on one must not slow the writes of every rank.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from ckptstore.storage.s3 import PrefixThrottle, S3Tier
from ckptstore.testing.fault_injection import FaultyProxy
from ckptstore.testing.s3 import MotoS3

pytestmark = pytest.mark.s3


def test_a_slowed_prefix_pauses_and_recovers_while_others_do_not_wait(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import ckptstore.storage.s3 as s3_module

    # The pauses asked for are recorded, not slept, on a clock that stands still: real time
    # would measure the machine's load, not the throttle.
    pauses: list[float] = []
    monkeypatch.setattr(s3_module.time, "sleep", pauses.append)
    monkeypatch.setattr(s3_module.time, "monotonic", lambda: 1000.0)
    throttle = PrefixThrottle()
    assert throttle.prefix("run/id/dcp_ranks/r3/w/c.0.1") == "run/id/dcp_ranks/r3/w"
    first = throttle.slowed("a")
    assert throttle.slowed("a") == 2 * first  # doubles while SlowDowns keep coming
    throttle.wait("b")
    assert pauses == []  # another prefix is not slowed
    throttle.wait("a")
    assert len(pauses) == 1 and first <= pauses[0] <= 2 * first  # jitter: half to all of it
    throttle.ok("a")
    throttle.ok("a")
    throttle.wait("a")
    assert len(pauses) == 1  # recovered
    assert throttle.slowdowns == {"a": 2}


def test_uploads_through_a_throttling_endpoint_all_land(moto_s3: MotoS3) -> None:
    keys = [f"r/ck/dcp_ranks/r{r}/w/c.{i}" for r in range(2) for i in range(16)]
    with FaultyProxy(moto_s3.endpoint_url, seed=3, slowdown=0.4) as proxy:
        options = {**moto_s3.storage_options, "endpoint_url": proxy.endpoint_url}
        tier = S3Tier(moto_s3.url("throttle"), options, name="warm")
        # s3fs retries SlowDown on its own first; one try each makes every SlowDown reach
        # the prefix throttle, which must absorb them.
        tier.fs.retries = 1
        with ThreadPoolExecutor(4) as pool:
            list(pool.map(lambda k: tier.put_bytes(k, k.encode()), keys))
        proxy.set_rates()
        assert tier.list_prefix("r/ck/") == sorted(keys)
        assert all(tier.get_bytes(k) == k.encode() for k in keys)
        assert proxy.counts["slowdown"] > 3
        assert sum(tier.throttle.slowdowns.values()) > 0
        assert set(tier.throttle.slowdowns) <= {"r/ck/dcp_ranks/r0/w", "r/ck/dcp_ranks/r1/w"}
        tier.close()
