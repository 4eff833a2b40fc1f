"""Merging three GPT-2-small checkpoints: peak extra memory and time, against reading them.

State: :func:`benchmarks.state.build_state` (GPT-2 small after one AdamW step: 1.49 GB of
fp32 weights and moments in 592 tensors) with three seeds, saved as three runs of one store
(default codec). ``--quick``: the 13.9M-parameter preset of the same structure.

Measured per round, in this process (imports and first-call set-up done on a tiny merge
first), the inputs in the page cache (hot) for both:

* **read**: ``store.load(ref)`` of each of the three inputs, one after the other (each state
  dropped before the next is read), timed together: what any merge must at least do.
* **merge**: ``store.merge(refs, run=..., step=...)`` (mean, default ``auto`` accumulation:
  float32 for these fp32 tensors), which reads the same three inputs chunk by chunk and
  writes and commits the merged checkpoint (fsync included). Its peak extra resident memory
  is the kernel's high-water mark (``benchmarks.harness.PeakMemory``).
* **save**, for context: ``store.save`` of one input's loaded state in full (``delta=False``,
  durable), the writing a merge cannot avoid. A merge that overlapped nothing would take
  read + save; ``merge / (read + save)`` below 1 is the overlap.

The memory target is for GPT-2 small: a merge's buffers are fixed (writer threads x inputs x
one chunk, ~75 MB with the defaults on 2 cores), so on the ``--quick`` state they are a
larger share.

Targets (issue 36): merge peak extra memory <= 0.2x one state; merge time <= 1.3x read time.
Both ratios are printed side by side per round and as the median over rounds; the order of
read and merge alternates between rounds. Each merged checkpoint is deleted after its round.

Usage::

    python benchmarks/bench_merge.py [--quick] [--rounds N] [--tmp DIR] [--out FILE]

Prints a table and the ratios; writes ``bench-out/merge.json``. Exit status 0 (targets are
reported, not enforced: the integrator reads them on a quiet machine).
"""

from __future__ import annotations

import argparse
import json
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

from benchmarks.harness import PeakMemory, fmt_bytes, fmt_summary, release_free_memory
from benchmarks.state import build_state, iter_tensors, state_bytes
from ckptstore import CheckpointStore
from ckptstore.records import Checkpoint

__all__ = ["main"]

