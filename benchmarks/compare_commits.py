"""Two versions of ckptstore side by side: is this tree slower than a base commit?

A refactor must not cost speed, and on a shared, noisy machine two benchmark runs made hours
apart cannot tell (the disk's throughput alone changes 2x between runs). This benchmark runs
the base commit and the working tree in the SAME run, alternating per round (the order
rotates), each in a fresh Python process so neither inherits the other's page cache state,
thread pools or allocator arenas. Per round and version, on the same seeded state:

* ``save``: a durable synchronous save (codec ``--codec``, default ``none``), after
  ``harness.prefault`` gave the process host-backed free memory (``--no-prefault``: not);
* ``load``: a fresh ``store.load(ref)`` with the files hot in the page cache, after the
  same prefault (its new tensors page-fault a state's worth of memory: on the reference VM
  the kernel zeroing pages the host has taken back cost 2x the CPU of zeroing backed ones,
  and which ones a process got depended on what the save before had freed);
* ``load-into``: ``store.load(ref, into=live)`` (hot);
* ``load-cold``: a fresh load after every file was fsynced and dropped from the page cache
  (prefaulted likewise);
* ``async-stall``: how long the second ``save_async`` blocks the caller;
* ``save-user`` / ``save-sys``: the CPU seconds the save took in user space and in the
  kernel (every thread of the process). An uncompressed save is CPU-bound on the kernel's
  copy into the page cache, whose cost swings with the machine's memory state; the user
  CPU is ckptstore's own work and barely moves, so its ratio shows a software cost of a
  few percent that the wall times cannot resolve.

``--only save`` measures the saves alone (a round takes a third of the time), for more
rounds in the same hour.

Each run saves into a fresh directory that is kept, evicted from the page cache, until the
end of the benchmark. Deleting it at once would bill its deletion to the next run, whichever
version that is: ext4 without a journal (the reference machine's root file system) skips
every inode freed in the last 1-6 minutes, one buffer lookup each, whenever it allocates a
new one, so a save's file creations got slower the more files the run before it had
deleted (profiled: ``recently_deleted`` and ``find_get_block_common`` made up most of the
system-time gap between two layouts). ``--delete-each`` measures that case: a save right
after a prune.

Printed: per measurement the median of the per-round ratios ``tree / base`` (below 1.00:
the tree is faster) with their range. The base is exported with ``git archive`` and laid out
as the installed package (the mapped ``catalog``, ``tasks``, ``flows`` and ``migrations``
directories inside ``ckptstore``), so both versions run in this checkout's virtualenv.

Usage::

    .venv/bin/python benchmarks/compare_commits.py --base REV [--tree REV] [--rounds N] [--preset P]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if __package__ in (None, ""):
    # Run as a script: make ``benchmarks.*`` importable from the repository root (it holds no
    # ``ckptstore`` package, so a child still imports the version on its PYTHONPATH).
    sys.path.insert(0, str(REPO))

from benchmarks.harness import evict, prefault  # noqa: E402  (needs the path above)

#: Top-level directories setuptools maps into the ``ckptstore`` package (pyproject.toml).
MAPPED = ("catalog", "tasks", "flows", "migrations")
MEASURES = ("save", "save-user", "save-sys", "load", "load-into", "load-cold", "async-stall")


def package_tree(source: Path, dest: Path) -> Path:
    """Lay ``source`` (a checkout) out as the installed package under ``dest``; returns the
    directory to put on ``PYTHONPATH``."""
    pkg = dest / "ckptstore"
    pkg.mkdir(parents=True)
    for entry in (source / "src" / "ckptstore").iterdir():
        (pkg / entry.name).symlink_to(entry)
    for name in MAPPED:
        if (source / name).is_dir():
            (pkg / name).symlink_to(source / name)
    return dest


def export(rev: str, dest: Path) -> Path:
    """The files of commit ``rev`` under ``dest``."""
    dest.mkdir(parents=True)
    archive = subprocess.run(["git", "-C", str(REPO), "archive", rev], check=True,
                             capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)
    return dest


def _cpu_seconds() -> tuple[float, float]:
    """User and system CPU seconds of this process so far, all its threads included."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime, usage.ru_stime


