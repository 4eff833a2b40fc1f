"""Format benchmark: dedup at tensor granularity, and a manifest's first read in a new process.

1. **Dedup of partially frozen models.** An 8-layer MLP (width 1024, fp32) trained with 6 of
   its 8 layers frozen (75 %), saved, trained one more step and saved again with the default
   ``delta="dedup"``: its weights alone (``frozen``, target ≤ 0.30) and with the AdamW state
   of the trainable layers (``frozen+adamw``); and the same MLP frozen with rank-8 LoRA
   adapters on every layer, weights + AdamW (``lora``, target ≤ 0.05). Reported: the bytes
   the second checkpoint adds to the disk (files hard-linked to the first one's chunks cost
   nothing) ÷ the first checkpoint's bytes. Side by side: the fraction of the state that
   changed (the ideal) and ``torch.save`` of the second state (no dedup: 1.0).
2. **Manifest first read.** A restore after a crash is a new process: read and validate the
   manifest of a 600-tensor checkpoint (its digest checked against the commit marker) in a
   fresh interpreter, imports (and the full collection they leave due) excluded, median of
   ``--procs`` processes. Target < 10 ms.
   Side by side: ``torch.load(mmap=True)`` of the same tensors (file index only, no data
   touched) in the same fresh process.
3. **A full save, not slower.** A durable save of the fp32 GPT-2-small state with this
   tree ÷ the same with :data:`LAYOUT_BASE`, the last commit before tensors got arrays of
   their own, each in fresh processes, alternating, ``--save-rounds`` rounds
   (``benchmarks/compare_commits.py --only save``: the saves' user and system CPU too).
   Target ≤ 1.0. Needs the repository's history (a clone, not an export).

Usage::

    python benchmarks/bench_format.py [--procs 7] [--tmp DIR] [--out bench-out/format.json]
"""

from __future__ import annotations

import argparse
import copy
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
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
from torch import nn

from benchmarks.harness import fmt_bytes
from ckptstore import CheckpointStore

REPO = Path(__file__).resolve().parent.parent
WIDTH, LAYERS, FROZEN, RANK = 1024, 8, 6, 8
TARGETS = {"frozen": 0.30, "lora": 0.05, "manifest_ms": 10.0, "full_save": 1.0}
#: The last commit of the layout without per-tensor arrays (format 1).
LAYOUT_BASE = "5bc498e~1"
RUNS = ("frozen", "frozen+adamw", "lora")

# The imports are excluded, and so is the full collection they leave due: the first one
# after importing torch walks its ~170k objects (~50 ms) wherever it falls.
_CHILD = """
import gc, sys, time, torch
from pathlib import Path
from ckptstore.format import read_manifest
path, pt = Path(sys.argv[1]), sys.argv[2]
gc.collect()
t0 = time.perf_counter()
manifest = read_manifest(path)
t1 = time.perf_counter()
index = torch.load(pt, mmap=True, weights_only=True)
t2 = time.perf_counter()
assert len(manifest.tensors) == len(index) == int(sys.argv[3])
print((t1 - t0) * 1000, (t2 - t1) * 1000)
"""


class Lora(nn.Module):
    """A frozen linear layer plus a trainable rank-``RANK`` update (PEFT-style names)."""

    def __init__(self, base: nn.Linear) -> None:
        super().__init__()
        self.base = base
        self.lora_A = nn.Parameter(torch.randn(RANK, base.in_features) * 0.01)
        self.lora_B = nn.Parameter(torch.zeros(base.out_features, RANK))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.base(x) + x @ self.lora_A.t() @ self.lora_B.t()
        return out


def _mlp(lora: bool) -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(LAYERS):
        linear = nn.Linear(WIDTH, WIDTH)
        layers += [Lora(linear) if lora else linear, nn.GELU()]
    return nn.Sequential(*layers)


def _trainable(model: nn.Module, run: str) -> list[nn.Parameter]:
    if run == "lora":
        chosen = [p for n, p in model.named_parameters() if "lora_" in n]
    else:  # the last LAYERS - FROZEN layers train
        keep = {str(2 * i) for i in range(FROZEN, LAYERS)}
        chosen = [p for n, p in model.named_parameters() if n.split(".")[0] in keep]
    for p in model.parameters():
        p.requires_grad_(any(p is c for c in chosen))
    return chosen


