"""Asynchronous saves: how long the training loop is blocked, memory over many saves, and
training throughput with background saves.

Three parts, each printed as a table with its targets marked met/missed:

1. **Blocking time** on the GPT-2-small + AdamW state (1.49 GB; ``--quick``: the 167 MB
   preset), side by side in one process:
   - *limit*: copying every tensor into preallocated, already touched host buffers (what a
     perfect stager costs: memcpy into faulted-in pages);
   - *fresh copy*: cloning every tensor (memcpy into freshly allocated pages);
   - ``AsyncSaver.submit`` blocking time: the first save (allocates the staging pool) and the
     later ones (buffers reused); the full background save time is shown too;
   - ``torch.save`` of the state, fsynced (a synchronous save blocks for all of it);
   - ``torch.distributed.checkpoint.async_save`` blocking time (its stager allocates a fresh
     copy on each call), ``FileSystemWriter(thread_count=2, sync_files=True)``.
2. **RSS over 50 consecutive async saves** of a ~50 MB state through ``CheckpointManager``
   (save every step, ``keep_last=2`` so the disk does not fill): the RSS after each committed
   save; first, median, last and the largest drift above the value after the first save.
3. **Training throughput**: a toy MLP (~40 MB of weights + AdamW state) trained for the same
   number of steps without saves and with an async save every 20 steps, alternating runs;
   throughput with saves / without. The loop runs with one intra-op thread, leaving the other
   core for the background save as a GPU job's CPU would.

Targets: (1) async blocking (2nd+ save) <= 1.5x the limit and below DCP's async_save blocking;
(2) RSS drift after the first save <= half the state size (buffers reused, nothing grows per
save); (3) throughput with saves >= 90% of without.

Usage::

    python benchmarks/bench_async.py [--quick] [--rounds N] [--tmp DIR] [--out FILE]

Writes ``bench-out/async.json``.
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
import warnings
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    # Run as a script: make ``benchmarks.*`` importable from the repository root.
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
from torch import nn

from benchmarks.harness import fmt_bytes, fmt_summary, fsync_dir, fsync_file, release_free_memory
from benchmarks.state import build_state, iter_tensors, state_bytes
from ckptstore.hooks.manager import CheckpointManager
from ckptstore.ops.writing.async_save import AsyncSaver
from ckptstore.store import CheckpointStore

REPO = Path(__file__).resolve().parent.parent
logger = logging.getLogger("bench_async")


def rss_bytes() -> int:
    """Resident set size of this process."""
    with open("/proc/self/status", encoding="ascii") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def verdict(ok: bool) -> str:
    return "met" if ok else "MISSED"


# ---------------------------------------------------------------------------- part 1
def bench_blocking(preset: str, rounds: int, tmp: Path, device: str) -> dict[str, Any]:
    """Blocking times of the staging limit, save_async, torch.save and DCP async_save."""
    print(f"\n## 1. Blocking time, state preset {preset!r} on {device}")
    state = build_state(preset)
    if device != "cpu":
        state = _to_device(state, device)
    nbytes = state_bytes(state)
    tensors = [t for _, t in iter_tensors(state)]
    print(f"state: {fmt_bytes(nbytes)} in {len(tensors)} tensors")

    pin = device.startswith("cuda")
    buffers = [torch.empty(t.shape, dtype=t.dtype, pin_memory=pin) for t in tensors]
    for buf, t in zip(buffers, tensors, strict=True):
        buf.copy_(t)  # touch every page once
    limit: list[float] = []
    fresh: list[float] = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for buf, t in zip(buffers, tensors, strict=True):
            buf.copy_(t, non_blocking=pin)
        if pin:
            torch.cuda.synchronize()
        limit.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        clones = [t.detach().to("cpu", copy=True) for t in tensors]
        fresh.append(time.perf_counter() - t0)
        del clones
        release_free_memory()
    del buffers
    release_free_memory()

    store = CheckpointStore.open(tmp / "store")
    saver = AsyncSaver(store, staging_budget_bytes=int(nbytes * 1.2) + (64 << 20))
    blocked: list[float] = []
    total: list[float] = []
    for step in range(1, rounds + 2):
        t0 = time.perf_counter()
        handle = saver.submit("bench", step, state)
        ck = handle.result()
        total.append(time.perf_counter() - t0)
        blocked.append(handle.blocked_s)
        shutil.rmtree(store.checkpoint_dir(ck.run, ck.id), ignore_errors=True)
    saver.close()
    store.close()
    release_free_memory()

    torch_save: list[float] = []
    for i in range(rounds):
        path = tmp / f"torch-{i}.pt"
        t0 = time.perf_counter()
        torch.save(state, path)
        fsync_file(path)
        fsync_dir(tmp)
        torch_save.append(time.perf_counter() - t0)
        path.unlink()

    dcp_blocked, dcp_total = _bench_dcp(state, rounds + 1, tmp)

    first, later = blocked[0], blocked[1:]
    rows = [
        ("copy into preallocated host buffers (limit)", limit),
        ("copy into fresh memory (clone)", fresh),
        ("save_async blocking, 1st save (allocates)", [first]),
        ("save_async blocking, 2nd+ saves (reused)", later),
        ("save_async full background save", total),
        ("torch.save + fsync (blocks for all of it)", torch_save),
        ("DCP async_save blocking, 1st", dcp_blocked[:1]),
        ("DCP async_save blocking, 2nd+", dcp_blocked[1:]),
        ("DCP async_save full save", dcp_total),
    ]
    print("\n| what | seconds: median (min-max) | GB/s |")
    print("|---|---|---|")
    for name, values in rows:
        gbps = nbytes / statistics.median(values) / 1e9 if values else 0.0
        print(f"| {name} | {fmt_summary(values, 3)} | {gbps:.2f} |")
    med_later = statistics.median(later)
    med_limit = statistics.median(limit)
    med_dcp = statistics.median(dcp_blocked[1:]) if len(dcp_blocked) > 1 else float("nan")
    near_limit = med_later <= 1.5 * med_limit
    beats_dcp = med_later < med_dcp
    print(f"\ntarget: save_async blocking (2nd+) <= 1.5x limit: {med_later:.3f}s vs "
          f"{1.5 * med_limit:.3f}s ({med_later / med_limit:.2f}x) -> {verdict(near_limit)}")
    print(f"target: save_async blocking (2nd+) < DCP async_save blocking (2nd+): "
          f"{med_later:.3f}s vs {med_dcp:.3f}s -> {verdict(beats_dcp)}")
    return {
        "preset": preset, "device": device, "state_bytes": nbytes, "tensors": len(tensors),
        "limit_s": limit, "fresh_copy_s": fresh, "save_async_blocking_s": blocked,
        "save_async_total_s": total, "torch_save_s": torch_save,
        "dcp_async_blocking_s": dcp_blocked, "dcp_async_total_s": dcp_total,
        "met": {"near_limit": near_limit, "beats_dcp": beats_dcp},
    }


def _to_device(state: Any, device: str) -> Any:
    if isinstance(state, torch.Tensor):
        return state.to(device)
    if isinstance(state, dict):
        return {k: _to_device(v, device) for k, v in state.items()}
    if isinstance(state, list):
        return [_to_device(v, device) for v in state]
    return state


def _bench_dcp(state: Any, rounds: int, tmp: Path) -> tuple[list[float], list[float]]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.filesystem import FileSystemWriter

    blocked: list[float] = []
    total: list[float] = []
    for i in range(rounds):
        workdir = tmp / f"dcp-{i}"
        writer = FileSystemWriter(workdir, thread_count=2, sync_files=True)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            t0 = time.perf_counter()
            future = dcp.async_save(state, storage_writer=writer, no_dist=True)
            blocked.append(time.perf_counter() - t0)
            future.result()  # type: ignore[union-attr]
            total.append(time.perf_counter() - t0)
        shutil.rmtree(workdir, ignore_errors=True)
        release_free_memory()
    return blocked, total


# ---------------------------------------------------------------------------- part 2
def bench_rss(saves: int, mbytes: int, tmp: Path) -> dict[str, Any]:
    """RSS after each of ``saves`` consecutive async saves of a ``mbytes`` MB state."""
    print(f"\n## 2. RSS over {saves} consecutive async saves of a {mbytes} MB state")
    n = mbytes * 1_000_000 // 4 // 8
    state = {
        "model": {f"layer{i}": torch.randn(n) for i in range(8)},
        "optim": {"step": 0, "lr": 1e-3},
    }
    nbytes = state_bytes(state)
    store = CheckpointStore.open(tmp / "rss-store")
    curve: list[int] = []
    release_free_memory()
    before = rss_bytes()
    with CheckpointManager(store, "rss", save_interval=1, keep_last=2,
                           handle_sigterm=False) as mgr:
        for step in range(1, saves + 1):
            with torch.no_grad():
                for t in state["model"].values():
                    t.add_(1.0)
            state["optim"]["step"] = step
            handle = mgr.step(step, lambda: state)
            assert handle is not None
            mgr.wait()
            curve.append(rss_bytes())
    store.close()
    first, last = curve[0], curve[-1]
    drift = max(curve) - first
    ok = drift <= nbytes // 2
    print(f"state {fmt_bytes(nbytes)}; RSS before the first save {fmt_bytes(before)}")
    print("\n| RSS after save | value |")
    print("|---|---|")
    print(f"| 1st | {fmt_bytes(first)} |")
    print(f"| median | {fmt_bytes(statistics.median(curve))} |")
    print(f"| last ({saves}th) | {fmt_bytes(last)} |")
    print(f"| max drift above the 1st | {fmt_bytes(drift)} |")
    step_marks = ", ".join(fmt_bytes(v) for v in curve[:: max(1, saves // 10)])
    print(f"\ncurve (every {max(1, saves // 10)}th): {step_marks}")
    print(f"target: drift after the first save <= half the state ({fmt_bytes(nbytes // 2)}): "
          f"{fmt_bytes(drift)} -> {verdict(ok)}")
    return {"state_bytes": nbytes, "rss_before": before, "rss_curve": curve,
            "drift": drift, "met": {"bounded_rss": ok}}


# ---------------------------------------------------------------------------- part 3
def make_mlp(width: int, depth: int) -> nn.Module:
    layers: list[nn.Module] = [nn.Linear(256, width), nn.GELU()]
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.GELU()]
    layers.append(nn.Linear(width, 1))
    return nn.Sequential(*layers)


def train(steps: int, every: int | None, tmp: Path, width: int, depth: int, tag: str) -> float:
    """Train ``steps`` steps; save every ``every`` steps (None: never); return steps/s."""
    torch.manual_seed(0)
    model = make_mlp(width, depth)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(256, 256)
    y = torch.randn(256, 1)
    store = CheckpointStore.open(tmp / f"tp-{tag}")
    mgr = CheckpointManager(store, "tp", save_interval=every, keep_last=2, handle_sigterm=False)

    def state_fn() -> dict[str, Any]:
        return {"model": model.state_dict(), "optim": opt.state_dict()}

    def one(step: int) -> None:
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if every is not None:
            mgr.step(step, state_fn)

    one(0)  # AdamW state exists from here on
    t0 = time.perf_counter()
    for step in range(1, steps + 1):
        one(step)
    elapsed = time.perf_counter() - t0
    mgr.close()
    store.close()
    shutil.rmtree(tmp / f"tp-{tag}", ignore_errors=True)
    return steps / elapsed


def bench_throughput(steps: int, rounds: int, tmp: Path, width: int, depth: int,
                     every: int = 20) -> dict[str, Any]:
    """Steps/s without saves and with a save every ``every`` steps, alternating."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = make_mlp(width, depth)
        params = sum(p.numel() for p in model.parameters())
        print(f"\n## 3. Training throughput: MLP {params / 1e6:.1f}M params "
              f"({fmt_bytes(params * 12)} of state with AdamW), {steps} steps, "
              f"save every {every} steps")
        base: list[float] = []
        saving: list[float] = []
        for r in range(rounds):
            base.append(train(steps, None, tmp, width, depth, f"b{r}"))
            saving.append(train(steps, every, tmp, width, depth, f"s{r}"))
    finally:
        torch.set_num_threads(threads)
    ratio = statistics.median(s / b for s, b in zip(saving, base, strict=True))
    ok = ratio >= 0.9
    print("\n| run | steps/s: median (min-max) |")
    print("|---|---|")
    print(f"| no saves | {fmt_summary(base, 2)} |")
    print(f"| async save every {every} steps | {fmt_summary(saving, 2)} |")
    print(f"\ntarget: throughput with saves >= 90% of without: {ratio:.1%} -> {verdict(ok)}")
    return {"params": params, "steps": steps, "every": every, "no_save_steps_s": base,
            "save_steps_s": saving, "ratio": ratio, "met": {"throughput": ok}}


