"""Runs and the checkpoint life cycle: begin, commit, fail, delete, gc queries, validation."""

from __future__ import annotations

import math
import uuid
from datetime import UTC, datetime, timedelta

import pytest
from sqlalchemy import update

from ckptstore.catalog import Catalog
from ckptstore.catalog.models import CheckpointRow
from ckptstore.errors import (
    CheckpointNotFoundError,
    ConflictError,
    IncompleteCheckpointError,
    InvalidNameError,
)
from ckptstore.records import CheckpointState, ReplicaState


def test_ensure_run_creates_then_fills_missing_fields(catalog: Catalog) -> None:
    run = catalog.ensure_run("r1", experiment="exp", config={"lr": 0.1, "layers": [1, 2]})
    assert run.name == "r1" and run.experiment == "exp" and run.status == "active"
    assert run.config == {"lr": 0.1, "layers": [1, 2]}
    assert run.code_version is None and run.created_at.tzinfo is not None

    again = catalog.ensure_run("r1", code_version="abc123", config={"lr": 99}, host="gpu1")
    assert again.code_version == "abc123" and again.host == "gpu1"
    assert again.config == {"lr": 0.1, "layers": [1, 2]}  # existing fields are never overwritten
    assert again.created_at == run.created_at
    assert [r.name for r in catalog.runs()] == ["r1"]


def test_get_run_and_runs(catalog: Catalog, save) -> None:
    save("b", 1)
    save("b", 2)
    catalog.begin_checkpoint("b", 3)  # PENDING is not counted
    catalog.ensure_run("a", data_version="d1")
    assert [(r.name, r.checkpoints) for r in catalog.runs()] == [("a", 0), ("b", 2)]
    assert catalog.get_run("a").data_version == "d1"
    with pytest.raises(CheckpointNotFoundError, match=r"run 'zz' does not exist; runs: a, b"):
        catalog.get_run("zz")


def test_run_config_must_be_json(catalog: Catalog) -> None:
    with pytest.raises(InvalidNameError, match="JSON"):
        catalog.ensure_run("r", config={"f": object()})
    with pytest.raises(InvalidNameError, match="JSON"):
        catalog.ensure_run("r", config={"x": math.nan})


def test_begin_commit_records_everything(catalog: Catalog) -> None:
    ck = catalog.begin_checkpoint(
        "r",
        42,
        metrics={"loss": 0.25, "val/acc": 1},
        tags=("nightly", "keep", "nightly"),
        codec="zstd-3",
        writer="host-x:123",
        uri="/hot/r/x",
    )
    assert ck.state == CheckpointState.PENDING and ck.version == 1 and ck.step == 42
    assert ck.metrics == {"loss": 0.25, "val/acc": 1.0}
    assert ck.tags == ("keep", "nightly")
    assert ck.writer == "host-x:123" and ck.codec == "zstd-3"
    assert ck.replicas[0].state == ReplicaState.COPYING and ck.replicas[0].uri == "/hot/r/x"
    assert ck.created_at.tzinfo is not None and ck.committed_at is None

    done = catalog.commit_checkpoint(
        ck.id, manifest_digest="blake3:ab", logical_bytes=1000, stored_bytes=600
    )
    assert done.state == CheckpointState.COMMITTED
    assert done.committed_at is not None and done.committed_at.tzinfo == UTC
    assert (done.logical_bytes, done.stored_bytes, done.manifest_digest) == (1000, 600, "blake3:ab")
    (hot,) = done.replicas
    assert (hot.tier, hot.state, hot.bytes, hot.uri) == (
        "hot",
        ReplicaState.PRESENT,
        600,
        "/hot/r/x",
    )
    assert hot.verified_at is not None
    assert [e.kind for e in catalog.events(done.id)] == ["saved"]


def test_default_writer_is_this_process(catalog: Catalog) -> None:
    import os
    import socket

    ck = catalog.begin_checkpoint("r", 1)
    assert ck.writer == f"{socket.gethostname()}:{os.getpid()}"


def test_commit_can_set_uri_and_replica_bytes(catalog: Catalog) -> None:
    ck = catalog.begin_checkpoint("r", 1, tier="hot")
    done = catalog.commit_checkpoint(
        ck.id, manifest_digest="d", logical_bytes=1, stored_bytes=2, replica_bytes=3, uri="/p"
    )
    assert (done.replicas[0].bytes, done.replicas[0].uri) == (3, "/p")


