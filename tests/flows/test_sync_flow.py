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


def test_a_scheduled_sync_pushes_what_the_config_selects(stores: Any, kit: Any) -> None:  # noqa: F811
    """Started without parameters (as a schedule starts it), the flow pushes what the
    config's ``[sync]`` table selects: the best of the named runs only."""
    from ckptstore.flows.sync import sync_flow

    a, b = stores.a, stores.b
    s = kit.state(40)
    a.save("chosen", 1, s, metrics={"loss": 2.0}, delta=False)
    best = a.save("chosen", 2, kit.tweaked(s), metrics={"loss": 1.0}, delta=False)
    other = a.save("other", 1, kit.tweaked(s, 5.0), metrics={"loss": 0.5}, delta=False)
    scheduled = stores.a_config.with_name("a-scheduled.toml")
    scheduled.write_text(stores.a_config.read_text(encoding="utf-8")
                         + '\n[sync]\nruns = ["chosen"]\nbest = "loss"\nmode = "min"\n',
                         encoding="utf-8")
    report = sync_flow(config=str(scheduled))
    assert report["pushed"] == [best.id] and report["failed"] == []
    assert [ck.id for ck in b.list(run="chosen")] == [best.id]
    assert b.list(run="other") == [] and other.id not in report["pushed"]
    # An argument given wins over the table.
    again = sync_flow(config=str(scheduled), runs=["other"])
    assert again["pushed"] == [other.id]


def test_the_sync_flow_keeps_working_across_prunes_on_either_side(
        stores: Any, kit: Any) -> None:  # noqa: F811
    """A scheduled sync, a prune at the remote, and the next scheduled syncs: they send what
    is new, leave what the remote pruned pruned, and fail nothing (a prune at the source is
    tests/ops/sharing/test_hostile_remote.py's)."""
    from ckptstore.flows.sync import sync_flow
    from ckptstore.ops.tiering.retention import apply_retention
    from ckptstore.records import CheckpointState
    from ckptstore.retention import RetentionPolicy

    a, b = stores.a, stores.b
    s = kit.state(41)
    one = a.save("pr", 1, s, metrics={"loss": 3.0}, delta=False)
    two = a.save("pr", 2, kit.tweaked(s), metrics={"loss": 2.0}, delta=False)
    first = sync_flow(config=str(stores.a_config), runs=["pr"])
    assert first["pushed"] == [one.id, two.id] and first["failed"] == []
    # The remote prunes the older one; this store saves more.
    apply_retention(b, run="pr", tier="warm", policy=RetentionPolicy(keep_last=1))
    assert b.catalog.get_any(one.id).state == CheckpointState.DELETED
    three = a.save("pr", 3, kit.tweaked(s, 2.0), metrics={"loss": 1.0}, delta=False)
    four = a.save("pr", 4, kit.tweaked(s, 3.0), metrics={"loss": 0.5}, delta=False)
    second = sync_flow(config=str(stores.a_config), runs=["pr"])
    assert second["failed"] == [] and second["pushed"] == [three.id, four.id]
    assert second["reports"][0]["pruned_there"] == [one.id]
    assert kit.same(b.load(four.id), kit.tweaked(s, 3.0))
    assert b.catalog.get_any(one.id).state == CheckpointState.DELETED  # left pruned
    third = sync_flow(config=str(stores.a_config), runs=["pr"])
    assert third["failed"] == [] and third["pushed"] == [] and third["bytes_sent"] == 0

