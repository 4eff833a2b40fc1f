"""Aliases, pins, replicas, leases and the audit log."""

from __future__ import annotations

import time
import uuid
from datetime import UTC, datetime

import pytest

from ckptstore.catalog import Catalog
from ckptstore.errors import CheckpointNotFoundError, InvalidNameError
from ckptstore.records import Lease, ReplicaState


def test_alias_moves_and_resolves(catalog: Catalog, save) -> None:
    a = save("r", 1)
    b = save("r", 2)
    assert catalog.alias("r@1", "prod").aliases == ("prod",)
    assert catalog.get("prod").id == a.id
    catalog.alias(b.id, "prod")  # moves
    assert catalog.get("prod").id == b.id
    assert catalog.get(a.id).aliases == ()
    assert catalog.get(b.id).aliases == ("prod",)
    catalog.unalias("prod")
    with pytest.raises(CheckpointNotFoundError, match="no alias 'prod'"):
        catalog.get("prod")
    with pytest.raises(CheckpointNotFoundError, match="no alias 'prod'"):
        catalog.unalias("prod")


def test_alias_names_are_validated(catalog: Catalog, save) -> None:
    ck = save("r", 1)
    for bad in ("has space", "a/b", "x@y", "", str(uuid.uuid4())):
        with pytest.raises(InvalidNameError):
            catalog.alias(ck.id, bad)


def test_alias_needs_a_committed_target(catalog: Catalog) -> None:
    pending = catalog.begin_checkpoint("r", 1)
    with pytest.raises(Exception, match="never committed"):
        catalog.alias(pending.id, "prod")


def test_pins_and_protection(catalog: Catalog, save) -> None:
    a = save("r", 1)
    b = save("r", 2)
    assert not catalog.is_protected(a.id)
    assert catalog.pin("r@v1").pinned
    assert catalog.pin(a.id).pinned  # idempotent
    assert catalog.is_protected(a.id)
    assert not catalog.unpin(a.id).pinned
    assert not catalog.is_protected(a.id)
    catalog.alias(b.id, "keep")
    assert catalog.is_protected(b.id)
    with pytest.raises(CheckpointNotFoundError):
        catalog.is_protected(str(uuid.uuid4()))


def test_replica_upsert(catalog: Catalog, save) -> None:
    ck = save("r", 1, stored_bytes=10)
    rep = catalog.set_replica(ck.id, "warm", uri="s3://b/r/1", state="COPYING")
    assert (rep.tier, rep.uri, rep.state, rep.bytes, rep.verified_at) == (
        "warm",
        "s3://b/r/1",
        ReplicaState.COPYING,
        0,
        None,
    )
    rep = catalog.set_replica(ck.id, "warm", state=ReplicaState.PRESENT, bytes=12, verified=True)
    assert rep.uri == "s3://b/r/1"  # kept: not passed
    assert (rep.state, rep.bytes) == (ReplicaState.PRESENT, 12) and rep.verified_at is not None
    verified_at = rep.verified_at
    rep = catalog.set_replica(ck.id, "warm", state="DAMAGED")
    assert rep.verified_at == verified_at and rep.bytes == 12  # kept
    assert [r.tier for r in catalog.replicas(ck.id)] == ["hot", "warm"]
    assert catalog.replicas(ck.id)[1].state == ReplicaState.DAMAGED
    with pytest.raises(InvalidNameError, match="replica state"):
        catalog.set_replica(ck.id, "warm", state="GONE")
    with pytest.raises(InvalidNameError):
        catalog.set_replica(ck.id, "warm", state="PRESENT", bytes=-1)
    with pytest.raises(CheckpointNotFoundError):
        catalog.set_replica(str(uuid.uuid4()), "warm", state="PRESENT")


def test_leases_two_owners_expiry_takeover(catalog: Catalog, save) -> None:
    ck = save("r", 1)
    assert catalog.lease_holder(ck.id, "archive") is None
    assert catalog.acquire_lease(ck.id, "archive", "flow-A", ttl_s=0.5)
    assert catalog.lease_holder(ck.id, "archive") == "flow-A"
    assert not catalog.acquire_lease(ck.id, "archive", "flow-B", ttl_s=60)  # held
    assert catalog.acquire_lease(ck.id, "prune", "flow-B", ttl_s=60)  # other purpose
    assert catalog.acquire_lease(ck.id, "archive", "flow-A", ttl_s=0.5)  # renew own
    assert not catalog.release_lease(ck.id, "archive", "flow-B")  # not B's to release
    assert catalog.lease_holder(ck.id, "archive") == "flow-A"

    time.sleep(0.6)
    assert catalog.lease_holder(ck.id, "archive") is None  # expired
    assert catalog.acquire_lease(ck.id, "archive", "flow-B", ttl_s=60)  # takeover
    assert catalog.lease_holder(ck.id, "archive") == "flow-B"
    assert not catalog.release_lease(ck.id, "archive", "flow-A")  # A lost it
    assert catalog.release_lease(ck.id, "archive", "flow-B")
    assert catalog.lease_holder(ck.id, "archive") is None
    assert catalog.acquire_lease(ck.id, "archive", "flow-A", ttl_s=60)