def _step(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    x = torch.randn(16, WIDTH)
    loss = model(x).pow(2).mean()
    loss.backward()  # type: ignore[no-untyped-call]
    opt.step()
    opt.zero_grad(set_to_none=True)


def _state(model: nn.Module, opt: torch.optim.Optimizer, with_optimizer: bool) -> dict[str, Any]:
    """A snapshot (the optimizer's state_dict holds its live tensors: copied too)."""
    state: dict[str, Any] = {"model": {k: v.detach().clone()
                                       for k, v in model.state_dict().items()}}
    if with_optimizer:
        state["optimizer"] = copy.deepcopy(opt.state_dict())
    return state


def _inodes(directory: Path) -> dict[int, int]:
    """inode -> size of every file under ``directory``."""
    out: dict[int, int] = {}
    for path in directory.rglob("*"):
        if path.is_file():
            st = path.stat()
            out[st.st_ino] = st.st_size
    return out


def dedup_run(run: str, tmp: Path) -> dict[str, Any]:
    """Save, train one step with most of the model frozen, save again; measure new bytes."""
    model = _mlp(lora=run == "lora")
    chosen = _trainable(model, run)
    opt = torch.optim.AdamW(chosen, lr=1e-3)
    with_optimizer = run != "frozen"
    _step(model, opt)  # the optimizer state exists in both checkpoints
    first = _state(model, opt, with_optimizer)
    _step(model, opt)
    second = _state(model, opt, with_optimizer)
    total = sum(t.numel() * t.element_size() for t in _tensors(second))
    # Weights, and with the optimizer its two moments, of the trainable parameters.
    changed = sum(p.numel() * p.element_size() * (3 if with_optimizer else 1) for p in chosen)
    root = tmp / f"dedup-{run}"
    with CheckpointStore.open(root) as store:
        started = time.perf_counter()
        a = store.save(run, 1, first)
        save_full_s = time.perf_counter() - started
        started = time.perf_counter()
        b = store.save(run, 2, second)
        save_dedup_s = time.perf_counter() - started
        dir_a, dir_b = store.checkpoint_dir(run, a.id), store.checkpoint_dir(run, b.id)
        loaded = store.load(b.id)
    assert all(torch.equal(x, y) for x, y in zip(_tensors(loaded), _tensors(second),
                                                 strict=True))
    ino_a, ino_b = _inodes(dir_a), _inodes(dir_b)
    bytes_a = sum(ino_a.values())
    new_b = sum(size for ino, size in ino_b.items() if ino not in ino_a)
    pt = tmp / f"{run}.pt"
    torch.save(second, pt)
    shutil.rmtree(root)
    return {"state_bytes": total, "first_bytes": bytes_a, "second_new_bytes": new_b,
            "ratio": new_b / bytes_a, "changed_fraction": changed / total,
            "torch_save_ratio": pt.stat().st_size / bytes_a,
            "save_full_s": save_full_s, "save_dedup_s": save_dedup_s}


def _tensors(state: Any) -> list[torch.Tensor]:
    if isinstance(state, torch.Tensor):
        return [state]
    if isinstance(state, dict):
        return [t for v in state.values() for t in _tensors(v)]
    if isinstance(state, list | tuple):
        return [t for v in state for t in _tensors(v)]
    return []


def manifest_run(tmp: Path, procs: int, n: int = 600) -> dict[str, Any]:
    """Median first read of an ``n``-tensor manifest over ``procs`` fresh processes."""
    g = torch.Generator().manual_seed(1)
    state = {f"layers.{i}.weight": torch.randn(32, 32, generator=g) for i in range(n)}
    with CheckpointStore.open(tmp / "manifest") as store:
        ck = store.save("m", 1, state)
        directory = store.checkpoint_dir("m", ck.id)
    pt = tmp / "manifest.pt"
    torch.save(state, pt)
    ours, theirs = [], []
    for _ in range(procs):
        done = subprocess.run([sys.executable, "-c", _CHILD, str(directory), str(pt), str(n)],
                              capture_output=True, text=True, check=True, timeout=120)
        a, b = (float(x) for x in done.stdout.split())
        ours.append(a)
        theirs.append(b)
    return {"tensors": n, "manifest_ms": statistics.median(ours),
            "torch_load_mmap_ms": statistics.median(theirs),
            "manifest_bytes": (directory / "manifest.json").stat().st_size,
            "samples_ms": ours}


def full_save_run(tmp: Path, rounds: int, preset: str) -> dict[str, Any] | None:
    """Save time of this tree ÷ :data:`LAYOUT_BASE`'s (``compare_commits.py --only save``);
    None when the repository's history is not here."""
    from benchmarks import compare_commits

    known = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--verify", "--quiet",
                            f"{LAYOUT_BASE}^{{commit}}"], capture_output=True, check=False)
    if known.returncode != 0:
        return None
    out = tmp / "full_save.json"
    rc = compare_commits.main(["--base", LAYOUT_BASE, "--only", "save", "--rounds",
                               str(rounds), "--preset", preset, "--tmp", str(tmp),
                               "--out", str(out)])
    if rc != 0:
        raise RuntimeError(f"compare_commits.py exited {rc}")
    result: dict[str, Any] = json.loads(out.read_text())
    return result


