"""What a training process prints about the archive flows it triggers: one line, never a
traceback, whether the flow cannot start (no warm tier), finishes before the store closes, or
is left behind by a process that exits without closing its store; and nothing of Prefect's
own (its run lines, its temporary server, its telemetry), which goes to the store's log file
instead, and to the console only when the process logs at INFO (``--verbose``).

Each scenario runs in a subprocess, as a user's script does, so the interpreter's shutdown,
where a flow can no longer run (flows/embedded.py), is part of what is checked. The
subprocess gets the environment of a user who set no Prefect setting: the suite's own
(tests/conftest.py quiets Prefect's logs and analytics) would hide what a user sees.
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
import json, os, sys
from pathlib import Path

import torch

from ckptstore import CheckpointStore
from ckptstore.hooks.manager import CheckpointManager

root, warm, close = Path(sys.argv[1]), sys.argv[2] == "warm", sys.argv[3] == "close"
if sys.argv[4] == "verbose":
    from ckptstore.cli.common import configure_logging

    configure_logging(True)  # what `ckpt --verbose` does
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
telemetry = {k: os.environ.get(k) for k in ("DO_NOT_TRACK", "PREFECT_SERVER_ANALYTICS_ENABLED")}
print(json.dumps({"ref": ref, "prefect_imported": "prefect" in sys.modules,
                  "telemetry": telemetry}))
"""

#: Settings the suite sets for itself that a user's training process would not have.
_SUITE_PREFECT_SETTINGS = ("PREFECT_SERVER_ANALYTICS_ENABLED", "PREFECT_LOGGING_LEVEL",
                           "DO_NOT_TRACK")
#: What Prefect prints on its own when left to its defaults.
_PREFECT_LINES = ("Failed to send telemetry", "temporary server", "Beginning flow run",
                  "Finished in state", " | INFO ", " | ERROR ")


def _train(tmp_path: Path, *, warm: bool, close: bool,
           verbose: bool = False) -> tuple[dict[str, object], list[str]]:
    """Run the trainer; return its report and its stderr lines (which must be clean)."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("CKPT_") and k not in _SUITE_PREFECT_SETTINGS}
    env.pop("PREFECT_API_URL", None)  # embedded mode, as for a user without a server
    proc = subprocess.run(
        [sys.executable, "-c", TRAINER, str(tmp_path / "store"), "warm" if warm else "hot",
         "close" if close else "leave-open", "verbose" if verbose else "quiet"],
        env=env, capture_output=True, text=True, timeout=240,
    )
    # stdout holds what the script prints, nothing else.
    assert len(proc.stdout.strip().splitlines()) == 1, proc.stdout[-4000:]
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
    report, lines = _train(tmp_path, warm=True, close=True)
    with CheckpointStore.open(config=tmp_path / "store" / "ckptstore.toml") as store:
        assert "warm" in store.get(str(report["ref"])).tiers
    # Prefect ran the three archives and said so, in the store's log file only.
    assert lines == []
    assert report["telemetry"] == {"DO_NOT_TRACK": "1", "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    log = (tmp_path / "store" / "logs" / "flows.log").read_text()
    assert log.count("Beginning flow run") == 3, log
    assert "flow run '" in log  # each run line names its run
    # One temporary server for the process, not one per archive.
    assert log.count("Starting temporary server") == 1, log
    assert log.count("Stopping temporary server") == 1, log
    assert "Failed to send telemetry" not in log


@pytest.mark.slow
def test_verbose_shows_prefects_lines(tmp_path: Path) -> None:
    _, lines = _train(tmp_path, warm=True, close=True, verbose=True)
    text = "\n".join(lines)
    assert text.count("Beginning flow run") == 3, text
    assert "Stopping temporary server" in text
    assert "Failed to send telemetry" not in text
    assert (tmp_path / "store" / "logs" / "flows.log").read_text().count("Beginning flow run") == 3


def test_archives_left_at_exit_are_one_line_each(tmp_path: Path) -> None:
    _, lines = _train(tmp_path, warm=True, close=False)
    assert len(lines) == 3, lines  # three commits, three archives queued or running
    assert all(line.startswith("flow archive for ") for line in lines), lines
    assert all("close the store before the process exits" in line for line in lines), lines
    assert not any(marker in line for line in lines for marker in _PREFECT_LINES), lines
