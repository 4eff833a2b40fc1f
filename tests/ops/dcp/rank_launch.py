"""Starting one rank of a worker script (multinode_worker.py) as a child of a forkserver that
preloaded torch, torch.distributed and ckptstore: importing them costs seconds per fresh
interpreter on the 2-core machine, paid once by the server instead of once per rank.

The child is its own process, as one started by ``python <script> ARGS`` with ``env`` as its
whole environment: its environment, ``sys.argv``, standard output and error (into ``log``)
are set, then the script runs as ``__main__``; its ``sys.exit`` status is the exit code.
"""

from __future__ import annotations

import os
import runpy
import sys


def run_script(script: str, args: list[str], env: dict[str, str], log: str) -> None:
    """Run ``script`` with ``args`` in this (child) process, as described above."""
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    os.environ.clear()
    os.environ.update(env)
    torch = sys.modules.get("torch")
    if torch is not None and "OMP_NUM_THREADS" in env:
        # Read by torch when it is imported: the server imported it before this environment.
        torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
    sys.argv = [script, *args]
    runpy.run_path(script, run_name="__main__")
