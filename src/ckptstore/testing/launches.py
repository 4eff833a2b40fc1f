"""Ending a ``torchrun`` launch the way a lost node ends: SIGKILL, its workers included.

torchrun starts each worker in a session of its own, so killing torchrun's process group
leaves the workers running (and holding their ports, shared memory and files). Whoever
simulates a lost node (tests/hooks/test_snapshot_world.py, benchmarks/bench_node_loss.py)
knows the workers' pids from their own logs and kills them first, each pinned by a pidfd so
a pid reused meanwhile by another process is never signalled.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import subprocess
from collections.abc import Iterable
from pathlib import Path

__all__ = ["kill_launch"]


def kill_launch(launch: subprocess.Popen[bytes], workers: Iterable[int], script: str,
                timeout_s: float) -> None:
    """SIGKILL the workers, then the launch's process group; wait until all are gone.

    Args:
        launch: The ``torchrun`` process, started with ``start_new_session=True``.
        workers: Pids the workers logged (gone ones are skipped).
        script: A string of the workers' command line: a pid whose command line lacks it
            is another process's now, and is left alone.
        timeout_s: Longest wait for each process to be gone.

    Raises:
        RuntimeError: If a worker is still alive ``timeout_s`` after its SIGKILL.
        subprocess.TimeoutExpired: If the launch is.
    """
    for pid in workers:
        try:
            fd = os.pidfd_open(pid)
        except ProcessLookupError:
            continue
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
            if script in cmdline:
                os.kill(pid, signal.SIGKILL)
                if not select.select([fd], [], [], timeout_s)[0]:
                    raise RuntimeError(f"worker {pid} survived SIGKILL for {timeout_s} s")
        except (ProcessLookupError, FileNotFoundError):
            pass
        finally:
            os.close(fd)
    if launch.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(launch.pid, signal.SIGKILL)
        launch.wait(timeout=timeout_s)
