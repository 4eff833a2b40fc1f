"""Benchmark conversion out of the store: export time and peak memory per format.

State: a synthetic transformer training state (token embedding, blocks of attention + 4x MLP
weights, layer norms, AdamW ``exp_avg``/``exp_avg_sq`` per parameter, fp32), ~300 MB
(``--quick``: ~50 MB), saved once into a fresh store with the default codec.

Measured, once each, in this process (imports and the store already warm):

* ``export pt``: ``export_checkpoint(..., "pt")`` = load the whole state + ``torch.save`` +
  fsync + rename. Compared with the two halves done by hand: ``store.load`` and
  ``torch.save`` + fsync of the loaded state.
* ``export safetensors`` / ``hf`` / ``dcp``: the streaming exports, one tensor at a time.
  Compared with ``safetensors.torch.save_file`` of the loaded state.
* Peak extra RSS of each (kernel high-water mark reset before, see
  ``benchmarks.harness.PeakMemory``), against the state size and the largest tensor.

Usage::

    python benchmarks/bench_convert.py [--quick] [--tmp DIR] [--out FILE]

Prints a table; writes ``bench-out/convert.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    # Run as a script: make ``benchmarks.*`` importable from the repository root.
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from benchmarks.harness import PeakMemory, fmt_bytes, release_free_memory
from ckptstore import CheckpointStore
from ckptstore.ops.upkeep.convert import export_checkpoint

__all__ = ["build_state", "main"]

REPO = Path(__file__).resolve().parent.parent


def build_state(target_bytes: int, *, seed: int = 0) -> dict[str, Any]:
    """A transformer-shaped training state of about ``target_bytes`` (weights + 2 moments).

    Args:
        target_bytes: Wanted tensor payload.
        seed: Random seed.

    Returns:
        ``{"model": {...}, "optimizer": {"state": {i: {...}}, "param_groups": [...]}}``.
    """
    g = torch.Generator().manual_seed(seed)
    width = 768 if target_bytes >= 200e6 else 384
    vocab = 8192 if target_bytes >= 200e6 else 6144
    shapes: dict[str, tuple[int, ...]] = {"wte.weight": (vocab, width)}
    per_block = 12 * width * width * 4 * 3
    blocks = max(1, round((target_bytes - vocab * width * 12) / per_block))
    for b in range(blocks):
        p = f"h.{b}."
        shapes |= {
            p + "ln_1.weight": (width,),
            p + "attn.c_attn.weight": (3 * width, width),
            p + "attn.c_proj.weight": (width, width),
            p + "ln_2.weight": (width,),
            p + "mlp.c_fc.weight": (4 * width, width),
            p + "mlp.c_proj.weight": (width, 4 * width),
        }
    shapes["ln_f.weight"] = (width,)
    model = {k: torch.randn(s, generator=g) * 0.02 for k, s in shapes.items()}
    state = {
        i: {
            "step": torch.tensor(1.0),
            "exp_avg": torch.randn(t.shape, generator=g) * 1e-3,
            "exp_avg_sq": torch.rand(t.shape, generator=g) * 1e-6,
        }
        for i, t in enumerate(model.values())
    }
    groups = [{"lr": 3e-4, "betas": (0.9, 0.95), "weight_decay": 0.1,
               "params": list(range(len(model)))}]
    return {"model": model, "optimizer": {"state": state, "param_groups": groups}}


def _payload(state: Any) -> tuple[int, int, int]:
    sizes: list[int] = []

    def walk(obj: Any) -> None:
        if isinstance(obj, torch.Tensor):
            sizes.append(obj.nbytes)
        elif isinstance(obj, dict):
            for v in obj.values():
                walk(v)
        elif isinstance(obj, list | tuple):
            for v in obj:
                walk(v)

    walk(state)
    return sum(sizes), max(sizes), len(sizes)


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _measure(fn: Callable[[], object]) -> tuple[float, int | None]:
    with PeakMemory() as mem:
        start = time.perf_counter()
        fn()
        elapsed = time.perf_counter() - start
    release_free_memory()
    return elapsed, mem.peak_extra


def _size(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; return the exit status."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="~50 MB state instead of ~300 MB")
    p.add_argument("--tmp", type=Path, default=None,
                   help="scratch folder (default: bench-out/tmp in the repository)")
    p.add_argument("--out", type=Path, default=REPO / "bench-out" / "convert.json")
    args = p.parse_args(argv)

    tmp = (args.tmp or REPO / "bench-out" / "tmp").resolve() / f"convert-{os.getpid()}"
    tmp.mkdir(parents=True)
    try:
        return _run(args, tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _run(args: argparse.Namespace, tmp: Path) -> int:
    target = 50e6 if args.quick else 300e6
    state = build_state(int(target))
    total, largest, count = _payload(state)
    print(f"state: {fmt_bytes(total)} in {count} tensors, largest {fmt_bytes(largest)}; "
          f"{platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}")
    store = CheckpointStore.open(tmp / "store")
    rows: dict[str, dict[str, Any]] = {}
    try:
        start = time.perf_counter()
        ck = store.save("bench", 1, state)
        rows["store save"] = {"s": time.perf_counter() - start, "peak": None, "bytes": None}
        del state
        release_free_memory()

        # Warm-up on a tiny checkpoint: first-call costs (DCP imports, planner set-up).
        warm = store.save("warm", 1, {"w": torch.ones(4)})
        for fmt in ("pt", "safetensors", "hf", "dcp"):
            export_checkpoint(store, warm.ref, fmt, tmp / f"warm-{fmt}")

        loaded: dict[str, Any] = {}

        def load() -> None:
            loaded["state"] = store.load(ck.ref)

        def torch_save() -> None:
            torch.save(loaded["state"], tmp / "ref.pt")
            _fsync(tmp / "ref.pt")

        def st_save() -> None:
            from safetensors.torch import save_file

            from benchmarks.state import flat_tensors

            save_file(flat_tensors(loaded["state"]), str(tmp / "ref.safetensors"))
            _fsync(tmp / "ref.safetensors")

        for label, fn, out in (
            ("store.load", load, None),
            ("torch.save (loaded)", torch_save, tmp / "ref.pt"),
            ("safetensors save_file (loaded)", st_save, tmp / "ref.safetensors"),
        ):
            s, peak = _measure(fn)
            rows[label] = {"s": s, "peak": peak, "bytes": _size(out) if out else None}
        loaded.clear()
        release_free_memory()
        for fmt in ("pt", "safetensors", "hf", "dcp"):
            out = tmp / f"export-{fmt}"
            s, peak = _measure(lambda f=fmt, o=out: export_checkpoint(store, ck.ref, f, o))
            rows[f"export {fmt}"] = {"s": s, "peak": peak, "bytes": _size(out)}
    finally:
        store.close()

    print()
    print("| step | time (s) | MB/s | peak extra RSS | output |")
    print("|---|---:|---:|---:|---:|")
    for label, row in rows.items():
        peak = fmt_bytes(row["peak"]) if row["peak"] is not None else "-"
        out = fmt_bytes(row["bytes"]) if row["bytes"] else "-"
        print(f"| {label} | {row['s']:.2f} | {total / row['s'] / 1e6:.0f} | {peak} | {out} |")
    by_hand = rows["store.load"]["s"] + rows["torch.save (loaded)"]["s"]
    pt_ratio = rows["export pt"]["s"] / by_hand
    st = rows["export safetensors"]
    print()
    print(f"export pt / (store.load + torch.save): {pt_ratio:.2f}x; "
          f"export pt / torch.save alone: "
          f"{rows['export pt']['s'] / rows['torch.save (loaded)']['s']:.2f}x")
    if st["peak"] is not None:
        print(f"safetensors export peak extra RSS: {fmt_bytes(st['peak'])} = "
              f"{st['peak'] / total:.1%} of the state, {st['peak'] / largest:.2f}x the "
              f"largest tensor")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "quick": args.quick, "state_bytes": total, "largest_tensor_bytes": largest,
        "tensors": count, "rows": rows, "export_pt_vs_load_plus_save": pt_ratio,
    }, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
