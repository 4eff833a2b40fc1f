"""Prefetch: time to the first training step after a restart, and evaluation sweeps.

Endpoint: a real moto S3 server on 127.0.0.1 as the warm tier
(:class:`ckptstore.testing.s3.MotoS3`); moto shares the CPUs with the benchmark, so absolute
times are far from real S3; the same-round ratios are what matter. ``run_all.py`` runs this
script like every ``bench_*.py``.

State: the synthetic transformer training state of ``bench_convert.py`` (fp32 weights +
AdamW moments).

* **first step after a restart** (checkpoint on the warm tier only, hot copy deleted as
  retention would): *without prefetch*: open the store, ``store.load(id)`` (restore from warm:
  copy, verify, record, then read), one training step (a matmul over the first weight);
  *with prefetch at queue time*: ``store.prefetch(id)`` runs while the job waits in the
  scheduler's queue (not timed), then the same restart is timed. Target: with / without
  <= 0.3.
* **evaluation sweep** over 10 checkpoints of one run, all on the warm tier only: sequential
  ``store.load`` + evaluate each, against ``store.iter_checkpoints(run, prefetch=2)`` +
  evaluate each. Evaluation is modelled as accelerator time during which the host waits
  (``time.sleep`` of a duration calibrated to one warm-tier load, as on a GPU node where
  evaluation barely uses the host CPUs). Target: prefetch / sequential <= 0.6.

Rounds alternate which variant runs first. Ratios are computed per round, then the median is
reported.

Usage::

    python benchmarks/bench_prefetch.py [--quick] [--rounds N] [--tmp DIR] [--out FILE]

Prints a table and the ratios; writes ``bench-out/prefetch.json``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    # Run as a script: make ``benchmarks.*`` importable from the repository root.
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from benchmarks.bench_convert import build_state
from benchmarks.harness import fmt_bytes, fmt_summary, release_free_memory
from benchmarks.state import state_bytes
from ckptstore import CheckpointStore
from ckptstore.ops.tiering.archive import archive_checkpoints
from ckptstore.ops.tiering.replicas import delete_replica
from ckptstore.records import Checkpoint, ReplicaState
from ckptstore.testing.s3 import MotoS3

__all__ = ["main"]

REPO = Path(__file__).resolve().parent.parent
SWEEP = 10
RESTART_TARGET = 0.3
SWEEP_TARGET = 0.6


def _drop_hot(store: CheckpointStore, ck: Checkpoint) -> None:
    current = store.get(ck.id)
    replica = current.replica("hot")
    if replica is not None and replica.state == ReplicaState.PRESENT:
        delete_replica(store, current, "hot")


def _train_step(state: dict[str, Any]) -> float:
    """One stand-in training step: a matmul over the first 2-D weight of the model."""
    weight = next(t for t in state["model"].values() if t.dim() == 2)
    x = torch.ones(8, weight.shape[1])
    return float((x @ weight.T).sum())


def _open(tmp: Path, s3: MotoS3) -> CheckpointStore:
    return CheckpointStore.open(tmp / "store", warm=s3.url("warm"),
                                storage_options=s3.storage_options, memory_tier_bytes=0)


def _restart(tmp: Path, s3: MotoS3, ckpt_id: str) -> float:
    """Seconds from a fresh process's store open to the end of its first training step."""
    started = time.perf_counter()
    store = _open(tmp, s3)
    try:
        _train_step(store.load(ckpt_id))
        return time.perf_counter() - started
    finally:
        store.close()


def _sweep(store: CheckpointStore, run: str, eval_s: float, prefetch: int) -> float:
    started = time.perf_counter()
    if prefetch:
        with store.iter_checkpoints(run, prefetch=prefetch) as sweep:
            for _ck, _state in sweep:
                time.sleep(eval_s)
    else:
        for ck in store.list(run=run, order_by="step"):
            store.load(ck.id)
            time.sleep(eval_s)
    return time.perf_counter() - started