REPO = Path(__file__).resolve().parent.parent
TIME_TARGET = 1.3
MEMORY_TARGET = 0.2
RUNS = ("site-a", "site-b", "site-c")


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; return the exit status."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="13.9M-parameter model (167 MB)")
    p.add_argument("--rounds", type=int, default=None, help="rounds (default 3, quick 2)")
    p.add_argument("--tmp", type=Path, default=None,
                   help="scratch folder (default: bench-out/tmp in the repository)")
    p.add_argument("--out", type=Path, default=REPO / "bench-out" / "merge.json")
    args = p.parse_args(argv)
    tmp = (args.tmp or REPO / "bench-out" / "tmp").resolve() / f"merge-{os.getpid()}"
    tmp.mkdir(parents=True)
    try:
        return _run(args, tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _drop(store: CheckpointStore, ck: Checkpoint) -> None:
    """Delete a merged checkpoint (catalog row and files) so rounds do not fill the disk."""
    store.catalog.mark_deleting(ck.id)
    shutil.rmtree(store.checkpoint_dir(ck.run, ck.id), ignore_errors=True)
    store.catalog.mark_deleted(ck.id)


def _read(store: CheckpointStore, refs: list[str]) -> float:
    start = time.perf_counter()
    for ref in refs:
        state = store.load(ref)
        del state
    elapsed = time.perf_counter() - start
    release_free_memory()
    return elapsed


def _save(store: CheckpointStore, ref: str, step: int) -> float:
    state = store.load(ref)
    start = time.perf_counter()
    saved = store.save("resave", step, state, delta=False)
    elapsed = time.perf_counter() - start
    del state
    _drop(store, saved)
    release_free_memory()
    return elapsed


def _merge(store: CheckpointStore, refs: list[str], step: int) -> tuple[float, int | None]:
    with PeakMemory() as mem:
        start = time.perf_counter()
        merged = store.merge(refs, run="soup", step=step)
        elapsed = time.perf_counter() - start
    _drop(store, merged)
    release_free_memory()
    return elapsed, mem.peak_extra


def _run(args: argparse.Namespace, tmp: Path) -> int:
    preset = "quick" if args.quick else "gpt2-small"
    rounds = args.rounds or (2 if args.quick else 3)
    store = CheckpointStore.open(tmp / "store")
    try:
        refs = []
        for seed, run in enumerate(RUNS):
            state = build_state(preset, seed=seed)
            one_state = state_bytes(state)
            tensors = sum(1 for _ in iter_tensors(state))
            refs.append(store.save(run, 1, state).ref)
            del state
            release_free_memory()
        print(f"inputs: 3 x {fmt_bytes(one_state)} ({preset}, {tensors} tensors each); "
              f"{platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}, "
              f"threads {store.settings.threads}, chunk {fmt_bytes(store.settings.chunk_bytes)}")

        # First-call costs (imports, thread pools) on a tiny merge, untimed.
        warm = [store.save(f"warm-{i}", 1, {"w": torch.full((4,), float(i))}).ref
                for i in range(3)]
        _drop(store, store.merge(warm, run="warm", step=0))

        rows: list[dict[str, Any]] = []
        for r in range(rounds):
            if r % 2 == 0:
                read_s = _read(store, refs)
                merge_s, peak = _merge(store, refs, r)
            else:
                merge_s, peak = _merge(store, refs, r)
                read_s = _read(store, refs)
            save_s = _save(store, refs[r % len(refs)], r)
            row = {"round": r + 1, "read_s": read_s, "merge_s": merge_s, "save_s": save_s,
                   "peak_bytes": peak, "time_ratio": merge_s / read_s,
                   "overlap_ratio": merge_s / (read_s + save_s),
                   "memory_ratio": peak / one_state if peak is not None else None}
            rows.append(row)
            memory = f"{row['memory_ratio']:.3f}x" if peak is not None else "n/a"
            print(f"round {r + 1}: read 3 inputs {read_s:.2f} s | merge {merge_s:.2f} s | "
                  f"time {row['time_ratio']:.2f}x (target <= {TIME_TARGET}) | peak extra "
                  f"{fmt_bytes(peak or 0)} = {memory} of one state (target <= "
                  f"{MEMORY_TARGET}) | save one {save_s:.2f} s, merge / (read + save) "
                  f"{row['overlap_ratio']:.2f}x", flush=True)
    finally:
        store.close()

    time_ratios = [row["time_ratio"] for row in rows]
    memory_ratios = [row["memory_ratio"] for row in rows if row["memory_ratio"] is not None]
    time_median = statistics.median(time_ratios)
    memory_median = statistics.median(memory_ratios) if memory_ratios else None
    print(f"\nread 3 inputs: {fmt_summary([row['read_s'] for row in rows])} s; "
          f"merge: {fmt_summary([row['merge_s'] for row in rows])} s; "
          f"save one: {fmt_summary([row['save_s'] for row in rows])} s")
    if memory_median is None:
        mem_text = "n/a (cannot reset the kernel's high-water mark here)"
    else:
        verdict = "met" if memory_median <= MEMORY_TARGET else "MISSED"
        mem_text = f"{memory_median:.3f}x (target <= {MEMORY_TARGET}: {verdict})"
    verdict = "met" if time_median <= TIME_TARGET else "MISSED"
    print(f"merge / read time: {time_median:.2f}x (target <= {TIME_TARGET}: {verdict})   "
          f"peak extra memory / one state: {mem_text}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "preset": preset, "state_bytes": one_state, "rounds": rows,
        "time_ratio_median": time_median, "memory_ratio_median": memory_median,
        "overlap_ratio_median": statistics.median(row["overlap_ratio"] for row in rows),
        "targets": {"time_ratio": TIME_TARGET, "memory_ratio": MEMORY_TARGET},
        "machine": {"arch": platform.machine(), "cpus": os.cpu_count(),
                    "torch": torch.__version__},
    }, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