def child(args: argparse.Namespace) -> None:
    """One round of one version (run in a fresh process); prints its times as JSON."""
    import ckptstore
    import ckptstore.catalog
    from benchmarks.state import build_state, state_bytes

    state = build_state(args.preset, seed=0)
    root = Path(args.child)
    out: dict[str, Any] = {"module": ckptstore.__file__,
                           "catalog": ckptstore.catalog.__file__}
    with ckptstore.CheckpointStore.open(root, codec=args.codec) as store:
        if args.prefault:
            prefault(state_bytes(state) * 5 // 4)
        cpu = _cpu_seconds()
        t = time.perf_counter()
        ck = store.save("ab", 1, state)
        out["save"] = time.perf_counter() - t
        user, system = _cpu_seconds()
        out["save-user"], out["save-sys"] = user - cpu[0], system - cpu[1]
        if args.only == "save":
            print(json.dumps(out))
            return
        if args.prefault:  # a fresh load page-faults a state's worth of new memory too
            prefault(state_bytes(state) * 5 // 4)
        t = time.perf_counter()
        loaded = store.load(ck.ref)
        out["load"] = time.perf_counter() - t
        del loaded
        t = time.perf_counter()
        store.load(ck.ref, into=state)
        out["load-into"] = time.perf_counter() - t
        evict(root)
        if args.prefault:
            prefault(state_bytes(state) * 5 // 4)
        t = time.perf_counter()
        loaded = store.load(ck.ref)
        out["load-cold"] = time.perf_counter() - t
        del loaded
        store.save_async("ab", 2, state)  # the first one allocates the staging buffers
        store.wait()
        t = time.perf_counter()
        store.save_async("ab", 3, state)
        out["async-stall"] = time.perf_counter() - t
        store.wait()
    print(json.dumps(out))


def _run(tree: Path, store: Path, args: argparse.Namespace) -> dict[str, Any]:
    """Run one version's child on the fresh directory ``store``, then drop its files from
    the page cache (``--delete-each``: delete them)."""
    env = dict(os.environ, PYTHONPATH=str(tree))
    try:
        done = subprocess.run(
            [sys.executable, __file__, "--child", str(store), "--preset", args.preset,
             "--codec", args.codec, "--only", args.only,
             "--prefault" if args.prefault else "--no-prefault"],
            env=env, check=True, capture_output=True, text=True)
    finally:
        if args.delete_each:
            shutil.rmtree(store, ignore_errors=True)
        elif store.exists():
            evict(store)
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    for module in (result["module"], result["catalog"]):
        if not str(module).startswith(str(tree)):
            raise SystemExit(f"the child imported {module}, not the tree {tree}")
    return result


def _ratio(tree: float, base: float) -> float:
    """``tree / base``; NaN when the base measured nothing (the CPU clock's resolution is
    a few ms, so a tiny preset's save can take 0.0 s of system time)."""
    return tree / base if base > 0 else float("nan")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base", default="HEAD", help="commit to compare the working tree with")
    p.add_argument("--tree", default=None,
                   help="commit to measure instead of the working tree")
    p.add_argument("--rounds", type=int, default=5, help="rounds (each runs both versions)")
    p.add_argument("--preset", default="gpt2-small", help="state size (benchmarks/state.py)")
    p.add_argument("--codec", default="none", help="codec of both versions' saves")
    p.add_argument("--only", choices=("all", "save"), default="all",
                   help="'save': measure the saves alone (wall, user and system CPU)")
    p.add_argument("--prefault", action=argparse.BooleanOptionalAction, default=True,
                   help="hand the save host-backed free memory first (harness.prefault)")
    p.add_argument("--delete-each", action="store_true",
                   help="delete each run's store before the next run instead of keeping it "
                        "(evicted from the page cache) until the end: the next save then "
                        "pays for the deletion on file systems that avoid reusing freed "
                        "inodes at once")
    p.add_argument("--tmp", type=Path, default=REPO / "bench-out", help="scratch parent")
    p.add_argument("--out", type=Path, default=None,
                   help="also write the summary (medians, ratios, ranges) as JSON here")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        child(args)
        return 0
    args.tmp.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix="commits-", dir=args.tmp))
    try:
        trees = {"base": package_tree(export(args.base, scratch / "base-src"),
                                      scratch / "base-pkg"),
                 "tree": package_tree(export(args.tree, scratch / "tree-src") if args.tree
                                      else REPO, scratch / "tree-pkg")}
        measures = MEASURES if args.only == "all" else MEASURES[:3]
        times: dict[str, dict[str, list[float]]] = {v: {m: [] for m in measures}
                                                    for v in trees}
        print(f"# ckptstore {args.base} vs {args.tree or 'the working tree'} — preset "
              f"{args.preset}, codec {args.codec}, {args.rounds} rounds, scratch {scratch}")
        for rnd in range(args.rounds):
            order = list(trees) if rnd % 2 == 0 else list(reversed(trees))
            for version in order:
                result = _run(trees[version], scratch / f"store-{version}-{rnd}", args)
                for m in measures:
                    times[version][m].append(result[m])
            print(f"round {rnd + 1}/{args.rounds}: " + ", ".join(
                f"{m} {_ratio(times['tree'][m][-1], times['base'][m][-1]):.2f}"
                for m in measures),
                flush=True)
        summary = summarize(times, measures)
        print("\n| measure | base s | tree s | tree / base (median of rounds, range) |")
        print("|---|---|---|---|")
        for m, r in summary.items():
            print(f"| {m} | {r['base_s']:.3f} | {r['tree_s']:.3f} | "
                  f"{r['ratio']:.2f} ({r['ratio_min']:.2f}-{r['ratio_max']:.2f}) |")
        if args.out is not None:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps({"base": args.base, "tree": args.tree,
                                            "rounds": args.rounds, "preset": args.preset,
                                            "measures": summary}, indent=2))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return 0


def summarize(times: dict[str, dict[str, list[float]]],
              measures: tuple[str, ...]) -> dict[str, dict[str, float]]:
    """Per measure: both versions' median seconds and the median and range of the per-round
    ratios ``tree / base``."""
    out: dict[str, dict[str, float]] = {}
    for m in measures:
        ratios = [_ratio(t, b) for t, b in zip(times["tree"][m], times["base"][m], strict=True)]
        out[m] = {"base_s": statistics.median(times["base"][m]),
                  "tree_s": statistics.median(times["tree"][m]),
                  "ratio": statistics.median(ratios), "ratio_min": min(ratios),
                  "ratio_max": max(ratios)}
    return out


if __name__ == "__main__":
    sys.exit(main())