def test_versions_are_gap_free_per_run(catalog: Catalog, save) -> None:
    for step in (5, 5, 1, 7):
        save("a", step)
    catalog.begin_checkpoint("b", 1)
    failed = catalog.begin_checkpoint("a", 8)
    catalog.fail_checkpoint(failed.id, "oom")
    nxt = catalog.begin_checkpoint("a", 9)
    assert nxt.version == 6  # a FAILED row keeps its version; nothing is reused
    versions = [c.version for c in catalog.list(run="a", state=None, order_by="version")]
    assert versions == [1, 2, 3, 4, 5, 6]
    assert catalog.list(run="b", state="PENDING")[0].version == 1  # per-run numbering


def test_commit_twice_or_after_failure_conflicts(catalog: Catalog) -> None:
    ck = catalog.begin_checkpoint("r", 1)
    catalog.commit_checkpoint(ck.id, manifest_digest="d", logical_bytes=1, stored_bytes=1)
    with pytest.raises(ConflictError, match="already committed"):
        catalog.commit_checkpoint(ck.id, manifest_digest="d", logical_bytes=1, stored_bytes=1)
    with pytest.raises(ConflictError):
        catalog.fail_checkpoint(ck.id, "too late")

    other = catalog.begin_checkpoint("r", 2)
    catalog.fail_checkpoint(other.id, "writer died")
    catalog.fail_checkpoint(other.id, "again")  # idempotent
    with pytest.raises(ConflictError, match="FAILED"):
        catalog.commit_checkpoint(other.id, manifest_digest="d", logical_bytes=1, stored_bytes=1)
    failures = [e for e in catalog.events(other.id) if e.kind == "save_failed"]
    assert len(failures) == 1 and failures[0].detail == {"reason": "writer died"}


def test_unknown_ids(catalog: Catalog) -> None:
    missing = str(uuid.uuid4())
    for call in (
        lambda: catalog.commit_checkpoint(
            missing, manifest_digest="d", logical_bytes=1, stored_bytes=1
        ),
        lambda: catalog.fail_checkpoint(missing, "x"),
        lambda: catalog.get_any(missing),
        lambda: catalog.mark_deleting(missing),
        lambda: catalog.mark_deleted(missing),
    ):
        with pytest.raises(CheckpointNotFoundError):
            call()


def test_explicit_ids_parent_and_base(catalog: Catalog, save) -> None:
    base = save("r", 1)
    wanted = str(uuid.uuid4())
    delta = catalog.begin_checkpoint(
        "r",
        2,
        ckpt_id=wanted.upper(),
        kind="delta",
        base_id=base.id,
        parent_id=base.id,
        lossy=True,
        error_bound=0.01,
    )
    assert delta.id == wanted and delta.base_id == base.id and delta.parent_id == base.id
    assert delta.kind == "delta" and delta.lossy and delta.error_bound == 0.01
    with pytest.raises(ConflictError, match="already taken"):
        catalog.begin_checkpoint("r", 3, ckpt_id=wanted)
    with pytest.raises(IncompleteCheckpointError):
        catalog.begin_checkpoint("r", 3, kind="delta", base_id=delta.id)  # base still PENDING
    with pytest.raises(CheckpointNotFoundError):
        catalog.begin_checkpoint("r", 3, parent_id=str(uuid.uuid4()))
    with pytest.raises(InvalidNameError, match="base_id"):
        catalog.begin_checkpoint("r", 3, kind="delta")


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"run": "bad/name"}, "not allowed"),
        ({"run": "../up"}, r"\.\."),
        ({"step": -1}, "non-negative"),
        ({"step": True}, "non-negative"),
        ({"step": 1.5}, "non-negative"),
        ({"metrics": {"loss": math.nan}}, "finite"),
        ({"metrics": {"loss": math.inf}}, "finite"),
        ({"metrics": {"loss": "0.5"}}, "number"),
        ({"metrics": {"loss": True}}, "number"),
        ({"metrics": {"bad name": 1.0}}, "metric name"),
        ({"tags": ["ok", "not ok"]}, "tag"),
        ({"kind": "weird"}, "kind"),
        ({"ckpt_id": "not-a-uuid"}, "uuid"),
        ({"tier": "h/t"}, "tier"),
        ({"error_bound": -1.0}, "error_bound"),
    ],
)
def test_begin_validates_input(catalog: Catalog, kwargs: dict[str, object], match: str) -> None:
    args = {"run": "r", "step": 1, **kwargs}
    with pytest.raises(InvalidNameError, match=match):
        catalog.begin_checkpoint(args.pop("run"), args.pop("step"), **args)  # type: ignore[arg-type]
    assert catalog.list(state=None) == []