def main(argv: list[str] | None = None) -> int:
    """Run the three parts; print the tables and the ratios; write the JSON results."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--procs", type=int, default=7, help="fresh processes for the manifest read")
    p.add_argument("--tmp", type=Path, default=None, help="scratch directory")
    p.add_argument("--out", type=Path, default=REPO / "bench-out" / "format.json")
    p.add_argument("--save-rounds", type=int, default=8,
                   help="rounds of the full-save comparison (each saves with both layouts)")
    p.add_argument("--quick", action="store_true",
                   help="3 processes, a tiny state saved in 2 rounds (CI smoke test)")
    args = p.parse_args(argv)
    procs = 3 if args.quick else args.procs
    tmp = Path(tempfile.mkdtemp(prefix="bench-format-", dir=args.tmp))
    try:
        results = {run: dedup_run(run, tmp) for run in RUNS}
        manifest = manifest_run(tmp, procs)
        print(f"\n# full save, this tree ÷ {LAYOUT_BASE} (no per-tensor arrays)", flush=True)
        full_save = full_save_run(tmp, 2 if args.quick else args.save_rounds,
                                  "tiny" if args.quick else "gpt2-small")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"# format benchmark — {LAYERS}-layer MLP, width {WIDTH}, AdamW")
    print("\n| run | state | 1st ckpt | 2nd ckpt adds | ÷ 1st | changed fraction | "
          "torch.save ÷ 1st | save 1st s | save 2nd s |")
    print("|---|---|---|---|---|---|---|---|---|")
    for run, r in results.items():
        print(f"| {run} | {fmt_bytes(r['state_bytes'])} | {fmt_bytes(r['first_bytes'])} | "
              f"{fmt_bytes(r['second_new_bytes'])} | {r['ratio']:.3f} | "
              f"{r['changed_fraction']:.3f} | {r['torch_save_ratio']:.2f} | "
              f"{r['save_full_s']:.2f} | {r['save_dedup_s']:.2f} |")
    print(f"\nmanifest of {manifest['tensors']} tensors ({fmt_bytes(manifest['manifest_bytes'])}),"
          f" first read in a fresh process: {manifest['manifest_ms']:.1f} ms median of {procs} "
          f"(torch.load(mmap=True) of the same tensors: {manifest['torch_load_mmap_ms']:.1f} ms)")
    print("\nRatios:")
    for run in RUNS:
        r = results[run]
        if run in TARGETS:
            met = r["ratio"] <= TARGETS[run]
            print(f"- {run} dedup: 2nd checkpoint ÷ 1st: {r['ratio']:.3f} — target ≤ "
                  f"{TARGETS[run]}: {'met' if met else 'missed'}")
        else:
            print(f"- {run} dedup: 2nd checkpoint ÷ 1st: {r['ratio']:.3f} (the changed "
                  f"fraction, {r['changed_fraction']:.3f}, is the least possible)")
    ratio = manifest["manifest_ms"] / TARGETS["manifest_ms"]
    print(f"- manifest first read ÷ 10 ms: {ratio:.2f} — target ≤ 1: "
          f"{'met' if ratio <= 1 else 'missed'}")
    if full_save is None:
        print(f"- full save ÷ {LAYOUT_BASE}'s: not measured (commit {LAYOUT_BASE} is not in "
              "this checkout's history; run from a git clone)")
    else:
        save = full_save["measures"]["save"]
        print(f"- full save ÷ {LAYOUT_BASE}'s ({full_save['preset']}, {full_save['rounds']} "
              f"rounds): {save['ratio']:.2f} ({save['ratio_min']:.2f}-{save['ratio_max']:.2f})"
              f" — target ≤ {TARGETS['full_save']}: "
              f"{'met' if save['ratio'] <= TARGETS['full_save'] else 'missed'}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"dedup": results, "manifest": manifest,
                                    "full_save": full_save, "targets": TARGETS,
                                    "cpus": os.cpu_count()}, indent=2))
    print(f"\nresults: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
