"""Asynchronous snapshot copies (``snapshot_async=True``): ``step()`` returns before the copy,
the copy is waited for before anything changes the state, a failed copy is reported at the
next wait and is never visible, and a crash during a pending copy keeps the previous snapshot.

The shared logic (scheduling, waiting, errors, commit) is exercised with CPU tensors; the
CUDA branch (side stream, pinned staging) has one test that runs only with a device.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from ckptstore.errors import ConfigError, SnapshotError
from ckptstore.hooks.manager import CheckpointManager
from ckptstore.ops.writing.snapshot import (
    newest_snapshot,
    read_snapshot,
    snapshot_dir,
    snapshots_here,
)
from ckptstore.store import CheckpointStore

TRAINER = Path(__file__).with_name("snapshot_trainer.py")
#: Longest a test waits for the copier to reach or leave a point (a hang, not a timing).
WAIT_S = 30.0


class HeldCopier:
    """``before_copy`` hook that holds the copier at the start of each copy until released.

    Attributes:
        entered: Set when the copier has reached the hold (the copy has not started).
        release: The test sets it to let the copy go on.
        steps: The steps whose copies reached the hold.
    """

    def __init__(self, released: bool = False) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()
        if released:
            self.release.set()
        self.steps: list[int] = []

    def __call__(self, step: int) -> None:
        self.steps.append(step)
        self.entered.set()
        if not self.release.wait(WAIT_S):
            raise RuntimeError("the test never released the copier")


def _manager(store: CheckpointStore, **kw: Any) -> CheckpointManager:
    return CheckpointManager(store, "r", snapshot_interval=1, snapshot_async=True,
                             handle_sigterm=False, history=False, **kw)


def _hold(mgr: CheckpointManager, hold: Any) -> None:
    assert mgr.snapshots is not None
    mgr.snapshots.before_copy = hold


def _newest_state(store: CheckpointStore) -> tuple[int, Any]:
    found = newest_snapshot(store, "r")
    assert found is not None
    return found.step, read_snapshot(found)


def test_async_snapshots_are_bit_exact_with_the_optimizer_guarded(
    snap_store: CheckpointStore,
) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 64)
    opt = torch.optim.AdamW(model.parameters())
    mgr = _manager(snap_store, save_interval=4, optimizer=opt)

    def state() -> dict[str, Any]:
        return {"model": model.state_dict(), "optim": opt.state_dict()}

    try:
        for step in range(1, 8):
            opt.zero_grad()
            model(torch.ones(2, 64) * step).sum().backward()
            opt.step()  # the pre-hook waits for the previous snapshot's copy first
            mgr.step(step, state)
            expected = {k: v.clone() for k, v in model.state_dict().items()}
            moments = {k: v.clone() for k, v in opt.state_dict()["state"][0].items()}
            mgr.wait_snapshot()
            got_step, got = _newest_state(snap_store)
            assert got_step == step
            assert all(torch.equal(got["model"][k], expected[k]) for k in expected)
            assert all(torch.equal(got["optim"]["state"][0][k], moments[k]) for k in moments)
    finally:
        mgr.close()
    # Durable saves (every 4 steps) are written from the async snapshots, bit-exact too.
    assert sorted(ck.step for ck in snap_store.list(run="r")) == [4]
    latest = snap_store.load("r@latest")["model"]
    assert all(torch.equal(latest[k], expected[k]) for k in expected)


def test_step_returns_while_the_copy_is_pending_and_the_slot_is_invisible(
    snap_store: CheckpointStore,
) -> None:
    w = torch.zeros(4096)
    mgr = _manager(snap_store)
    hold = HeldCopier()
    _hold(mgr, hold)
    try:
        w.add_(1)
        mgr.step(1, lambda: {"w": w, "step": 1})  # returns with the copier held
        assert hold.entered.wait(WAIT_S)
        assert snapshots_here(snap_store, "r") == []  # the slot's header is odd: invisible
        hold.release.set()
        mgr.wait_snapshot()
        assert _newest_state(snap_store)[0] == 1

        hold.entered.clear()
        hold.release.clear()
        w.add_(1)
        mgr.step(2, lambda: {"w": w, "step": 2})
        assert hold.entered.wait(WAIT_S)
        # Step 2's slot is being written: step 1 stays the newest (double buffering).
        assert [f.step for f in snapshots_here(snap_store, "r")] == [1]
        hold.release.set()
        mgr.wait_snapshot()
        step, got = _newest_state(snap_store)
        assert step == 2 and got["step"] == 2 and torch.equal(got["w"], w)
        assert hold.steps == [1, 2]
    finally:
        hold.release.set()
        mgr.close()


def _sgd_model() -> tuple[torch.nn.Parameter, torch.optim.Optimizer]:
    p = torch.nn.Parameter(torch.arange(1024, dtype=torch.float32))
    opt = torch.optim.SGD([p], lr=1.0)
    p.grad = torch.full_like(p, -100.0)  # each opt.step() adds 100 in place
    return p, opt


def test_unguarded_in_place_step_tears_the_snapshot(snap_store: CheckpointStore) -> None:
    # The control for the next test: without optimizer= (and no wait_snapshot() call) an
    # optimizer step during the pending copy lands in the snapshot of the step before it.
    p, opt = _sgd_model()
    before = p.detach().clone()
    mgr = _manager(snap_store)
    hold = HeldCopier()
    _hold(mgr, hold)
    try:
        mgr.step(1, lambda: {"p": p.detach()})
        assert hold.entered.wait(WAIT_S)
        opt.step()  # not guarded: mutates while the copy is pending
        hold.release.set()
        mgr.wait_snapshot()
        got = _newest_state(snap_store)[1]["p"]
        assert not torch.equal(got, before) and torch.equal(got, p.detach())
    finally:
        hold.release.set()
        mgr.close()


def test_optimizer_pre_hook_waits_for_the_copy_before_the_step_mutates(
    snap_store: CheckpointStore,
) -> None:
    p, opt = _sgd_model()
    before = p.detach().clone()
    mgr = _manager(snap_store, optimizer=opt)
    hold = HeldCopier()
    _hold(mgr, hold)
    errors: list[BaseException] = []

    def optimizer_step() -> None:
        try:
            opt.step()
        except BaseException as exc:  # reported by the assertion below
            errors.append(exc)

    try:
        mgr.step(1, lambda: {"p": p.detach()})
        assert hold.entered.wait(WAIT_S)
        stepper = threading.Thread(target=optimizer_step)
        stepper.start()
        # The copy cannot finish while held, so the guarded step cannot have run (the join
        # only gives an unguarded step the time to show itself; it is no proof by timing).
        stepper.join(0.3)
        assert stepper.is_alive() and torch.equal(p.detach(), before)
        hold.release.set()
        stepper.join(WAIT_S)
        assert not stepper.is_alive() and not errors
        mgr.wait_snapshot()
        assert torch.equal(_newest_state(snap_store)[1]["p"], before)  # not torn
        assert torch.equal(p.detach(), before + 100)  # the step ran after the copy
    finally:
        hold.release.set()
        mgr.close()


def test_copier_failure_surfaces_at_the_next_wait_and_nothing_torn_is_visible(
    snap_store: CheckpointStore,
) -> None:
    w = torch.zeros(256)

    def fail_at_two(step: int) -> None:
        if step in (2, 5):
            raise RuntimeError("copier broke")

    mgr = _manager(snap_store)
    _hold(mgr, fail_at_two)
    try:
        for step in (1, 2):
            mgr.wait_snapshot()  # the contract: no in-place change during a pending copy
            w.fill_(step)
            mgr.step(step, lambda step=step: {"w": w, "step": step})  # step 2 returns too
        with pytest.raises(SnapshotError, match=r"step 2.*copier broke") as info:
            mgr.wait_snapshot()
        assert isinstance(info.value.__cause__, RuntimeError)
        # The failed slot stays invisible: step 1 is the newest, bit-exact.
        assert [f.step for f in snapshots_here(snap_store, "r")] == [1]
        step, got = _newest_state(snap_store)
        assert step == 1 and torch.equal(got["w"], torch.ones(256))
        mgr.wait_snapshot()  # raised once
        # The next snapshot works; a failure is also raised by the next step() itself.
        w.fill_(3)
        mgr.step(3, lambda: {"w": w, "step": 3})
        mgr.wait_snapshot()
        assert _newest_state(snap_store)[0] == 3
        w.fill_(5)
        mgr.step(5, lambda: {"w": w, "step": 5})  # fails on the copier
        with pytest.raises(SnapshotError, match="step 5"):
            mgr.step(6, lambda: {"w": w, "step": 6})
        assert _newest_state(snap_store)[0] == 3
    finally:
        mgr.close()


@pytest.mark.slow
def test_sigkill_during_a_pending_copy_keeps_the_previous_snapshot(
    tmp_path: Path, shm_root: Path,
) -> None:
    # The trainer snapshots every step with the optimizer guarded; its copier kills the
    # process in the middle of a copy (tensor pass 40: the 3rd or 4th snapshot). mgr.step()
    # of that step may already have returned and logged it: the copy was pending.
    log = tmp_path / "async.log"
    env = {**os.environ, "TRAINER_ASYNC": "1", "CKPT_FAULT_POINT": "snapshot.tensor:40"}
    proc = subprocess.run(
        [sys.executable, str(TRAINER), str(tmp_path / "store"), str(shm_root), "torn", "40",
         str(log)], env=env, capture_output=True, timeout=120, check=False)
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()
    done = {int(p[1]): p[2] for p in (ln.split() for ln in log.read_text().splitlines())
            if p[0] == "done"}
    last_done = max(done)
    store = CheckpointStore.open(tmp_path / "store", memory_tier_dir=str(shm_root))
    try:
        found = newest_snapshot(store, "torn")
        assert found is not None
        # The torn step is last_done (its step() returned) or last_done + 1: the newest
        # visible snapshot is the one before it, whole.
        assert found.step in (last_done - 1, last_done)
        assert store.load("torn@latest")["step"] == found.step
    finally:
        store.close()
    # A restart resumes from it bit-exact (the digest the killed run logged for that step).
    log2 = tmp_path / "resume.log"
    proc = subprocess.run(
        [sys.executable, str(TRAINER), str(tmp_path / "store"), str(shm_root), "torn",
         str(found.step + 3), str(log2)],
        env={**os.environ, "TRAINER_ASYNC": "1"}, capture_output=True, timeout=120,
        check=False)
    assert proc.returncode == 0, proc.stderr.decode()
    resumed = [ln.split() for ln in log2.read_text().splitlines() if ln.startswith("resumed")]
    assert resumed == [["resumed", str(found.step), done[found.step]]]


def test_async_options_are_checked(snap_store: CheckpointStore) -> None:
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1)
    with pytest.raises(ConfigError, match="snapshot_interval"):
        CheckpointManager(snap_store, "r", snapshot_async=True, handle_sigterm=False)
    with pytest.raises(ConfigError, match="snapshot_async=True"):
        CheckpointManager(snap_store, "r", snapshot_interval=1, optimizer=opt,
                          handle_sigterm=False)
    with pytest.raises(ConfigError, match=r"torch\.optim\.Optimizer"):
        _manager(snap_store, optimizer=object())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_side_stream_copy_is_bit_exact(snap_store: CheckpointStore) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(256, 256).cuda()
    opt = torch.optim.AdamW(model.parameters())
    mgr = _manager(snap_store, optimizer=opt)
    try:
        for step in range(1, 5):
            opt.zero_grad()
            model(torch.ones(8, 256, device="cuda") * step).sum().backward()
            opt.step()
            mgr.step(step, lambda: {"model": model.state_dict()})
            expected = {k: v.detach().cpu() for k, v in model.state_dict().items()}
            mgr.wait_snapshot()
            got = _newest_state(snap_store)[1]["model"]
            assert all(torch.equal(got[k], expected[k]) for k in expected)
        assert mgr.snapshots is not None and mgr.snapshots._staging  # pinned, reused
        assert all(t.is_pinned() for t in mgr.snapshots._staging.values())
    finally:
        mgr.close()
    assert snapshot_dir(snap_store, "r").is_dir()