def test_metrics_accept_numeric_scalars(catalog: Catalog) -> None:
    class Scalar:  # what a 0-d tensor or numpy scalar offers
        def __float__(self) -> float:
            return 0.5

    ck = catalog.begin_checkpoint("r", 1, metrics={"loss": Scalar(), "n": 3})  # type: ignore[dict-item]
    assert ck.metrics == {"loss": 0.5, "n": 3.0}


def test_delete_life_cycle(catalog: Catalog, save) -> None:
    ck = save("r", 1)
    deleting = catalog.mark_deleting(ck.id)
    assert deleting.state == CheckpointState.DELETING
    assert catalog.mark_deleting(ck.id).state == CheckpointState.DELETING  # idempotent
    assert catalog.list(run="r") == []
    done = catalog.mark_deleted(ck.id)
    assert done.state == CheckpointState.DELETED
    assert all(r.state == ReplicaState.DELETED for r in done.replicas)
    assert catalog.mark_deleted(ck.id).state == CheckpointState.DELETED  # idempotent
    # History stays: the row, its metrics, its events.
    assert catalog.get_any(ck.id).metrics == ck.metrics
    assert [e.kind for e in catalog.events(ck.id)] == ["deleted", "saved"]
    assert [c.id for c in catalog.list(run="r", state="DELETED")] == [ck.id]


def test_delete_guards(catalog: Catalog, save) -> None:
    pending = catalog.begin_checkpoint("r", 1)
    with pytest.raises(ConflictError, match="PENDING"):
        catalog.mark_deleting(pending.id)
    committed = save("r", 2)
    with pytest.raises(ConflictError, match="not DELETING"):
        catalog.mark_deleted(committed.id)
    catalog.pin(committed.id)
    with pytest.raises(ConflictError, match="pinned"):
        catalog.mark_deleting(committed.id)
    catalog.unpin(committed.id)
    catalog.alias(committed.id, "prod")
    with pytest.raises(ConflictError, match="aliased as prod"):
        catalog.mark_deleting(committed.id)
    catalog.unalias("prod")

    base = save("r", 3)
    save("r", 4, kind="delta", base_id=base.id)
    with pytest.raises(ConflictError, match="base of delta"):
        catalog.mark_deleting(base.id)

    catalog.fail_checkpoint(pending.id, "died")
    assert catalog.mark_deleting(pending.id).state == CheckpointState.DELETING  # FAILED is ok
    assert catalog.mark_deleting(committed.id).state == CheckpointState.DELETING


def test_stale_pending_and_pending_by_writer(catalog: Catalog, save) -> None:
    save("r", 1)
    old = catalog.begin_checkpoint("r", 2, writer="node-1:100")
    mine = catalog.begin_checkpoint("r", 3, writer="node-2:200")
    young = catalog.begin_checkpoint("r", 4, writer="node-1:101")
    # Backdate instead of sleeping: the test must not depend on how loaded the machine is.
    now = datetime.now(UTC)
    with catalog.engine.begin() as conn:
        for cid, hours in ((old.id, 2), (mine.id, 1)):
            conn.execute(
                update(CheckpointRow)
                .where(CheckpointRow.id == cid)
                .values(created_at=now - timedelta(hours=hours))
            )
    assert [c.id for c in catalog.stale_pending(older_than_s=600)] == [old.id, mine.id]
    assert [c.id for c in catalog.stale_pending(older_than_s=5400)] == [old.id]
    assert [c.id for c in catalog.pending_by_writer("node-1")] == [old.id, young.id]
    assert catalog.pending_by_writer("node") == []  # a host prefix is not a host
    with pytest.raises(InvalidNameError):
        catalog.stale_pending(older_than_s=0)
