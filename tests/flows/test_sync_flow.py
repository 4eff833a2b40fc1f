"""The sync flow (flows/sync.py) under the session's Prefect harness: it pushes each run's
best, and a second run (what a schedule does) sends nothing."""

from __future__ import annotations

from typing import Any

import pytest
from remote_support import kit, pg_url, s3_a, s3_b, stores  # noqa: F401 - fixtures

pytestmark = [pytest.mark.postgres, pytest.mark.s3, pytest.mark.prefect]


def test_sync_flow_pushes_the_best_then_nothing(stores: Any, kit: Any) -> None:  # noqa: F811
    from ckptstore.errors import RemoteError
    from ckptstore.flows.sync import sync_flow

    a, b = stores.a, stores.b
    s = kit.state(40)
    a.save("fl", 1, s, metrics={"loss": 2.0}, delta=False)
    best = a.save("fl", 2, kit.tweaked(s), metrics={"loss": 1.0}, delta=False)
    a.save("fl", 3, kit.tweaked(s, 3.0), metrics={"loss": 3.0}, delta=False)
    first = sync_flow(config=str(stores.a_config), runs=["fl"], best="loss")
    assert first["pushed"] == [best.id] and first["failed"] == []
    assert kit.same(b.load(best.id), kit.tweaked(s))
    again = sync_flow(config=str(stores.a_config), remote="b", runs=["fl"], best="loss")
    assert again["pushed"] == [] and again["bytes_sent"] == 0
    with pytest.raises(RemoteError):
        sync_flow(config=str(stores.a_config), remote="nope")
