"""``process_support``: a test's multiprocessing children and their forkserver end with it."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

CHILD_AND_SERVER = """
import json, multiprocessing, os, sys, time
from multiprocessing import forkserver, util
from process_support import end_children, stop_forkserver

if __name__ == "__main__":
    ctx = multiprocessing.get_context("forkserver")
    child = ctx.Process(target=time.sleep, args=(300,), daemon=True)
    child.start()
    server = forkserver._forkserver._forkserver_pid
    report = {"child": child.pid, "server": server, "ended": end_children(),
              "stopped": stop_forkserver(), "again": stop_forkserver(),
              "tempdir": util.get_temp_dir()}
    print(json.dumps(report), flush=True)
    # Exit as a killed test process does: no atexit handler ends the children for us.
    os._exit(0)
"""


def _gone(pid: int, timeout: float = 10.0) -> bool:
    """The process no longer runs (reaped, or a zombie waiting for init)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except FileNotFoundError:
            return True
        if state == "Z":
            return True
        time.sleep(0.05)
    return False


def test_a_left_child_and_its_forkserver_are_ended() -> None:
    tests = str(Path(__file__).parent)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([tests, os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", CHILD_AND_SERVER], env=env, cwd=tests,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    # The child's multiprocessing temporary directory: the exit handler that removes it did
    # not run (os._exit), so the test removes it rather than leave a pymp-* in /tmp.
    shutil.rmtree(report["tempdir"])
    assert report["ended"] == [report["child"]]
    assert report["stopped"] == report["server"] and report["again"] is None
    assert _gone(report["child"]) and _gone(report["server"])
