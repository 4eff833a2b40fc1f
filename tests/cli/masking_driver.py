"""Runs several ``ckpt`` command lines in one process, as ``ckpt`` itself runs them.

Used by test_secret_masking.py and test_conventions.py: starting the CLI once per command
line would cost seconds each on a loaded machine. Each argument is one command line (JSON:
``{"args": [...], "env": {...}}``); every run is framed by ``=== <n>`` lines on stdout and
stderr and its exit code is printed as ``=== <n> exit <code>`` on stdout. Logging is
configured by the CLI itself (``--verbose``, ``CKPT_LOG_JSON``), so log lines reach stderr as
they would.

test_secret_masking.py runs :func:`run_in_child` in children of a forkserver that preloaded
the heavy third-party packages (torch, SQLAlchemy, ...; none of ckptstore, rich or typer, whose
modules read the environment or set up consoles when imported): the CLI is imported and
configures its logging in the child, as in ``ckpt``.
"""

from __future__ import annotations

import json
import os
import sys

from ckptstore.cli.app import main


def run(lines: list[str]) -> None:
    """Run each command line (JSON) in order."""
    for n, line in enumerate(lines):
        spec = json.loads(line)
        saved = {k: os.environ.get(k) for k in spec.get("env", {})}
        os.environ.update(spec.get("env", {}))
        print(f"=== {n}", flush=True)
        print(f"=== {n}", file=sys.stderr, flush=True)
        try:
            code = main(spec["args"])
        finally:
            for key, value in saved.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value
        sys.stderr.flush()
        print(f"=== {n} exit {code}", flush=True)


def run_in_child(lines: list[str], env: dict[str, str], drop: list[str], cwd: str,
                 out: str, err: str) -> None:
    """:func:`run` in a :mod:`multiprocessing` child: the variables ``drop`` removed from the
    environment and ``env`` added, in the directory ``cwd``, stdout and stderr written to the
    files ``out`` and ``err``."""
    for var in drop:
        os.environ.pop(var, None)
    os.environ.update(env)
    os.chdir(cwd)
    for path, target in ((out, 1), (err, 2)):
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(fd, target)
        os.close(fd)
    run(lines)


if __name__ == "__main__":
    run(sys.argv[1:])
