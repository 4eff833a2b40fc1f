"""How fast the ``ckpt`` command answers: fresh processes, against a bare interpreter.

Each command runs in a fresh process (as a user's shell starts it) several times; the
median wall time is compared with a bare ``python -c pass`` timed in the same run, so the
figures say what ckptstore adds on top of starting Python on this machine, whatever its
load:

* ``ckpt --version``                       target: <= +0.3 s over bare Python
* ``ckpt ls --json --limit 100``, ``ckpt ls --json --run R`` and ``ckpt show REF --json`` on
  a catalog of 100,000 committed checkpoints (1,000 runs)   target: <= +1.0 s
* ``ckpt --help`` and tab completion (``ckpt l<TAB>``), for information.

The catalog is filled in bulk the way ``bench_catalog.py`` fills it (SQLAlchemy Core inserts
into a store's embedded SQLite catalog); ``show`` is asked for a checkpoint saved for real
through the API, so its manifest is on disk.

Usage::

    python benchmarks/bench_cli_startup.py             # 100,000 checkpoints, 7 runs each
    python benchmarks/bench_cli_startup.py --quick     # 10,000 checkpoints, 3 runs each
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

VERSION_TARGET_S = 0.3
QUERY_TARGET_S = 1.0


def _wall(argv: list[str], env: dict[str, str], repeats: int) -> float:
    """Median wall seconds of ``argv`` in fresh processes (one untimed warm-up run first, so
    the page cache holds the interpreter and the packages, as on a machine in use)."""
    times = []
    for i in range(repeats + 1):
        start = time.perf_counter()
        proc = subprocess.run(argv, env=env, stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True, timeout=600)
        elapsed = time.perf_counter() - start
        if proc.returncode != 0:
            raise SystemExit(f"{' '.join(argv)} failed ({proc.returncode}): {proc.stderr}")
        if i:
            times.append(elapsed)
    return statistics.median(times)


def _make_store(root: Path, n_ckpts: int, n_runs: int) -> str:
    """A store with ``n_ckpts`` catalogued checkpoints and one real one; returns its ref."""
    import torch

    from benchmarks.bench_catalog import fill
    from ckptstore.catalog import Catalog
    from ckptstore.store import CheckpointStore

    with CheckpointStore.open(root) as store:
        url = store.settings.resolved_catalog_url
    cat = Catalog(url)
    try:
        start = time.perf_counter()
        fill(cat, n_ckpts, n_runs, chain_depth=min(100, n_runs))
        print(f"filled {n_ckpts:,} checkpoints / {n_runs:,} runs in "
              f"{time.perf_counter() - start:.1f} s", file=sys.stderr)
    finally:
        cat.close()
    with CheckpointStore.open(root) as store:
        store.save("real", step=1, state={"w": torch.ones(1024), "b": torch.zeros(16)},
                   metrics={"loss": 1.0})
    return "real@latest"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--checkpoints", type=int, default=100_000)
    parser.add_argument("--runs", type=int, default=1_000)
    parser.add_argument("--repeats", type=int, default=7, help="timed runs per command")
    parser.add_argument("--quick", action="store_true",
                        help="10,000 checkpoints, 200 runs, 3 runs per command (smoke)")
    args = parser.parse_args(argv)
    if args.quick:
        args.checkpoints, args.runs, args.repeats = 10_000, 200, 3

    py = sys.executable
    with tempfile.TemporaryDirectory(prefix="ckpt-bench-cli-") as tmp:
        root = Path(tmp) / "store"
        ref = _make_store(root, args.checkpoints, args.runs)
        env = {k: v for k, v in os.environ.items() if not k.startswith("CKPT_")}
        env["CKPT_ROOT"] = str(root)
        ckpt = [py, "-m", "ckptstore"]
        complete = {**env, "_CKPT_COMPLETE": "complete_bash", "COMP_WORDS": "ckpt l",
                    "COMP_CWORD": "1"}
        load_before = os.getloadavg()[0]
        bare = _wall([py, "-c", "pass"], env, args.repeats)
        cases: list[tuple[str, list[str], dict[str, str], float | None]] = [
            ("ckpt --version", [*ckpt, "--version"], env, VERSION_TARGET_S),
            ("ckpt --help", [*ckpt, "--help"], env, None),
            ("ckpt l<TAB> (completion)", ckpt, complete, None),
            ("ckpt ls --json --limit 100", [*ckpt, "ls", "--json", "--limit", "100"], env,
             QUERY_TARGET_S),
            ("ckpt ls --json --run run-0100", [*ckpt, "ls", "--json", "--run", "run-0100"],
             env, QUERY_TARGET_S),
            (f"ckpt show {ref} --json", [*ckpt, "show", ref, "--json"], env, QUERY_TARGET_S),
        ]
        rows = [(name, _wall(argv, e, args.repeats), target) for name, argv, e, target in cases]

    print(f"\n{args.checkpoints:,} checkpoints, median of {args.repeats} fresh processes; "
          f"bare `python -c pass`: {bare:.3f} s")
    print(f"{'command':<34} {'wall s':>7} {'+ s':>7} {'ratio':>6} {'target':>8}  result")
    print("-" * 80)
    missed = 0
    for name, wall, target in rows:
        extra = wall - bare
        verdict = "-" if target is None else ("met" if extra <= target else "missed")
        missed += verdict == "missed"
        shown = "-" if target is None else f"+{target:.1f} s"
        print(f"{name:<34} {wall:7.3f} {extra:+7.3f} {wall / bare:6.1f} {shown:>8}  {verdict}")
    print(f"\nload average (1 min): {load_before:.1f} before, {os.getloadavg()[0]:.1f} after")
    return 1 if missed else 0


if __name__ == "__main__":
    raise SystemExit(main())
