"""Crash consistency of saves: SIGKILL at every named fault point and at seeded random times.

After every kill: each previously committed checkpoint loads bit-exactly, the killed save is
invisible (not listed, not latest, IncompleteCheckpointError by id), and ``gc`` leaves no
staging (no directory without COMMITTED, no PENDING row of a dead writer); the store-wide
invariants hold.
"""

from __future__ import annotations

import random
from typing import Any

import ckpt_reliability_checks as checks
import pytest
from ckpt_reliability_checks import FULL, join, start_child

from ckptstore.records import CheckpointState
from ckptstore.store import CheckpointStore
from ckptstore.testing.fault_injection import kill_after

SMALL = 6 * 1024 * 1024
BIG = 100 * 1024 * 1024
OPEN = {"chunk_bytes": 1024 * 1024}

#: Every fault point of the save path, in order. "save.committed" fires twice: first when
#: the format wrote the marker (catalog row still PENDING), then after the catalog commit.
NAMED_POINTS = (
    "save.pending",
    "save.chunks_started",
    "save.chunks_written",
    "save.metadata_written",
    "save.manifest_written",
    "save.committed",
    "save.committed:2",
)


def _killed_row(store: CheckpointStore, step: int) -> Any:
    """The row of the save at ``step``; None if it died before registering one."""
    rows = store.catalog.list(run="r", step_range=(step, step), state=None)
    assert len(rows) <= 1, rows
    return rows[0] if rows else None


def _after_kill(store: CheckpointStore, expected: checks.Expected, step: int, seed: int,
                nbytes: int, *, deep: bool) -> bool:
    """Check one killed save; return True when it had committed before dying."""
    row = _killed_row(store, step)
    if row is None:
        assert store.gc().empty
        checks.assert_sound(store, deep=deep)
        return False
    if row.state == CheckpointState.COMMITTED:
        expected[row.id] = (seed, nbytes)
    else:
        assert row.state == CheckpointState.PENDING, row.state
        checks.assert_invisible(store, row.id)
    newest = max(expected, key=lambda cid: store.catalog.get(cid).version)
    assert store.latest("r").id == newest
    report = store.gc()
    assert checks.staging_left(store) == []
    if row.state != CheckpointState.COMMITTED:
        assert report.failed_rows == [row.id]
        assert store.catalog.get_any(row.id).state == CheckpointState.FAILED
        assert not store.checkpoint_dir("r", row.id).exists()
    checks.assert_sound(store, deep=deep)
    return row.state == CheckpointState.COMMITTED


def test_kill_at_every_named_point(new_root: Any, procs: Any, w: Any, figures: Any) -> None:
    root = new_root()
    expected: checks.Expected = {}
    with CheckpointStore.open(root, **OPEN) as store:
        first = store.save("r", 0, w.make_state(1, SMALL))
        expected[first.id] = (1, SMALL)
        for i, point in enumerate(NAMED_POINTS, start=1):
            seed = 100 + i
            child = start_child(procs, w.save_once, str(root), "r", i, seed, SMALL,
                                env={"CKPT_FAULT_POINT": point}, open_kwargs=OPEN)
            assert join(child) == -9, f"the save was not killed at {point}"
            committed = _after_kill(store, expected, i, seed, SMALL, deep=True)
            assert committed == (point == "save.committed:2"), point
            checks.assert_loads_bit_exact(store, expected)
            figures.add("kill_points")
            figures.add("runs_survived")
        # The store keeps working after all that.
        ck = store.save("r", 99, w.make_state(999, SMALL))
        expected[ck.id] = (999, SMALL)
        checks.assert_loads_bit_exact(store, expected)
        figures.set("lost", 0)


@pytest.mark.slow
def test_kill_at_random_times(new_root: Any, procs: Any, w: Any, figures: Any) -> None:
    """~100 MB saves SIGKILLed after U(0, 1.2 x save time), seeded; N=30+ with FULL."""
    runs = 36 if FULL else 3
    rng = random.Random(20261130)
    root = new_root()
    expected: checks.Expected = {}
    with CheckpointStore.open(root) as store:
        queue = procs.SimpleQueue()
        # One uninterrupted save measures how long a save takes here, now.
        child = start_child(procs, w.save_once, str(root), "r", 0, 1, BIG, queue=queue)
        assert join(child) == 0
        status, first_id, seconds = queue.get()
        assert status == "ok"
        expected[first_id] = (1, BIG)
        survived = committed = 0
        for i in range(1, runs + 1):
            seed = 1000 + i
            delay = rng.uniform(0.0, 1.2 * seconds)
            ready = procs.Event()
            child = start_child(procs, w.save_once, str(root), "r", i, seed, BIG,
                                ready=ready, queue=queue)
            assert ready.wait(120), "child never got ready"
            kill_after(child.pid, delay, alive=child.is_alive).join(60)
            code = join(child)
            while not queue.empty():
                queue.get()
            killed_mid_save = code == -9
            try:
                if _after_kill(store, expected, i, seed, BIG, deep=False):
                    committed += 1
            except AssertionError as exc:
                raise AssertionError(f"seed 20261130 run {i}: kill after {delay:.3f}s "
                                     f"(save takes ~{seconds:.2f}s): {exc}") from exc
            survived += 1
            figures.add("random_kills" if killed_mid_save else "random_kills_after_save")
        checks.assert_sound(store, deep=True)
        checks.assert_loads_bit_exact(store, expected)
        figures.add("runs_survived", survived)
        figures.set("committed_before_kill", committed)
        figures.set("lost", 0)


@pytest.mark.parametrize("point", ["save.chunks_written", "save.committed"] if FULL
                         else ["save.committed"])
def test_two_killed_saves_then_gc_then_save(
    new_root: Any, procs: Any, w: Any, point: str
) -> None:
    """Kills pile up (several dead PENDING rows) and one gc clears all of them."""
    root = new_root()
    with CheckpointStore.open(root, **OPEN) as store:
        keep = store.save("r", 0, w.make_state(5, SMALL))
        for step in (1, 2):
            child = start_child(procs, w.save_once, str(root), "r", step, 10 + step, SMALL,
                                env={"CKPT_FAULT_POINT": point}, open_kwargs=OPEN)
            assert join(child) == -9
        pending = store.catalog.list(state=CheckpointState.PENDING)
        assert len(pending) == 2
        dry = store.gc(dry_run=True)
        assert sorted(dry.failed_rows) == sorted(c.id for c in pending)
        assert len(store.catalog.list(state=CheckpointState.PENDING)) == 2  # dry run: no change
        store.gc()
        assert checks.staging_left(store) == []
        ck = store.save("r", 3, w.make_state(6, SMALL))
        checks.assert_loads_bit_exact(store, {keep.id: (5, SMALL), ck.id: (6, SMALL)})
        checks.assert_sound(store)
