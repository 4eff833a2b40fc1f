"""Snapshots every step: slots reused, durable saves written from them, restarts lose at most
one step, a torn snapshot is never read, the budget refuses what does not fit.

The trainers that are killed and restarted are processes of their own: children of a
forkserver that preloaded torch and ckptstore (tests/hooks/snapshot_trainer.py's
``train_in_child``), so that each start does not pay seconds of imports as a fresh
interpreter would. Each is still killed for real (SIGKILL) and its exit code is its own.
"""

from __future__ import annotations

import multiprocessing
import os
import random
import shutil
import signal
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from process_support import add_test_dir, preloaded_children

from ckptstore.errors import CheckpointNotFoundError, ConfigError
from ckptstore.hooks.manager import CheckpointManager
from ckptstore.ops.writing.snapshot import (
    newest_snapshot,
    read_snapshot,
    snapshot_dir,
    snapshots_here,
)
from ckptstore.store import CheckpointStore

HERE = Path(__file__).parent
add_test_dir(HERE)  # before importing its helper scripts; the children get it too

import snapshot_trainer  # noqa: E402

#: Installed packages only: the children import snapshot_trainer.py themselves. Besides the
#: trainer's imports, what it would import later on its own: torch._dynamo (the optimizer's
#: first step), alembic's command module (creating the catalog), the migrations and the
#: metrics module. With these a trainer imports nothing but snapshot_trainer.
_PRELOAD = ["torch", "torch._dynamo", "alembic", "alembic.command", "alembic.config",
            "ckptstore.hooks.manager", "ckptstore.store", "ckptstore.migrations",
            "ckptstore.observability.prom", "ckptstore.ops.writing.snapshot_peer"]


def _state(w: torch.Tensor, step: int) -> dict[str, Any]:
    return {"model": {"w": w, "b": w[:10].to(torch.bfloat16)}, "step": step, "note": "x"}


def _run(store: CheckpointStore, steps: range, w: torch.Tensor, **kw: Any) -> None:
    with CheckpointManager(store, "r", handle_sigterm=False, history=False, **kw) as mgr:
        for step in steps:
            w.add_(1)
            mgr.step(step, lambda step=step: _state(w, step))


@pytest.mark.parametrize("async_save", [True, False])
def test_snapshots_each_step_and_durable_saves_from_them(
    snap_store: CheckpointStore, async_save: bool
) -> None:
    w = torch.zeros(4096)
    with CheckpointManager(snap_store, "r", snapshot_interval=1, save_interval=5,
                           handle_sigterm=False, history=False, async_save=async_save) as mgr:
        inodes: set[int] = set()
        for step in range(1, 13):
            w.add_(1)
            mgr.step(step, lambda step=step: _state(w, step))
            mgr.snapshots.flush()  # type: ignore[union-attr]
            inodes |= {p.stat().st_ino for p in snapshot_dir(snap_store, "r").iterdir()}
            assert newest_snapshot(snap_store, "r").step == step  # type: ignore[union-attr]
    # Three slots (two alternating, one for the durable save), created once, and one
    # catalog row for them (not one per snapshot).
    assert len(inodes) == 3
    (area,) = snap_store.catalog.snapshot_areas("r")
    assert area.slots == 3 and area.uri.endswith(str(snapshot_dir(snap_store, "r")))
    # Durable checkpoints only every save_interval, with the snapshot's bytes.
    assert sorted(ck.step for ck in snap_store.list(run="r")) == [5, 10]
    five = snap_store.load("r@5")
    assert five["step"] == 5 and torch.equal(five["model"]["w"], torch.full((4096,), 5.0))
    assert five["model"]["b"].dtype == torch.bfloat16
    # The snapshot (step 12) is newer than the newest checkpoint (step 10): it wins.
    latest = snap_store.load("r@latest")
    assert latest["step"] == 12 and torch.equal(latest["model"]["w"], w)
    assert latest["note"] == "x"


