"""What a training process prints about the archive flows it triggers: one line, never a
traceback, whether the flow cannot start (no warm tier), finishes before the store closes, or
is left behind by a process that exits without closing its store.

Each scenario runs in a subprocess, as a user's script does, so the interpreter's shutdown,
where a flow can no longer run (flows/embedded.py), is part of what is checked.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ckptstore import CheckpointStore

TRAINER = """
import json, sys
from pathlib import Path

import torch

from ckptstore import CheckpointStore
from ckptstore.hooks.manager import CheckpointManager

root, warm, close = Path(sys.argv[1]), sys.argv[2] == "warm", sys.argv[3] == "close"
config = root / "ckptstore.toml"
root.mkdir(parents=True)
warm_dir = root / "warm"
tiers = f'[tiers]\\nwarm = "{warm_dir}"\\n' if warm else ""
config.write_text(f'root = "{root}"\\n' + tiers)
store = CheckpointStore.open(config=config)
with CheckpointManager(store, "r", save_interval=1, archive=True, handle_sigterm=False) as mgr:
    for step in (1, 2, 3):
        mgr.step(step, lambda: {"w": torch.full((4,), float(step))})
ref = store.latest("r").id
if close:
    store.close()
print(json.dumps({"ref": ref, "prefect_imported": "prefect" in sys.modules}))
"""


def _train(tmp_path: Path, *, warm: bool, close: bool) -> tuple[dict[str, object], list[str]]:
    """Run the trainer; return its report and its stderr lines (which must be clean)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("CKPT_")}
    env.pop("PREFECT_API_URL", None)  # embedded mode, as for a user without a server
    proc = subprocess.run(
        [sys.executable, "-c", TRAINER, str(tmp_path / "store"), "warm" if warm else "hot",
         "close" if close else "leave-open"],
        env=env, capture_output=True, text=True, timeout=240,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-4000:]
    assert "Logging error" not in proc.stderr, proc.stderr[-4000:]
    report: dict[str, object] = json.loads(proc.stdout.strip().splitlines()[-1])
    return report, [line for line in proc.stderr.splitlines() if line.strip()]


def test_no_warm_tier_is_one_line_and_starts_no_flow(tmp_path: Path) -> None:
    report, lines = _train(tmp_path, warm=False, close=True)
    assert lines == [
        "checkpoints of run r are not archived: cannot start the archive flow: tier 'warm' "
        "is not configured; set it under [tiers] in the config"
    ]
    assert report["prefect_imported"] is False  # no flow was started to fail in the background


@pytest.mark.slow
def test_close_waits_for_the_triggered_archives(tmp_path: Path) -> None:
    report, _ = _train(tmp_path, warm=True, close=True)
    with CheckpointStore.open(config=tmp_path / "store" / "ckptstore.toml") as store:
        assert "warm" in store.get(str(report["ref"])).tiers


def test_archives_left_at_exit_are_one_line_each(tmp_path: Path) -> None:
    _, lines = _train(tmp_path, warm=True, close=False)
    assert len(lines) == 3, lines  # three commits, three archives queued or running
    assert all(line.startswith("flow archive for ") for line in lines), lines
    assert all("close the store before the process exits" in line for line in lines), lines
