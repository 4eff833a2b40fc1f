"""Crash consistency of archive, prune, tier moves and restore: SIGKILL at exact steps.

The child process is killed right after its n-th call of a tier or catalog method (the test
wraps the method inside the child, so the kill lands exactly between two steps of the
protocol) or at a seeded random moment. Afterwards: the catalog never claims a replica that
is not there, every committed checkpoint keeps at least one verified copy, the store-wide
invariants hold once ``doctor --fix`` cleaned up, and a rerun of the flow finishes the job.
"""

from __future__ import annotations

import random
import time
import uuid
from pathlib import Path
from typing import Any

import ckpt_reliability_checks as checks
import pytest
from ckpt_reliability_checks import FULL, join, start_child

from ckptstore.ops.tiering.archive import archive_checkpoints, demote_checkpoints
from ckptstore.ops.tiering.replicas import manifest_of
from ckptstore.ops.tiering.restore import restore_checkpoint
from ckptstore.ops.tiering.retention import apply_retention
from ckptstore.ops.upkeep.doctor import doctor
from ckptstore.records import CheckpointState, ReplicaState
from ckptstore.retention import RetentionPolicy
from ckptstore.storage.transfer import owned_files
from ckptstore.store import CheckpointStore

NBYTES = 2 * 1024 * 1024
CHUNK = 512 * 1024


def _setup(root: Path, w: Any, warm: str | None, storage_options: dict[str, Any],
           cold: str | None = None) -> tuple[CheckpointStore, dict[str, Any], checks.Expected]:
    opts: dict[str, Any] = {"chunk_bytes": CHUNK}
    if warm is not None:
        opts["warm"] = warm
    if cold is not None:
        opts.update(cold=cold, cold_storage_class="STANDARD_IA")
    if storage_options:
        opts["storage_options"] = storage_options
    store = CheckpointStore.open(root, **opts)
    expected: checks.Expected = {}
    for i in range(3):
        ck = store.save("r", i, w.make_state(i + 1, NBYTES), metrics={"loss": 1.0 - i / 10})
        expected[ck.id] = (i + 1, NBYTES)
    return store, opts, expected


def _files_per_checkpoint(store: CheckpointStore) -> int:
    return len(owned_files(manifest_of(store, store.list()[0])))


def _after_kill(store: CheckpointStore, tiers: tuple[str, ...]) -> None:
    """What must hold right after a kill, before any repair."""
    for tier in tiers:
        assert checks.remote_claims(store, tier) == [], f"catalog claims a missing {tier} copy"
    assert checks.present_copies(store) == []


def _recover(store: CheckpointStore) -> None:
    """doctor --fix, then the store-wide invariants hold and doctor finds nothing more."""
    doctor(store, fix=True, grace_s=0)
    assert checks.staging_left(store) == []
    checks.assert_sound(store)
    again = doctor(store, grace_s=0)
    assert [f for f in again.findings if f.kind != "interrupted-delete"] == [], again.render()


@pytest.fixture
def s3_url(s3: Any) -> str:
    return s3.url(f"{uuid.uuid4().hex[:10]}/warm")


def _kid(kill: Any) -> str:
    return f"{kill[0]}.{kill[1]}#{kill[2]}" if isinstance(kill, tuple) else str(kill)


ARCHIVE_KILLS = [
    ("dst", "put_bytes", 1),
    ("dst", "put_bytes", -1),  # the manifest of the first checkpoint
    ("dst", "put_bytes", 0),  # its marker: on the tier, not yet recorded
    ("catalog", "set_replica", 1),  # COPYING recorded
    ("catalog", "set_replica", 2),  # PRESENT recorded, event and lease release not yet
]


def _archive_cases() -> list[tuple[str, tuple[str, str, int]]]:
    if FULL:
        return [(kind, kill) for kind in ("local", "s3") for kill in ARCHIVE_KILLS]
    return [("local", ARCHIVE_KILLS[1]), ("local", ARCHIVE_KILLS[3]), ("s3", ARCHIVE_KILLS[2])]


@pytest.mark.parametrize(("kind", "kill"), _archive_cases(),
                         ids=lambda v: v if isinstance(v, str) else f"{v[0]}.{v[1]}#{v[2]}")
def test_kill_during_archive(
    tmp_path: Path, new_root: Any, procs: Any, w: Any, request: Any, kind: str,
    kill: tuple[str, str, int], figures: Any,
) -> None:
    if kind == "local":
        warm, options = str(tmp_path / "warm"), {}
    else:
        server = request.getfixturevalue("s3")
        warm, options = request.getfixturevalue("s3_url"), server.storage_options
    store, opts, expected = _setup(new_root(), w, warm, options)
    with store:
        target, method, nth = kill
        if target == "dst" and nth <= 0:
            nth = _files_per_checkpoint(store) + nth
        child = start_child(procs, w.archive_and_die, str(store.settings.root), opts,
                            (target, method, nth))
        assert join(child) == -9, "the archive was not killed"
        _after_kill(store, ("hot", "warm"))
        checks.assert_loads_bit_exact(store, expected)
        _recover(store)
        report = archive_checkpoints(store, tier="warm", threads=2)
        assert report.ok, report.summary()
        assert all(ck.replica("warm").state == ReplicaState.PRESENT for ck in store.list())
        assert checks.remote_claims(store, "warm") == []
        _recover(store)
        figures.add("kill_points")
        figures.add("runs_survived")
        figures.set("lost", 0)