def test_restore_latest_prefers_newer_snapshot_and_continues_schedule(
    snap_store: CheckpointStore,
) -> None:
    w = torch.zeros(256)
    _run(snap_store, range(1, 9), w, snapshot_interval=1, save_interval=5)
    mgr = CheckpointManager(snap_store, "r", snapshot_interval=1, save_interval=5,
                            handle_sigterm=False, history=False)
    try:
        into = _state(torch.empty(256), -1)
        state = mgr.restore_latest(into=into)
        assert state["step"] == 8 and mgr.resumed_step == 8
        assert mgr.resumed_from is not None and mgr.resumed_from.step == 5
        assert state["model"]["w"] is into["model"]["w"]  # filled in place
        assert torch.equal(into["model"]["w"], w)
        for step in range(9, 11):
            w.add_(1)
            mgr.step(step, lambda step=step: _state(w, step))
        mgr.wait()
        ck = snap_store.latest("r")
        assert ck.step == 10
        assert ck.parent_id == mgr.resumed_from.id
    finally:
        mgr.close()


def test_older_checkpoint_wins_over_older_snapshot(snap_store: CheckpointStore) -> None:
    w = torch.zeros(64)
    _run(snap_store, range(1, 4), w, snapshot_interval=1, save_interval=100)
    w.fill_(42)
    snap_store.save("r", 9, _state(w, 9))
    assert snap_store.load("r@latest")["step"] == 9


def test_damaged_snapshot_gives_way_to_the_one_before(snap_store: CheckpointStore) -> None:
    w = torch.zeros(1024)
    _run(snap_store, range(1, 6), w, snapshot_interval=1)
    newest, older = snapshots_here(snap_store, "r")[:2]
    assert (newest.step, older.step) == (5, 4)
    with open(newest.path, "r+b") as fh:  # one flipped data byte: the crc32c catches it
        fh.seek(newest.path.stat().st_size - 4096)  # inside "w"
        byte = fh.read(1)
        fh.seek(-1, os.SEEK_CUR)
        fh.write(bytes([byte[0] ^ 0xFF]))
    with pytest.raises(Exception, match="damaged"):
        read_snapshot(newest)
    assert snap_store.load("r@latest")["step"] == 4
    with open(older.path, "r+b") as fh:  # a torn header: not even listed
        fh.seek(20)
        fh.write(b"\x00\x01")
    steps = [f.step for f in snapshots_here(snap_store, "r")]
    assert steps[0] == 5 and 4 not in steps
    for found in snapshots_here(snap_store, "r")[1:]:
        found.path.unlink()
    with pytest.raises(CheckpointNotFoundError):
        snap_store.load("r@latest")  # no durable checkpoint and no good snapshot


