"""Parts of checkpoints saved across hosts: commit, per-part copies, the aggregate replica,
hosts and the catalogued manifest, on SQLite and PostgreSQL."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from ckptstore.catalog import Catalog
from ckptstore.errors import (
    CheckpointNotFoundError,
    ConflictError,
    IncompleteCheckpointError,
    InvalidNameError,
)
from ckptstore.records import CheckpointState, PartSpec, ReplicaState

PARTS = (PartSpec("node-a", (0, 1), 10, 1000), PartSpec("node-b", (2, 3), 12, 1200))


def _commit(catalog: Catalog, run: str = "r", step: int = 1) -> str:
    ck = catalog.begin_checkpoint(run, step, codec="lz4")
    catalog.commit_parted(ck.id, manifest=b'{"m":1}', manifest_digest="d" * 64,
                          logical_bytes=4000, stored_bytes=2200, parts=PARTS, uri="/hot/r/x")
    return ck.id


def test_commit_records_parts_manifest_hosts_and_one_event(catalog: Catalog) -> None:
    cid = _commit(catalog)
    ck = catalog.get_any(cid)
    assert ck.state == CheckpointState.COMMITTED
    assert ck.hosts == ("node-a", "node-b") and ck.parted
    hot = ck.replica("hot")
    assert hot is not None and hot.state == ReplicaState.PRESENT and hot.verified_at
    parts = catalog.parts(cid)
    assert [(p.tier, p.part, p.stored_on, p.state, p.files, p.bytes) for p in parts] == [
        ("hot", "node-a", "node-a", ReplicaState.PRESENT, 10, 1000),
        ("hot", "node-b", "node-b", ReplicaState.PRESENT, 12, 1200),
    ]
    assert catalog.manifest_bytes(cid) == ("d" * 64, b'{"m":1}')
    assert catalog.part_ranks(cid) == {"node-a": [0, 1], "node-b": [2, 3]}
    assert {h.name: h.role for h in catalog.hosts()} == {"node-a": "saver", "node-b": "saver"}
    saved = [e for e in catalog.events(cid) if e.kind == "saved"]
    assert len(saved) == 1 and saved[0].detail["hosts"] == ["node-a", "node-b"]
    # Listing carries the hosts too (one query for the rows, no per-checkpoint probe).
    assert catalog.list(run="r")[0].hosts == ("node-a", "node-b")


def test_warm_copy_is_complete_only_with_every_part(catalog: Catalog) -> None:
    cid = _commit(catalog)
    agg = catalog.set_part(cid, "warm", "node-a", stored_on=None, state=ReplicaState.COPYING,
                           uri="s3://b/w/r/x")
    assert agg is not None and agg.state == ReplicaState.COPYING
    agg = catalog.set_part(cid, "warm", "node-a", stored_on=None, state="PRESENT",
                           bytes=1000, files=10, verified=True)
    # One part in: still not a copy anyone may use, and it cannot be declared complete.
    assert agg is not None and agg.state == ReplicaState.COPYING
    with pytest.raises(IncompleteCheckpointError, match="node-b"):
        catalog.complete_parts(cid, "warm")
    assert catalog.get_any(cid).replica("warm").state == ReplicaState.COPYING  # type: ignore[union-attr]
    catalog.set_part(cid, "warm", "node-b", stored_on=None, state="PRESENT", bytes=1200,
                     files=12, verified=True)
    done = catalog.complete_parts(cid, "warm")
    assert done.state == ReplicaState.PRESENT and done.verified_at and done.bytes == 2200
    assert done.uri == "s3://b/w/r/x"
    warm = catalog.parts(cid, "warm")
    assert {p.part for p in warm} == {"node-a", "node-b"}
    assert all(p.stored_on is None for p in warm)


def test_the_first_part_names_the_copy_and_later_parts_read_it_back(catalog: Catalog) -> None:
    """How the hosts sealing their parts of one encrypted copy agree on its random prefix:
    a copy under way keeps the URI its first part gave; a new copy takes a new one."""
    cid = _commit(catalog)
    first = "/w/.sealed/" + "a" * 32
    agg = catalog.set_part(cid, "warm", "node-a", stored_on=None, state="COPYING", uri=first)
    assert agg is not None and agg.uri == first and agg.sealed == "a" * 32
    # node B proposed its own id at the same time: the row answers with node A's.
    agg = catalog.set_part(cid, "warm", "node-b", stored_on=None, state="COPYING",
                           uri="/w/.sealed/" + "b" * 32)
    assert agg is not None and agg.uri == first
    for part in ("node-a", "node-b"):
        catalog.set_part(cid, "warm", part, stored_on=None, state="DELETED")
    assert catalog.get_any(cid).replica("warm").state == ReplicaState.DELETED  # type: ignore[union-attr]
    agg = catalog.set_part(cid, "warm", "node-b", stored_on=None, state="COPYING",
                           uri="/w/.sealed/" + "c" * 32)
    assert agg is not None and agg.sealed == "c" * 32  # a new copy: a new prefix


def test_losing_a_part_damages_the_copy_and_a_peer_copy_keeps_it(catalog: Catalog) -> None:
    cid = _commit(catalog)
    # node-a keeps a copy of node-b's part (replicas = 2).
    catalog.set_part(cid, "hot", "node-b", stored_on="node-a", state="PRESENT", verified=True)
    agg = catalog.set_part(cid, "hot", "node-b", stored_on="node-b", state="DELETED")
    assert agg is not None and agg.state == ReplicaState.PRESENT
    agg = catalog.set_part(cid, "hot", "node-b", stored_on="node-a", state="DAMAGED")
    assert agg is not None and agg.state == ReplicaState.DAMAGED
    agg = catalog.set_part(cid, "hot", "node-b", stored_on="node-a", state="PRESENT")
    assert agg is not None and agg.state == ReplicaState.PRESENT
    on_a = catalog.parts_on("node-a", states=[ReplicaState.PRESENT])
    assert sorted(p.part for _, p in on_a) == ["node-a", "node-b"]


def test_deleting_copy_is_deleted_once_every_part_is_gone(catalog: Catalog) -> None:
    cid = _commit(catalog)
    catalog.set_replica(cid, "hot", state=ReplicaState.DELETING)
    agg = catalog.set_part(cid, "hot", "node-a", stored_on="node-a", state="DELETED")
    assert agg is not None and agg.state == ReplicaState.DELETING
    agg = catalog.set_part(cid, "hot", "node-b", stored_on="node-b", state="DELETED")
    assert agg is not None and agg.state == ReplicaState.DELETED
    assert catalog.forget_parts(cid, "hot") == 2
    assert catalog.parts(cid) == []


def test_refusals_say_what_is_wrong(catalog: Catalog) -> None:
    cid = _commit(catalog)
    with pytest.raises(InvalidNameError, match="no part of host 'node-c'"):
        catalog.set_part(cid, "warm", "node-c", stored_on=None, state="PRESENT")
    with pytest.raises(InvalidNameError, match="CKPT_HOST"):
        catalog.heartbeat("bad/host")
    with pytest.raises(ConflictError, match="already committed"):
        catalog.commit_parted(cid, manifest=b"x", manifest_digest="e" * 64, logical_bytes=1,
                              stored_bytes=1, parts=PARTS)
    plain = catalog.begin_checkpoint("r", 2)
    with pytest.raises(InvalidNameError, match="not a parted checkpoint"):
        catalog.set_part(plain.id, "hot", "node-a", stored_on="node-a", state="PRESENT")
    with pytest.raises(CheckpointNotFoundError, match="no manifest in the catalog"):
        catalog.manifest_bytes(plain.id)
    with pytest.raises(InvalidNameError, match="twice"):
        catalog.commit_parted(plain.id, manifest=b"x", manifest_digest="e" * 64,
                              logical_bytes=1, stored_bytes=1, parts=PARTS + PARTS[:1])
    assert catalog.get_any(plain.id).state == CheckpointState.PENDING  # nothing half-written


def test_heartbeats_keep_first_seen_and_move_last_seen(catalog: Catalog) -> None:
    then = datetime.now(UTC) - timedelta(hours=2)
    catalog.heartbeat("node-a", "agent", at=then)
    catalog.heartbeat("node-a", "agent")
    (info,) = catalog.hosts()
    assert info.name == "node-a" and info.role == "agent"
    assert abs((info.first_seen - then).total_seconds()) < 1
    assert info.last_seen - info.first_seen > timedelta(hours=1)