PRUNE_KILLS = [
    ("catalog", "mark_deleting", 1),
    ("tier", "delete", 1),  # the first checkpoint's marker is gone, files are not
    ("catalog", "mark_deleted", 1),
]


@pytest.mark.parametrize("kill", PRUNE_KILLS if FULL else PRUNE_KILLS[:2], ids=_kid)
def test_kill_during_prune(
    tmp_path: Path, new_root: Any, procs: Any, w: Any, kill: Any, figures: Any
) -> None:
    store, opts, expected = _setup(new_root(), w, None, {})
    with store:
        newest = store.latest("r")
        child = start_child(procs, w.prune_and_die, str(store.settings.root), opts, "hot", 1,
                            kill)
        assert join(child) == -9
        _after_kill(store, ("hot",))
        assert store.latest("r").id == newest.id
        assert [ck.id for ck in store.list()] in ([newest.id], [
            ck for ck in expected if store.catalog.get_any(ck).state == CheckpointState.COMMITTED
        ])
        checks.assert_loads_bit_exact(store, {newest.id: expected[newest.id]})
        _recover(store)
        report = apply_retention(store, tier="hot", policy=RetentionPolicy(keep_last=1))
        assert report.ok and not report.skipped, report.to_dict()
        assert [ck.id for ck in store.list()] == [newest.id]
        for ckpt_id in expected:
            if ckpt_id != newest.id:
                assert store.catalog.get_any(ckpt_id).state == CheckpointState.DELETED
                assert not store.checkpoint_dir("r", ckpt_id).exists()
        _recover(store)
        figures.add("kill_points")
        figures.add("runs_survived")


@pytest.mark.parametrize("kill", [("catalog", "set_replica", 1), ("tier", "delete", 1)]
                         if FULL else [("tier", "delete", 1)], ids=_kid)
def test_kill_while_pruning_hot_copies(
    tmp_path: Path, new_root: Any, procs: Any, w: Any, kill: Any, figures: Any
) -> None:
    """keep_last=1 on hot with every checkpoint archived: only hot copies are deleted."""
    store, opts, expected = _setup(new_root(), w, str(tmp_path / "warm"), {})
    with store:
        archive_checkpoints(store, tier="warm", threads=2)
        child = start_child(procs, w.prune_and_die, str(store.settings.root), opts, "hot", 1,
                            kill)
        assert join(child) == -9
        _after_kill(store, ("hot", "warm"))
        _recover(store)
        report = apply_retention(store, tier="hot", policy=RetentionPolicy(keep_last=1))
        assert report.ok and not report.skipped, report.to_dict()
        hot = [ck for ck in store.list() if ck.replica("hot").state == ReplicaState.PRESENT]
        assert len(hot) == 1
        checks.assert_loads_bit_exact(store, expected)  # the others come back from warm
        _recover(store)
        figures.add("kill_points")
        figures.add("runs_survived")


DEMOTE_KILLS = [
    ("dst", "put_bytes", 0),  # cold marker written, cold replica still COPYING
    ("catalog", "set_replica", 2),  # cold PRESENT recorded, warm copy not deleted yet
    ("src", "delete", 1),  # warm marker deleted, warm replica DELETING
]


@pytest.mark.parametrize("kill", DEMOTE_KILLS if FULL else DEMOTE_KILLS[1:], ids=_kid)
def test_kill_during_tier_move(
    tmp_path: Path, new_root: Any, procs: Any, w: Any, kill: Any, figures: Any
) -> None:
    store, opts, expected = _setup(new_root(), w, str(tmp_path / "warm"), {},
                                   cold=str(tmp_path / "cold"))
    with store:
        archive_checkpoints(store, tier="warm", threads=2)
        target, method, nth = kill
        if nth <= 0:
            nth = _files_per_checkpoint(store) + nth
        child = start_child(procs, w.demote_and_die, str(store.settings.root), opts,
                            (target, method, nth))
        assert join(child) == -9
        _after_kill(store, ("hot", "warm", "cold"))
        _recover(store)
        report = demote_checkpoints(store, older_than_days=0, threads=2)
        assert report.ok, report.summary()
        if any(ck.replica("warm").state == ReplicaState.DELETING for ck in store.list()):
            # The demote rerun does not finish a killed source delete (see
            # test_demote_rerun_finishes_source_delete); retention on warm does.
            apply_retention(store, tier="warm", policy=RetentionPolicy())
        for ck in store.list():
            assert ck.replica("cold").state == ReplicaState.PRESENT
            assert ck.replica("warm").state == ReplicaState.DELETED
        assert checks.remote_claims(store, "cold") == []
        _recover(store)
        checks.assert_loads_bit_exact(store, expected)
        figures.add("kill_points")
        figures.add("runs_survived")