# ---------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> int:
    """Run the three parts; exit status 0 (targets are reported, not enforced)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="small state, fewer rounds")
    p.add_argument("--rounds", type=int, default=None, help="rounds per measurement")
    p.add_argument("--device", default="cpu", help="where the big state lives (cpu, cuda)")
    p.add_argument("--tmp", type=Path, default=None, help="scratch directory")
    p.add_argument("--out", type=Path, default=REPO / "bench-out" / "async.json")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.ERROR)
    rounds = args.rounds or (2 if args.quick else 3)
    tmp = (args.tmp or REPO / "bench-out" / "tmp").resolve() / f"async-{os.getpid()}"
    tmp.mkdir(parents=True, exist_ok=True)
    print(f"# bench_async ({'quick' if args.quick else 'full'}): {platform.node()}, "
          f"{os.cpu_count()} CPUs, torch {torch.__version__}, python {platform.python_version()}")
    started = time.perf_counter()
    try:
        blocking = bench_blocking("quick" if args.quick else "gpt2-small", rounds, tmp,
                                  args.device)
        rss = bench_rss(20 if args.quick else 50, 20 if args.quick else 50, tmp)
        throughput = bench_throughput(
            60 if args.quick else 120, rounds, tmp, width=1024, depth=3
        )
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    results = {"quick": args.quick, "blocking": blocking, "rss": rss, "throughput": throughput,
               "elapsed_s": time.perf_counter() - started}
    met = {**blocking["met"], **rss["met"], **throughput["met"]}
    print("\n## Summary")
    for name, ok in met.items():
        print(f"- {name}: {verdict(ok)}")
    print(f"(total {results['elapsed_s']:.0f}s)")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
