"""doctor: every kind of catalog/storage disagreement is found, and ``fix`` repairs only
what is safe (it never deletes data the catalog counts on)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import ckpt_reliability_checks as checks
import pytest

from ckptstore.identity import owner_is_dead
from ckptstore.ops.tiering.archive import archive_checkpoints
from ckptstore.ops.tiering.replicas import tier_of
from ckptstore.ops.upkeep.doctor import doctor
from ckptstore.ops.upkeep.verify import verify_replicas
from ckptstore.records import CheckpointState, ReplicaState
from ckptstore.store import CheckpointStore
from ckptstore.testing.fault_injection import flip_bit

NBYTES = 256 * 1024


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait(timeout=60)
    return proc.pid


@pytest.fixture
def store(new_root: Any, tmp_path: Path) -> Any:
    with CheckpointStore.open(new_root(), warm=str(tmp_path / "warm"),
                              chunk_bytes=64 * 1024) as opened:
        yield opened


def _kinds(report: Any) -> list[str]:
    return sorted(f.kind for f in report.findings)


def test_clean_store_has_no_findings(store: Any, w: Any) -> None:
    for i in range(2):
        store.save("r", i, w.make_state(i, NBYTES))
    archive_checkpoints(store, tier="warm", threads=2)
    report = doctor(store, deep=True, grace_s=0)
    assert report.findings == [], report.render()
    assert report.ok and report.checked["replicas"] == 4
    assert "agree" in report.render()


def test_row_without_data_is_marked_and_then_repaired(store: Any, w: Any) -> None:
    ck = store.save("r", 1, w.make_state(1, NBYTES))
    archive_checkpoints(store, tier="warm", threads=2)
    import shutil

    shutil.rmtree(store.checkpoint_dir("r", ck.id))
    report = doctor(store, grace_s=0)
    assert _kinds(report) == ["missing-replica"]
    assert not report.ok and "verify --repair" in report.render()
    fixed = doctor(store, fix=True, grace_s=0)
    assert fixed.ok
    assert store.catalog.get(ck.id).replica("hot").state == ReplicaState.DAMAGED
    # The verify flow repairs DAMAGED copies from a good one.
    assert verify_replicas(store, ref=ck.id).clean
    checks.assert_loads_bit_exact(store, {ck.id: (1, NBYTES)})
    assert doctor(store, deep=True, grace_s=0).findings == []


def test_damaged_copy_is_found_deep_only(store: Any, w: Any) -> None:
    ck = store.save("r", 1, w.make_state(1, NBYTES))
    chunk = store.checkpoint_dir("r", ck.id) / "float32" / "c" / "0"
    flip_bit(chunk, offset=100)
    assert doctor(store, grace_s=0).findings == []  # sizes are fine: shallow cannot tell
    report = doctor(store, deep=True, fix=True, grace_s=0)
    assert _kinds(report) == ["damaged-replica"]
    assert "float32/c/0" in report.findings[0].detail
    assert store.catalog.get(ck.id).replica("hot").state == ReplicaState.DAMAGED
    assert chunk.exists()  # marked, never deleted: it may be the only copy


def test_data_without_rows(store: Any, w: Any) -> None:
    keep = store.save("r", 1, w.make_state(1, NBYTES))
    unfinished = store.hot / "r" / str(uuid.uuid4())
    (unfinished / "float32" / "c").mkdir(parents=True)
    (unfinished / "float32" / "c" / "0").write_bytes(b"x" * 100)
    foreign = store.hot / "r" / str(uuid.uuid4())
    foreign.mkdir()
    (foreign / "COMMITTED").write_text("0" * 64)
    warm = tier_of(store, "warm")
    stray = str(uuid.uuid4())
    warm.put_bytes(warm.key_for("r", stray, "float32/c/0"), b"y" * 10)
    report = doctor(store, fix=True, grace_s=0)
    assert _kinds(report) == ["orphan-data"] * 3
    assert not unfinished.exists()
    assert foreign.exists()  # marked data without a row: never deleted automatically
    assert warm.list_prefix(warm.prefix_for("r", stray)) == []
    assert [f.fixed for f in report.findings if f.subject == str(foreign)] == [False]
    checks.assert_loads_bit_exact(store, {keep.id: (1, NBYTES)})


def test_young_unfinished_data_is_left_to_its_writer(store: Any) -> None:
    fresh = store.hot / "r" / str(uuid.uuid4())
    fresh.mkdir(parents=True)
    report = doctor(store, fix=True)  # default grace: 60 s
    assert _kinds(report) == ["orphan-data"]
    assert fresh.exists() and not report.findings[0].fixable


def test_dead_writer_and_dead_lease(store: Any, w: Any) -> None:
    host = socket.gethostname()
    dead = _dead_pid()
    ck = store.save("r", 1, w.make_state(1, NBYTES))
    pending = store.catalog.begin_checkpoint("r", 2, writer=f"{host}:{dead}")
    store.checkpoint_dir("r", pending.id).mkdir(parents=True)
    assert store.catalog.acquire_lease(ck.id, "archive:warm", f"{host}:{dead}:abc", 3600)
    assert store.catalog.acquire_lease(ck.id, "retention", f"{host}:{os.getpid()}:me", 3600)
    assert owner_is_dead(f"retention:{host}:{dead}:x")
    assert not owner_is_dead(f"{host}:{os.getpid()}")
    assert not owner_is_dead(f"other-host:{dead}:x")
    report = doctor(store, fix=True, grace_s=0)
    assert _kinds(report) == ["dead-lease", "dead-pending"]
    assert store.catalog.get_any(pending.id).state == CheckpointState.FAILED
    assert not store.checkpoint_dir("r", pending.id).exists()
    assert store.catalog.lease_holder(ck.id, "archive:warm") is None
    assert store.catalog.lease_holder(ck.id, "retention") is not None  # alive: kept
    assert archive_checkpoints(store, tier="warm", threads=2).archived == [ck.id]


def test_stale_copying_and_stray_temp_files(store: Any, w: Any) -> None:
    ck = store.save("r", 1, w.make_state(1, NBYTES))
    store.catalog.set_replica(ck.id, "warm", state=ReplicaState.COPYING, uri="x")
    warm = tier_of(store, "warm")
    warm.put_bytes(warm.key_for("r", ck.id, "float32/c/0"), b"partial")
    temp = store.checkpoint_dir("r", ck.id) / "float32" / "c" / ".ckpt-tmp-1234"
    temp.write_bytes(b"half a chunk")
    report = doctor(store, fix=True, grace_s=0)
    assert _kinds(report) == ["orphan-data", "stale-copying", "stray-temp"]
    assert report.ok, report.render()
    assert store.catalog.get(ck.id).replica("warm").state == ReplicaState.DELETED
    assert warm.list_prefix(warm.prefix_for("r", ck.id)) == []
    assert not temp.exists()
    assert archive_checkpoints(store, tier="warm", threads=2).archived == [ck.id]
    assert doctor(store, deep=True, grace_s=0).findings == []


def test_unrecorded_complete_copy_is_adopted_after_verification(store: Any, w: Any) -> None:
    ck = store.save("r", 1, w.make_state(1, NBYTES))
    archive_checkpoints(store, tier="warm", threads=2)
    # As if the archive died after writing the marker but before recording the copy.
    store.catalog.set_replica(ck.id, "warm", state=ReplicaState.DELETED)
    report = doctor(store, fix=True, grace_s=0)
    assert _kinds(report) == ["orphan-data"] and report.ok
    replica = store.catalog.get(ck.id).replica("warm")
    assert replica.state == ReplicaState.PRESENT and replica.verified_at is not None
    assert "adopted" in [e.kind for e in store.events(ck.id)]


def test_interrupted_delete_is_reported_not_forced(store: Any, w: Any) -> None:
    ck = store.save("r", 1, w.make_state(1, NBYTES))
    store.save("r", 2, w.make_state(2, NBYTES))
    store.catalog.mark_deleting(ck.id)
    report = doctor(store, fix=True, grace_s=0)
    assert _kinds(report) == ["interrupted-delete"]
    assert "ckpt prune" in report.findings[0].detail
    assert store.checkpoint_dir("r", ck.id).exists()