def test_lease_arguments(catalog: Catalog, save) -> None:
    ck = save("r", 1)
    with pytest.raises(CheckpointNotFoundError):
        catalog.acquire_lease(str(uuid.uuid4()), "archive", "me", 10)
    with pytest.raises(InvalidNameError):
        catalog.acquire_lease(ck.id, "archive", "me", 0)
    with pytest.raises(InvalidNameError):
        catalog.acquire_lease(ck.id, "", "me", 10)


def test_leases_listing(catalog: Catalog, save) -> None:
    a, b, c = save("r", 1), save("r", 2), save("r", 3)
    assert catalog.leases() == []
    assert catalog.acquire_lease(a.id, "archive:warm", "flow-A", 60)
    assert catalog.acquire_lease(a.id, "retention", "flow-B", 60)
    assert catalog.acquire_lease(b.id, "retention", "flow-B", 60)
    assert catalog.acquire_lease(c.id, "restore:hot", "flow-C", 0.3)
    every = catalog.leases()
    assert all(isinstance(lease, Lease) for lease in every)
    by_key = {(lease.checkpoint_id, lease.purpose): lease.owner for lease in every}
    assert by_key == {
        (a.id, "archive:warm"): "flow-A",
        (a.id, "retention"): "flow-B",
        (b.id, "retention"): "flow-B",
        (c.id, "restore:hot"): "flow-C",
    }
    assert [(x.checkpoint_id, x.purpose) for x in every] == sorted(by_key)
    assert all(x.expires_at > datetime.now(UTC) for x in every)
    on_a = catalog.leases(checkpoint_ids=[a.id])
    assert [(x.purpose, x.owner) for x in on_a] == [
        ("archive:warm", "flow-A"), ("retention", "flow-B")
    ]
    retention = catalog.leases(purpose="retention")
    assert sorted(x.checkpoint_id for x in retention) == sorted([a.id, b.id])
    assert [x.owner for x in catalog.leases(checkpoint_ids={b.id, c.id}, purpose="retention")] \
        == ["flow-B"]
    assert catalog.leases(checkpoint_ids=[]) == []
    assert catalog.leases(checkpoint_ids=[str(uuid.uuid4())]) == []

    time.sleep(0.4)
    assert catalog.leases(checkpoint_ids=[c.id]) == []  # expired: not held any more
    (stale,) = catalog.leases(checkpoint_ids=[c.id], include_expired=True)
    assert (stale.purpose, stale.owner) == ("restore:hot", "flow-C")
    assert stale.expires_at <= datetime.now(UTC)
    assert catalog.release_lease(a.id, "retention", "flow-B")
    assert [x.purpose for x in catalog.leases(checkpoint_ids=[a.id])] == ["archive:warm"]


def test_leases_listing_arguments(catalog: Catalog, save) -> None:
    ck = save("r", 1)
    with pytest.raises(InvalidNameError, match="not a uuid"):
        catalog.leases(checkpoint_ids=["r@latest"])
    with pytest.raises(InvalidNameError, match="single string"):
        catalog.leases(checkpoint_ids=ck.id)
    with pytest.raises(InvalidNameError, match="lease purpose"):
        catalog.leases(purpose="")


def test_events(catalog: Catalog, save) -> None:
    ck = save("r", 1)
    catalog.ensure_run("other")
    archived = catalog.record_event(
        "archived", checkpoint_id=ck.id, actor="flow:archive", detail={"tier": "warm"}
    )
    assert archived.run == "r" and archived.actor == "flow:archive"
    run_event = catalog.record_event("retention", run="other", detail={"kept": 3})
    assert "@" in (run_event.actor or "")  # user@host by default
    catalog.record_event("gc")

    newest_first = catalog.events()
    assert [e.kind for e in newest_first] == ["gc", "retention", "archived", "saved"]
    assert [e.kind for e in catalog.events(ck.id)] == ["archived", "saved"]
    assert [e.kind for e in catalog.events("r@latest")] == ["archived", "saved"]
    assert [e.kind for e in catalog.events(run="other")] == ["retention"]
    assert [e.kind for e in catalog.events(limit=1)] == ["gc"]
    (ev,) = catalog.events(ck.id, limit=1)
    assert ev.detail == {"tier": "warm"} and ev.checkpoint_id == ck.id and ev.run == "r"
    assert ev.at.tzinfo is not None


def test_event_arguments(catalog: Catalog, save) -> None:
    ck = save("r", 1)
    with pytest.raises(InvalidNameError):
        catalog.record_event("")
    with pytest.raises(InvalidNameError, match="JSON"):
        catalog.record_event("x", detail={"o": object()})
    with pytest.raises(CheckpointNotFoundError):
        catalog.record_event("x", run="ghost")
    with pytest.raises(CheckpointNotFoundError):
        catalog.record_event("x", checkpoint_id=str(uuid.uuid4()))
    with pytest.raises(InvalidNameError, match="belongs to run"):
        catalog.record_event("x", checkpoint_id=ck.id, run="other")
    with pytest.raises(InvalidNameError):
        catalog.events(limit=0)


def test_racing_lease_takers_get_one_winner(catalog: Catalog, save) -> None:
    from concurrent.futures import ThreadPoolExecutor

    ck = save("r", 1)
    with ThreadPoolExecutor(max_workers=8) as pool:
        won = list(
            pool.map(lambda i: catalog.acquire_lease(ck.id, "prune", f"flow-{i}", 60), range(8))
        )
    assert won.count(True) == 1
    assert catalog.lease_holder(ck.id, "prune") == f"flow-{won.index(True)}"
