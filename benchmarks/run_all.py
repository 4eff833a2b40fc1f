"""Run every benchmark in sequence (what ``make bench`` runs).

``bench_save_load.py`` runs first, then every other ``benchmarks/bench_*.py`` in name order,
each in its own Python process (so one benchmark's memory and imports cannot skew the next),
with its output, tables included, streamed through as it runs. ``--quick`` is passed to every
script; ``--rounds`` only to ``bench_save_load.py``.

Usage::

    python benchmarks/run_all.py [--quick] [--rounds N]

Exit status: 0 when every benchmark exited 0, else 1.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

__all__ = ["main", "scripts"]

HERE = Path(__file__).resolve().parent
FIRST = "bench_save_load.py"


def scripts(directory: Path = HERE) -> list[Path]:
    """The benchmark scripts in run order: the save/load benchmark, then the rest by name.

    Args:
        directory: Folder holding the ``bench_*.py`` scripts.

    Returns:
        Script paths.
    """
    rest = sorted(p for p in directory.glob("bench_*.py") if p.name != FIRST)
    first = directory / FIRST
    return ([first] if first.exists() else []) + rest


def main(argv: list[str] | None = None) -> int:
    """Run the benchmarks; return 0 if all succeeded."""
    p = argparse.ArgumentParser(description="Run every benchmark in sequence.")
    p.add_argument("--quick", action="store_true", help="small sizes, for a CI smoke test")
    p.add_argument("--rounds", type=int, default=None,
                   help=f"rounds for {FIRST} (default: its own)")
    args = p.parse_args(argv)

    summary: list[tuple[str, int, float]] = []
    for script in scripts():
        cmd = [sys.executable, str(script)]
        if args.quick:
            cmd.append("--quick")
        if args.rounds is not None and script.name == FIRST:
            cmd += ["--rounds", str(args.rounds)]
        print(f"\n==== {script.name} {' '.join(cmd[2:])}".rstrip(), flush=True)
        start = time.perf_counter()
        # Inherit stdout/stderr: each benchmark prints its own table as it finishes.
        rc = subprocess.run(cmd, check=False).returncode
        summary.append((script.name, rc, time.perf_counter() - start))

    print("\n==== summary")
    for name, rc, seconds in summary:
        status = "ok" if rc == 0 else f"FAILED (exit {rc})"
        print(f"- {name}: {status}, {seconds:.0f} s")
    return 0 if all(rc == 0 for _, rc, _ in summary) else 1


if __name__ == "__main__":
    sys.exit(main())