def test_large_snapshot_read_on_two_threads_is_exact_and_checked(
    snap_store: CheckpointStore,
) -> None:
    # 12 MiB of state: read back as two halves on two threads, their crc32c joined.
    gen = torch.Generator().manual_seed(3)
    state = {"a": torch.randn(1_500_000, generator=gen), "b": torch.randn(1_500_001,
                                                                           generator=gen)}
    with CheckpointManager(snap_store, "big", snapshot_interval=1, handle_sigterm=False,
                           history=False) as mgr:
        mgr.step(1, lambda: state)
    found = newest_snapshot(snap_store, "big")
    assert found is not None
    back = read_snapshot(found)
    assert all(torch.equal(back[k], state[k]) for k in state)
    into = {k: torch.zeros_like(v) for k, v in state.items()}
    assert read_snapshot(found, into=into)["b"] is into["b"]
    assert all(torch.equal(into[k], state[k]) for k in state)
    # A flipped byte in either half is caught.
    size = found.path.stat().st_size
    for where in (size // 3, size * 5 // 6):  # inside "a", then inside "b"
        with open(found.path, "r+b") as fh:
            fh.seek(where)
            byte = fh.read(1)
            fh.seek(where)
            fh.write(bytes([byte[0] ^ 0x01]))
        with pytest.raises(Exception, match="damaged"):
            read_snapshot(found)
        with open(found.path, "r+b") as fh:
            fh.seek(where)
            fh.write(byte)
        assert torch.equal(read_snapshot(found)["a"], state["a"])


def test_budget_refuses_what_does_not_fit(snap_store: CheckpointStore) -> None:
    w = torch.zeros(1024 * 1024)  # 4 MiB of state, 3 slots
    mgr = CheckpointManager(snap_store, "r", snapshot_interval=1, save_interval=10,
                            snapshot_budget_bytes=8 * 2**20, handle_sigterm=False,
                            history=False)
    try:
        with pytest.raises(ConfigError, match=r"snapshot_budget_bytes=8388608.*at least"):
            mgr.step(1, lambda: _state(w, 1))
        assert not list(snapshot_dir(snap_store, "r").glob("slot*"))
    finally:
        mgr.close()
    with pytest.raises(ConfigError, match="snapshot_budget_bytes"):
        CheckpointManager(snap_store, "r", snapshot_interval=1, snapshot_budget_bytes=0,
                          handle_sigterm=False)
    with pytest.raises(ConfigError):
        CheckpointManager(snap_store, "r", snapshot_interval=0, handle_sigterm=False)


def test_guarded_optimizer_overlaps_the_copy_bit_exact(snap_store: CheckpointStore) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 64)
    opt = torch.optim.AdamW(model.parameters())
    mgr = CheckpointManager(snap_store, "r", snapshot_interval=1, save_interval=4,
                            handle_sigterm=False, history=False)
    expected: dict[str, torch.Tensor] = {}
    try:
        mgr.guard(opt)
        for step in range(6):
            opt.zero_grad()
            model(torch.ones(2, 64) * step).sum().backward()
            opt.step()
            mgr.step(step, lambda: {"model": model.state_dict(), "optim": opt.state_dict()})
            expected = {k: v.clone() for k, v in model.state_dict().items()}
    finally:
        mgr.close()
    got = snap_store.load("r@latest")["model"]
    assert all(torch.equal(got[k], expected[k]) for k in expected)


@pytest.fixture(scope="module")
def trainers() -> Iterator[multiprocessing.context.BaseContext]:
    """Where the trainers start: a forkserver with torch and ckptstore imported, stopped with
    the module. When another module's forkserver runs already, spawned children instead:
    slower, always right."""
    yield from preloaded_children(_PRELOAD)


class _Trainer:
    """One trainer process (snapshot_trainer.py): its stderr goes to ``<log>.err``."""

    def __init__(self, ctx: multiprocessing.context.BaseContext, tmp_path: Path,
                 shm_root: Path, run: str, steps: int, log: Path,
                 env: dict[str, str] | None) -> None:
        self.err = log.with_name(log.name + ".err")
        self.proc = ctx.Process(  # type: ignore[attr-defined]
            target=snapshot_trainer.train_in_child,
            args=([str(tmp_path / "store"), str(shm_root), run, str(steps), str(log)],
                  env or {}, str(self.err)))
        self.proc.start()

    def running(self) -> bool:
        return bool(self.proc.is_alive())

    def kill(self) -> None:
        """SIGKILL it and reap it."""
        self.proc.kill()
        self.proc.join(30)
        assert not self.proc.is_alive()

    def finish(self, timeout: float) -> int:
        """Its exit code (negative: the signal that ended it) once it has ended by itself;
        one still running after ``timeout`` seconds fails the test (killed first)."""
        self.proc.join(timeout)
        if self.proc.is_alive():
            self.kill()
            raise AssertionError(f"trainer still running after {timeout} s: {self.stderr()}")
        return int(self.proc.exitcode)

    def stderr(self) -> str:
        return self.err.read_text() if self.err.exists() else ""


def _trainer(ctx: multiprocessing.context.BaseContext, tmp_path: Path, shm_root: Path,
             run: str, steps: int, log: Path, env: dict[str, str] | None = None) -> _Trainer:
    return _Trainer(ctx, tmp_path, shm_root, run, steps, log, env)


def _lines(log: Path) -> list[list[str]]:
    return [line.split() for line in log.read_text().splitlines() if line.strip()]


