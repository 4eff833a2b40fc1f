"""A training loop that archives every checkpoint, against the same loop that does not.

The loop: a tiny MLP (32 → 64 → 1, one SGD step on a fixed batch per step) under
``CheckpointManager(store, run, save_interval=10)`` for 300 steps (``--quick``: 100), so 30
saves; the store has a local warm tier. With ``archive=True`` each commit triggers the archive
flow, which the embedded runner (flows/embedded.py) runs on its background thread, with
Prefect's temporary server started once for the process.

Each variant runs in a fresh Python process (Prefect's import, its temporary server and the
runner are per process), the two alternating, the first of each pair rotating every round
(default 3 rounds; ``--quick``: 1). Per run:

* **loop**: from the manager's construction to its exit (the last save committed): what the
  training sees. The target is archive / plain ≤ 1.2 (median of the per-round ratios).
* **close**: ``store.close()``, which waits for the archives the loop triggered (nothing for
  the plain loop).
* **archived**: checkpoints with a warm replica after close (must equal the saves).
* **stderr lines**: what the process printed besides its report (must be 0: Prefect's lines
  go to ``<root>/logs/flows.log``).

Usage::

    python benchmarks/bench_archive_loop.py [--quick] [--rounds N] [--steps N] [--tmp DIR]

Prints a table; writes ``bench-out/archive_loop.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    # Run as a script: make ``benchmarks.*`` importable from the repository root.
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

__all__ = ["main"]

REPO = Path(__file__).resolve().parent.parent
SAVE_EVERY = 10
VARIANTS = ("plain", "archive")


def _child(root: Path, steps: int, archive: bool) -> dict[str, Any]:
    """One training run in this process; returns its timings."""
    import torch
    from torch import nn

    from ckptstore import CheckpointStore
    from ckptstore.hooks.manager import CheckpointManager
    from ckptstore.records import ReplicaState

    torch.set_num_threads(1)
    torch.manual_seed(0)
    root.mkdir(parents=True)
    config = root / "ckptstore.toml"
    config.write_text(f'root = "{root}"\n[tiers]\nwarm = "{root / "warm"}"\n')
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    x, y = torch.randn(16, 32), torch.randn(16, 1)
    store = CheckpointStore.open(config=config)
    started = time.perf_counter()
    with CheckpointManager(store, "bench", save_interval=SAVE_EVERY, archive=archive,
                           handle_sigterm=False) as mgr:
        for step in range(1, steps + 1):
            opt.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            mgr.step(step, lambda: {"model": model.state_dict()})
    loop_s = time.perf_counter() - started
    started = time.perf_counter()
    store.close()
    close_s = time.perf_counter() - started
    with CheckpointStore.open(config=config) as check:
        cks = check.list(run="bench")
        archived = sum(
            1 for ck in cks
            if (rep := ck.replica("warm")) is not None and rep.state == ReplicaState.PRESENT
        )
    return {"loop_s": loop_s, "close_s": close_s, "saves": len(cks), "archived": archived}


def _run_child(variant: str, tmp: Path, steps: int) -> dict[str, Any]:
    root = Path(tempfile.mkdtemp(prefix=f"{variant}-", dir=tmp)) / "store"
    env = {k: v for k, v in os.environ.items() if not k.startswith("CKPT_")}
    env.pop("PREFECT_API_URL", None)  # embedded, as a user without a Prefect server
    proc = subprocess.run(
        [sys.executable, str(Path(__file__).resolve()), "--child", variant, "--root", str(root),
         "--steps", str(steps)],
        env=env, capture_output=True, text=True, timeout=900, cwd=REPO,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"{variant} run failed:\n{proc.stderr[-3000:]}")
    out: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    out["stderr_lines"] = [line for line in proc.stderr.splitlines() if line.strip()]
    shutil.rmtree(root.parent, ignore_errors=True)
    return out


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; returns the exit status."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="100 steps, 1 round")
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--tmp", type=Path, default=REPO / "bench-out" / "tmp")
    parser.add_argument("--out", type=Path, default=REPO / "bench-out" / "archive_loop.json")
    parser.add_argument("--child", choices=VARIANTS, help=argparse.SUPPRESS)
    parser.add_argument("--root", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    steps = args.steps or (100 if args.quick else 300)
    if args.child is not None:
        print(json.dumps(_child(args.root, steps, args.child == "archive")))
        return 0
    rounds = args.rounds or (1 if args.quick else 3)
    args.tmp.mkdir(parents=True, exist_ok=True)
    runs: dict[str, list[dict[str, Any]]] = {v: [] for v in VARIANTS}
    ratios: list[float] = []
    for r in range(rounds):
        order = VARIANTS if r % 2 == 0 else VARIANTS[::-1]
        this = {v: _run_child(v, args.tmp, steps) for v in order}
        for v in VARIANTS:
            runs[v].append(this[v])
        ratios.append(this["archive"]["loop_s"] / this["plain"]["loop_s"])
    print(f"{steps} steps, a save every {SAVE_EVERY}, {rounds} round(s); median (min-max)")
    print(f"{'variant':<10} {'loop s':>18} {'close s':>18} {'saves':>6} {'archived':>9} "
          f"{'stderr':>7}")
    for v in VARIANTS:
        loop = [x["loop_s"] for x in runs[v]]
        close = [x["close_s"] for x in runs[v]]
        print(f"{v:<10} {_fmt(loop):>18} {_fmt(close):>18} {runs[v][-1]['saves']:>6} "
              f"{runs[v][-1]['archived']:>9} {max(len(x['stderr_lines']) for x in runs[v]):>7}")
    ratio = statistics.median(ratios)
    print(f"loop archive / plain: {ratio:.2f}x (target <= 1.2x)")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"steps": steps, "save_every": SAVE_EVERY, "runs": runs,
                                    "loop_ratios": ratios, "loop_ratio": ratio}, indent=2))
    bad = [line for x in runs["archive"] for line in x["stderr_lines"]]
    if bad:
        print("the archiving loop printed:\n" + "\n".join(bad[:20]), file=sys.stderr)
        return 1
    return 0


def _fmt(values: list[float]) -> str:
    mid = statistics.median(values)
    return f"{mid:.2f} ({min(values):.2f}-{max(values):.2f})" if len(values) > 1 else f"{mid:.2f}"


if __name__ == "__main__":
    raise SystemExit(main())