def run(target_bytes: int, rounds: int, tmp: Path) -> dict[str, Any]:
    """Start moto, save the checkpoints once, then alternate the measured variants."""
    state = build_state(target_bytes)
    nbytes = state_bytes(state)
    with MotoS3(fail_fast=False) as s3:
        store = _open(tmp, s3)
        try:
            main = store.save("restart", 1, state, delta=False)
            del state
            # Distinct full saves: chunks shared through dedup would pin each other's hot
            # copies, and a sweep of real checkpoints shares few of them.
            sweep_cks = [
                store.save("sweep", step, build_state(max(target_bytes // SWEEP, 1_000_000),
                                                      seed=step + 1), delta=False)
                for step in range(SWEEP)
            ]
            release_free_memory()
            archive_checkpoints(store, tier="warm")
            for ck in [main, *sweep_cks]:
                _drop_hot(store, ck)
            # Warm-up: imports, S3 connections, first-call set-up; also calibrates the
            # evaluation time to one warm-tier load of a sweep checkpoint.
            started = time.perf_counter()
            store.load(sweep_cks[0].id)
            eval_s = time.perf_counter() - started
            _drop_hot(store, sweep_cks[0])
            times: dict[str, list[float]] = {k: [] for k in (
                "restart, no prefetch", "restart, prefetched at queue time",
                "sweep, sequential loads", "sweep, iter_checkpoints(prefetch=2)")}
            restart_ratios: list[float] = []
            sweep_ratios: list[float] = []
            for r in range(rounds):
                restart: dict[bool, float] = {}
                for prefetched in ((False, True) if r % 2 == 0 else (True, False)):
                    _drop_hot(store, main)
                    if prefetched:
                        store.prefetch(main.id)  # while the job is queued: not timed
                    restart[prefetched] = _restart(tmp, s3, main.id)
                times["restart, no prefetch"].append(restart[False])
                times["restart, prefetched at queue time"].append(restart[True])
                restart_ratios.append(restart[True] / restart[False])
                sweep: dict[int, float] = {}
                for ahead in ((0, 2) if r % 2 == 0 else (2, 0)):
                    for ck in sweep_cks:
                        _drop_hot(store, ck)
                    sweep[ahead] = _sweep(store, "sweep", eval_s, ahead)
                times["sweep, sequential loads"].append(sweep[0])
                times["sweep, iter_checkpoints(prefetch=2)"].append(sweep[2])
                sweep_ratios.append(sweep[2] / sweep[0])
        finally:
            store.close()
    return {
        "state_bytes": nbytes,
        "sweep_checkpoints": SWEEP,
        "eval_s": eval_s,
        "rounds": rounds,
        "times": times,
        "restart_ratio": statistics.median(restart_ratios),
        "sweep_ratio": statistics.median(sweep_ratios),
        "restart_target": RESTART_TARGET,
        "sweep_target": SWEEP_TARGET,
    }


def _print(result: dict[str, Any]) -> None:
    print(f"\nrestart checkpoint {fmt_bytes(result['state_bytes'])}; sweep of "
          f"{result['sweep_checkpoints']} checkpoints, evaluation {result['eval_s']:.3f}s each")
    print(f"\n| variant | seconds, median (min-max) over {result['rounds']} rounds |")
    print("|---|---|")
    for name, values in result["times"].items():
        print(f"| {name} | {fmt_summary(values, 3)} |")
    restart, sweep = result["restart_ratio"], result["sweep_ratio"]
    print(f"\nfirst step after restart, prefetched / not: {restart:.2f}x "
          f"(target <= {RESTART_TARGET}: {'met' if restart <= RESTART_TARGET else 'NOT met'})")
    print(f"evaluation sweep, prefetch=2 / sequential: {sweep:.2f}x "
          f"(target <= {SWEEP_TARGET}: {'met' if sweep <= SWEEP_TARGET else 'NOT met'})")


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; return the exit status (0: measured; targets are not enforced)."""
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--quick", action="store_true", help="small states (a smoke test), not ~200 MB")
    p.add_argument("--rounds", type=int, default=3, help="alternating rounds (default 3)")
    p.add_argument("--tmp", type=Path, default=None,
                   help="scratch folder (default: bench-out/tmp in the repository)")
    p.add_argument("--out", type=Path, default=REPO / "bench-out" / "prefetch.json")
    args = p.parse_args(argv)
    if args.rounds < 1:
        p.error("--rounds must be at least 1")
    # moto's werkzeug server and botocore log every request otherwise.
    logging.basicConfig(level=logging.ERROR)

    tmp = (args.tmp or REPO / "bench-out" / "tmp").resolve() / f"prefetch-{os.getpid()}"
    tmp.mkdir(parents=True)
    print(f"# bench_prefetch ({'quick' if args.quick else 'full'}): {platform.machine()}, "
          f"{os.cpu_count()} CPUs, torch {torch.__version__}", flush=True)
    started = time.perf_counter()
    try:
        result = run(int(20e6 if args.quick else 200e6), args.rounds, tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    result["quick"] = args.quick
    result["elapsed_s"] = time.perf_counter() - started
    _print(result)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