REFERENCE_STEPS = 80


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory,
              trainers: multiprocessing.context.BaseContext) -> Iterator[dict[int, str]]:
    """Digest of the trainer's state after each step of one uninterrupted run (shared by the
    tests of this module: every trainer start costs seconds on a loaded machine)."""
    tmp = tmp_path_factory.mktemp("reference")
    base = Path("/dev/shm")
    shm = base / f"ckptstore-test-{uuid.uuid4().hex[:10]}" if base.is_dir() else tmp / "shm"
    try:
        log = tmp / "reference.log"
        proc = _trainer(trainers, tmp, shm, "reference", REFERENCE_STEPS, log)
        assert proc.finish(180) == 0, proc.stderr()
        yield {int(p[1]): p[2] for p in _lines(log) if p[0] == "done"}
    finally:
        shutil.rmtree(shm, ignore_errors=True)


@pytest.mark.slow
def test_sigkill_at_random_steps_resumes_within_one_step_bit_exact(
    tmp_path: Path, shm_root: Path, reference: dict[int, str],
    trainers: multiprocessing.context.BaseContext,
) -> None:
    steps = REFERENCE_STEPS
    log = tmp_path / "killed.log"
    rng = random.Random(34)
    kills = 0
    deadline = time.monotonic() + 90
    while kills < 5 and time.monotonic() < deadline:
        proc = _trainer(trainers, tmp_path, shm_root, "killed", steps, log)
        seen = len(_lines(log)) if log.exists() else 0
        # Kill once the child has made a few steps since its start, after a random delay.
        while proc.running() and time.monotonic() < deadline:
            lines = _lines(log) if log.exists() else []
            if sum(1 for p in lines[seen:] if p[0] == "done") >= 2:
                break
            time.sleep(0.01)
        time.sleep(rng.uniform(0.0, 0.15))
        if not proc.running():
            break  # finished before the kill
        proc.kill()
        kills += 1
    assert kills >= 3
    proc = _trainer(trainers, tmp_path, shm_root, "killed", steps, log)
    assert proc.finish(120) == 0, proc.stderr()
    lines = _lines(log)
    last_done: int | None = None
    resumes = 0
    for parts in lines:
        if parts[0] == "done":
            assert reference[int(parts[1])] == parts[2]  # every step bit-exact
            last_done = int(parts[1])
        elif parts[0] == "resumed":
            step = int(parts[1])
            if last_done is not None:
                resumes += 1
                # The killed step (not yet logged), the last logged one, or the one before.
                assert last_done - 1 <= step <= last_done + 1, (step, last_done)
                assert reference[step] == parts[2]  # the restored state is bit-exact
            last_done = step if step >= 0 else None
    assert resumes >= kills and lines[-1] == ["finished"]
    assert last_done == steps - 1


@pytest.mark.slow
@pytest.mark.parametrize("point", ["snapshot.tensor:40", "snapshot.copied:4"])
def test_snapshot_torn_by_a_crash_is_never_read(
    tmp_path: Path, shm_root: Path, point: str, reference: dict[int, str],
    trainers: multiprocessing.context.BaseContext,
) -> None:
    # Tensor pass 40 is mid-copy in the 3rd or 4th snapshot (the trainer's state has a dozen
    # tensors): the training thread waits for the copy, so the torn snapshot is that of the
    # step after the last one logged. "copied" pass 4 is the 4th snapshot (step 4: the
    # policy's first multiple is step 1), copied
    # and checksummed but not committed (its step may be logged: take() waits for the copy
    # only, the commit word follows on the worker).
    log = tmp_path / "torn.log"
    proc = _trainer(trainers, tmp_path, shm_root, "torn", 40, log,
                    env={"CKPT_FAULT_POINT": point})
    assert proc.finish(120) == -signal.SIGKILL
    last_done = int([p for p in _lines(log) if p[0] == "done"][-1][1])
    torn_step = last_done + 1 if point.startswith("snapshot.tensor") else 4
    assert torn_step >= 2 and last_done in (torn_step - 1, torn_step)
    store = CheckpointStore.open(tmp_path / "store", memory_tier_dir=str(shm_root))
    try:
        state = store.load("torn@latest")
        assert state["step"] == torn_step - 1
    finally:
        store.close()
    proc = _trainer(trainers, tmp_path, shm_root, "torn", 6, log)
    assert proc.finish(120) == 0, proc.stderr()
    resumed = [p for p in _lines(log) if p[0] == "resumed"][-1]
    assert resumed == ["resumed", str(torn_step - 1), reference[torn_step - 1]]



