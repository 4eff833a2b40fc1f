"""Preemption: a real training process gets SIGTERM, saves at its next step and exits 143."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from ckptstore.store import CheckpointStore

SCRIPT = textwrap.dedent(
    """
    import sys, time
    import torch
    from ckptstore.store import CheckpointStore
    from ckptstore.hooks.manager import CheckpointManager

    store = CheckpointStore.open(sys.argv[1])
    model = torch.nn.Linear(4, 2)
    with torch.no_grad():
        model.weight.zero_()
    with CheckpointManager(store, "preempt", save_interval=10_000) as mgr:
        for step in range(1, 100_000):
            with torch.no_grad():
                model.weight.add_(1.0)
            mgr.step(step, lambda: {"model": model.state_dict(), "step": step})
            if step == 5:
                print("ready", flush=True)
            time.sleep(0.01)
    print("loop finished without preemption", flush=True)
    """
)


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")
def test_sigterm_makes_a_final_save_and_exits(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    root = tmp_path / "store"
    proc = subprocess.Popen(
        [sys.executable, str(script), str(root)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        assert proc.stdout is not None
        deadline = time.monotonic() + 120
        line = ""
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if line.strip() == "ready" or not line:
                break
        assert line.strip() == "ready", proc.stderr.read() if proc.stderr else ""
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert "loop finished" not in out
    assert "SIGTERM received" in err and "preemption save" in err
    store = CheckpointStore.open(root)
    try:
        ck = store.latest("preempt")
        assert ck.tags == ("preempted",)
        state = store.load(ck.id)
        assert state["step"] == ck.step >= 5
        # The saved weights are those of the step it was saved at (weights = step).
        assert torch.equal(state["model"]["weight"], torch.full((2, 4), float(ck.step)))
    finally:
        store.close()
