"""The sync flow (flows/sync.py) under a throwaway Prefect server: it pushes each run's best,
and a second run (what a schedule does) sends nothing."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

pytestmark = [pytest.mark.postgres, pytest.mark.s3, pytest.mark.prefect]


@pytest.fixture(scope="module")
def harness() -> Iterator[None]:
    """A temporary Prefect server for this module (as tests/flows/conftest.py sets one up)."""
    from prefect.settings import PREFECT_FLOWS_HEARTBEAT_FREQUENCY, temporary_settings
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=60), \
            temporary_settings({PREFECT_FLOWS_HEARTBEAT_FREQUENCY: None}):
        yield


def test_sync_flow_pushes_the_best_then_nothing(harness: None, stores: Any, kit: Any) -> None:
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