@pytest.mark.slow
def test_node_lost_after_sigkill_resumes_from_the_neighbours_replica(
    tmp_path: Path, shm_root: Path, reference: dict[int, str],
    trainers: multiprocessing.context.BaseContext,
) -> None:
    from ckptstore.ops.writing.snapshot_peer import SnapshotReplicaServer

    neighbour = CheckpointStore.open(tmp_path / "store", memory_tier_dir=str(shm_root / "b"))
    server = SnapshotReplicaServer(neighbour)
    try:
        env = {"TRAINER_PEER": f"127.0.0.1:{server.address[1]}", "TRAINER_PAUSE": "0.05"}
        log = tmp_path / "peer.log"
        proc = _trainer(trainers, tmp_path, shm_root / "a", "peer", REFERENCE_STEPS, log,
                        env=env)
        deadline = time.monotonic() + 120
        while proc.running() and time.monotonic() < deadline:
            if log.exists() and sum(1 for p in _lines(log) if p[0] == "done") >= 12:
                break
            time.sleep(0.01)
        proc.kill()
        last_done = int([p for p in _lines(log) if p[0] == "done"][-1][1])
        shutil.rmtree(shm_root / "a")  # the node is lost with its memory
        # The replacement: a new, empty shared memory; 2 steps are enough to see it resume.
        proc = _trainer(trainers, tmp_path, shm_root / "c", "peer", last_done + 3, log,
                        env=env)
        assert proc.finish(120) == 0, proc.stderr()
        resumed = [p for p in _lines(log) if p[0] == "resumed"][-1]
        step = int(resumed[1])
        # At most one snapshot interval: the neighbour acknowledged step k - 1 before
        # mgr.step(k) returned.
        assert last_done - 1 <= step <= last_done + 1, (step, last_done)
        assert reference[step] == resumed[2]
    finally:
        server.close()
        neighbour.close()


def test_restart_keeps_the_previous_snapshot_until_a_newer_one_is_committed(
    snap_store: CheckpointStore,
) -> None:
    w = torch.zeros(512)
    _run(snap_store, range(1, 4), w, snapshot_interval=1)
    before = {p.name: p.stat().st_ino for p in snapshot_dir(snap_store, "r").iterdir()}
    mgr = CheckpointManager(snap_store, "r", snapshot_interval=1, handle_sigterm=False,
                            history=False)
    try:
        assert mgr.restore_latest()["step"] == 3
        w.add_(1)
        mgr.step(4, lambda: _state(w, 4))
        mgr.snapshots.flush()  # type: ignore[union-attr]
        # The slot files were adopted (same inodes), and the step-3 snapshot stayed readable
        # while step 4 was written into another slot.
        after = {p.name: p.stat().st_ino for p in snapshot_dir(snap_store, "r").iterdir()}
        assert after == before
        assert [f.step for f in snapshots_here(snap_store, "r")][:2] == [4, 3]
    finally:
        mgr.close()


def test_partial_and_in_place_loads_of_a_snapshot(snap_store: CheckpointStore) -> None:
    w = torch.arange(64, dtype=torch.float32)
    _run(snap_store, range(1, 3), w, snapshot_interval=1)
    part = snap_store.load("r@latest", keys=["model/w"])
    assert set(part) == {"model"} and set(part["model"]) == {"w"}
    assert torch.equal(part["model"]["w"], w)
    # A live tensor of another shape is not overwritten: the loaded one is fresh.
    live = {"model": {"w": torch.zeros(3), "b": torch.zeros(10, dtype=torch.bfloat16)}}
    got = snap_store.load("r@latest", into=live)
    assert got["model"]["w"] is not live["model"]["w"] and torch.equal(got["model"]["w"], w)
    assert got["model"]["b"] is live["model"]["b"]
    assert torch.equal(live["model"]["b"], w[:10].to(torch.bfloat16))
