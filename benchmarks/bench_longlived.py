"""Saving inside a long-lived process: save, load and prune repeatedly, ckptstore vs DCP.

Training jobs are long-lived processes that save, load and delete old checkpoints again and
again; a benchmark that saves once in a fresh process measures something else (first-call
set-up, fresh pages, an empty allocator). This one runs the pattern on the mixed-precision
state (bf16 weights, fp32 master weights and AdamW moments, many small norm/bias tensors;
``benchmarks/state.py``, ``mixed=True``):

* **long-lived**: one process, ``--rounds`` rounds; each round, for ckptstore (default codec)
  and DCP (``FileSystemWriter(thread_count=2, sync_files=True)``) in alternating order: save
  (timed), load into the live state (timed), then retention keeps the newest 2 checkpoints
  (ckptstore: ``apply_retention(keep_last=2)``; DCP: the oldest directories deleted; timed
  apart). Per save, besides the time, what a long-lived process accumulates and a fresh one
  does not: minor page faults (``getrusage``), time in the garbage collector
  (``gc.callbacks``) and the process's RSS.
* **fresh**: each method's save once in a new process (the shape of the issue's first
  measurement), with the same counters.

Targets (issue 34): ckptstore's save <= 0.6x DCP's in the long-lived pattern; bytes <= 0.8x
DCP's. The counters side by side are how to find what costs the difference between the
fresh and the long-lived figures; read them on a quiet machine.

Usage::

    python benchmarks/bench_longlived.py [--quick] [--rounds N] [--tmp DIR] [--out FILE]

Writes ``bench-out/longlived.json``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    # Run as a script: make ``benchmarks.*`` importable from the repository root.
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.harness import dir_usage, fmt_bytes
from benchmarks.state import build_state, state_bytes
from ckptstore.ops.tiering.retention import apply_retention
from ckptstore.retention import RetentionPolicy
from ckptstore.store import CheckpointStore

REPO = Path(__file__).resolve().parent.parent
KEEP = 2


def verdict(ok: bool) -> str:
    return "met" if ok else "MISSED"


class _Counters:
    """Minor page faults, GC seconds and RSS around one operation."""

    def __init__(self) -> None:
        self.gc_s = 0.0
        self._gc_started = 0.0
        gc.callbacks.append(self._on_gc)

    def _on_gc(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._gc_started = time.perf_counter()
        else:
            self.gc_s += time.perf_counter() - self._gc_started

    def measure(self, fn: Callable[[], Any]) -> dict[str, float]:
        before = resource.getrusage(resource.RUSAGE_SELF)
        gc_before = self.gc_s
        t0 = time.perf_counter()
        fn()
        seconds = time.perf_counter() - t0
        after = resource.getrusage(resource.RUSAGE_SELF)
        return {
            "s": seconds,
            "minflt": float(after.ru_minflt - before.ru_minflt),
            "majflt": float(after.ru_majflt - before.ru_majflt),
            "gc_s": self.gc_s - gc_before,
            "rss": float(_rss()),
        }


def _rss() -> int:
    try:
        with open("/proc/self/statm") as fh:
            return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return 0


class _Ckpt:
    name = "ckptstore"

    def __init__(self, base: Path) -> None:
        self.store = CheckpointStore.open(base / "ckptstore")
        self.last: str | None = None

    def save(self, state: Any, step: int) -> None:
        self.last = self.store.save("ll", step, state).id

    def load(self, live: Any) -> None:
        self.store.load(self.last, into=live)

    def prune(self) -> None:
        apply_retention(self.store, run="ll", tier="hot", policy=RetentionPolicy(keep_last=KEEP))

    def last_bytes(self) -> int:
        assert self.last is not None
        return dir_usage(self.store.checkpoint_dir("ll", self.last))[0]

    def close(self) -> None:
        self.store.close()


class _Dcp:
    name = "dcp"

    def __init__(self, base: Path) -> None:
        self.base = base / "dcp"
        self.base.mkdir(parents=True, exist_ok=True)
        self.dirs: list[Path] = []

    def save(self, state: Any, step: int) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.filesystem import FileSystemWriter

        path = self.base / f"step-{step}"
        writer = FileSystemWriter(path, thread_count=2, sync_files=True)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.save(state, storage_writer=writer, no_dist=True)  # type: ignore[attr-defined]
        self.dirs.append(path)

    def load(self, live: Any) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.filesystem import FileSystemReader

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.load(live, storage_reader=FileSystemReader(self.dirs[-1]),  # type: ignore[attr-defined]
                     no_dist=True)

    def prune(self) -> None:
        while len(self.dirs) > KEEP:
            shutil.rmtree(self.dirs.pop(0), ignore_errors=True)

    def last_bytes(self) -> int:
        return dir_usage(self.dirs[-1])[0]

    def close(self) -> None:
        pass


def long_lived(preset: str, rounds: int, tmp: Path) -> dict[str, Any]:
    state = build_state(preset, mixed=True)
    live = build_state(preset, seed=1, mixed=True)
    counters = _Counters()
    methods = [_Ckpt(tmp), _Dcp(tmp)]
    rows: dict[str, list[dict[str, Any]]] = {m.name: [] for m in methods}
    try:
        for r in range(rounds):
            order = methods if r % 2 == 0 else methods[::-1]
            for m in order:
                step = r + 1
                save = counters.measure(lambda m=m, step=step: m.save(state, step))
                load = counters.measure(lambda m=m: m.load(live))
                prune = counters.measure(m.prune)
                rows[m.name].append({"save": save, "load": load, "prune": prune,
                                     "bytes": m.last_bytes()})
    finally:
        for m in methods:
            m.close()
    return {"state_bytes": state_bytes(state), "rows": rows}


def fresh(preset: str, tmp: Path) -> dict[str, Any]:
    """Each method's save once, each in a new process."""
    out: dict[str, Any] = {}
    for name in ("ckptstore", "dcp"):
        result = tmp / f"fresh-{name}.json"
        subprocess.run([sys.executable, str(Path(__file__).resolve()), "--child", name, preset,
                        str(tmp / f"fresh-{name}"), str(result)], check=True)
        out[name] = json.loads(result.read_text())
    return out