@pytest.mark.parametrize("kill", [("hot", "put_bytes", 3), ("catalog", "set_replica", 1),
                                  "random"] if FULL else [("hot", "put_bytes", 3), "random"],
                         ids=str)
def test_kill_during_restore(
    tmp_path: Path, new_root: Any, procs: Any, w: Any, kill: Any, figures: Any
) -> None:
    store, opts, expected = _setup(new_root(), w, str(tmp_path / "warm"), {})
    with store:
        archive_checkpoints(store, tier="warm", threads=2)
        apply_retention(store, tier="hot", policy=RetentionPolicy(keep_last=1))
        oldest = store.list(order_by="step")[0]
        assert oldest.replica("hot").state == ReplicaState.DELETED
        ready = procs.Event()
        child = start_child(procs, w.restore_and_die, str(store.settings.root), opts,
                            oldest.id, None if kill == "random" else kill, ready=ready)
        if kill == "random":
            assert ready.wait(120)
            time.sleep(random.Random(7).uniform(0.0, 0.3))
            child.kill()
        code = join(child)
        if kill != "random":
            assert code == -9
        _after_kill(store, ("hot", "warm"))
        _recover(store)
        path = restore_checkpoint(store, oldest.id, threads=2, wait_s=5)
        assert (path / "COMMITTED").is_file()
        checks.assert_loads_bit_exact(store, expected)
        _recover(store)
        figures.add("kill_points")
        figures.add("runs_survived")


def test_gc_cleans_up_after_a_killed_restore(
    tmp_path: Path, new_root: Any, procs: Any, w: Any
) -> None:
    """``ckpt gc`` alone (no doctor) should remove a killed restore's partial hot directory:
    it is staging exactly like a killed save's (see the report: store.gc skips directories
    of known checkpoints)."""
    store, opts, _ = _setup(new_root(), w, str(tmp_path / "warm"), {})
    with store:
        archive_checkpoints(store, tier="warm", threads=2)
        apply_retention(store, tier="hot", policy=RetentionPolicy(keep_last=1))
        oldest = store.list(order_by="step")[0]
        child = start_child(procs, w.restore_and_die, str(store.settings.root), opts,
                            oldest.id, ("hot", "put_bytes", 3))
        assert join(child) == -9
        partial = store.checkpoint_dir("r", oldest.id)
        assert partial.is_dir() and not (partial / "COMMITTED").exists()
        store.gc()
        assert not partial.exists(), "store.gc() left the partial directory of a killed restore"
        checks.assert_sound(store)


def test_rerun_after_killed_archive_needs_no_doctor(
    tmp_path: Path, new_root: Any, procs: Any, w: Any
) -> None:
    """A flow killed mid-way holds its catalog lease until it expires (1 h for archive):
    a rerun on the same host should see that the holder is dead and take over."""
    store, opts, _ = _setup(new_root(), w, str(tmp_path / "warm"), {})
    with store:
        child = start_child(procs, w.archive_and_die, str(store.settings.root), opts,
                            ("catalog", "set_replica", 1))
        assert join(child) == -9
        report = archive_checkpoints(store, tier="warm", threads=2, raise_errors=False)
        assert not report.skipped, f"the rerun skipped {report.skipped} (a dead holder's lease)"
        assert all(ck.replica("warm").state == ReplicaState.PRESENT for ck in store.list())


def test_demote_rerun_finishes_source_delete(
    tmp_path: Path, new_root: Any, procs: Any, w: Any
) -> None:
    """Flows are idempotent: rerunning a demote killed while deleting the warm copy should
    end where an uninterrupted demote ends (warm copy DELETED)."""
    store, opts, _ = _setup(new_root(), w, str(tmp_path / "warm"), {},
                            cold=str(tmp_path / "cold"))
    with store:
        archive_checkpoints(store, tier="warm", threads=2)
        child = start_child(procs, w.demote_and_die, str(store.settings.root), opts,
                            ("src", "delete", 1))
        assert join(child) == -9
        doctor(store, fix=True, grace_s=0)  # releases the dead process's lease
        demote_checkpoints(store, older_than_days=0, threads=2)
        stuck = [ck.ref for ck in store.list()
                 if ck.replica("warm").state == ReplicaState.DELETING]
        assert not stuck, f"warm copies of {stuck} stay DELETING after the rerun"