def child(name: str, preset: str, base: str, result: str) -> None:
    state = build_state(preset, mixed=True)
    counters = _Counters()
    method: _Ckpt | _Dcp = _Ckpt(Path(base)) if name == "ckptstore" else _Dcp(Path(base))
    got = counters.measure(lambda: method.save(state, 1))
    method.close()
    shutil.rmtree(base, ignore_errors=True)
    Path(result).write_text(json.dumps(got))


def report(ll: dict[str, Any], fr: dict[str, Any]) -> dict[str, Any]:
    def med(name: str, op: str, key: str = "s") -> float:
        # The first round pays first-call set-up in both methods: report rounds 2+.
        rows = ll["rows"][name][1:] or ll["rows"][name]
        return statistics.median(row[op][key] for row in rows)

    print(f"\n## Long-lived process: mixed-precision state, {fmt_bytes(ll['state_bytes'])}, "
          f"{len(ll['rows']['dcp'])} rounds (medians of rounds 2+), keep the newest {KEEP}")
    print("| method | save s | load s | prune s | save minflt | save GC s | RSS | bytes |")
    print("|---|---|---|---|---|---|---|---|")
    for name in ("ckptstore", "dcp"):
        last = ll["rows"][name][-1]
        print(f"| {name} | {med(name, 'save'):.3f} | {med(name, 'load'):.3f} | "
              f"{med(name, 'prune'):.3f} | {med(name, 'save', 'minflt'):.0f} | "
              f"{med(name, 'save', 'gc_s'):.3f} | {fmt_bytes(last['save']['rss'])} | "
              f"{fmt_bytes(last['bytes'])} |")
    print("\n## Fresh process: one save each")
    print("| method | save s | minflt | GC s |")
    print("|---|---|---|---|")
    for name in ("ckptstore", "dcp"):
        f = fr[name]
        print(f"| {name} | {f['s']:.3f} | {f['minflt']:.0f} | {f['gc_s']:.3f} |")
    save_ratio = med("ckptstore", "save") / med("dcp", "save")
    fresh_ratio = fr["ckptstore"]["s"] / fr["dcp"]["s"]
    bytes_ratio = ll["rows"]["ckptstore"][-1]["bytes"] / ll["rows"]["dcp"][-1]["bytes"]
    print(f"\nsave ckptstore/DCP: long-lived {save_ratio:.2f}x, fresh {fresh_ratio:.2f}x")
    print(f"target: long-lived save <= 0.6x DCP: {save_ratio:.2f} -> {verdict(save_ratio <= 0.6)}")
    print(f"target: bytes <= 0.8x DCP: {bytes_ratio:.2f} -> {verdict(bytes_ratio <= 0.8)}")
    return {"save_ratio_long_lived": save_ratio, "save_ratio_fresh": fresh_ratio,
            "bytes_ratio": bytes_ratio,
            "met": {"save": save_ratio <= 0.6, "bytes": bytes_ratio <= 0.8}}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--child"]:
        child(*argv[1:5])
        return 0
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="small state, 2 rounds (a sanity run)")
    p.add_argument("--rounds", type=int, default=None)
    p.add_argument("--tmp", type=Path, default=None)
    p.add_argument("--out", type=Path, default=REPO / "bench-out" / "longlived.json")
    args = p.parse_args(argv)
    preset = "quick" if args.quick else "gpt2-small"
    rounds = args.rounds or (2 if args.quick else 4)
    tmp = (args.tmp or REPO / "bench-out" / "tmp").resolve() / f"longlived-{os.getpid()}"
    tmp.mkdir(parents=True, exist_ok=True)
    try:
        ll = long_lived(preset, rounds, tmp)
        fr = fresh(preset, tmp)
        results = {"long_lived": ll, "fresh": fr, "summary": report(ll, fr)}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
