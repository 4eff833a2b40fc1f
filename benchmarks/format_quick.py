"""Quick perf sanity check of the checkpoint format (not a test, not the full benchmark).

Saves and loads a ~300 MB fp32 state (a small transformer-like model plus AdamW moments)
with every codec preset, side by side with torch.save/torch.load and DCP
``FileSystemWriter(thread_count=2)``, over interleaved rounds, and prints medians in seconds
plus the median per-round ratio to torch.save / torch.load. Every save is durable (fsynced).
Loads are hot (page cache). ``benchmarks/bench_save_load.py`` gives the real numbers.

Usage::

    PYTHONPATH=src python benchmarks/format_quick.py [--mb 300] [--rounds 3] [--dir /tmp/x]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
import uuid
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ckptstore.format import CODEC_PRESETS, read_checkpoint, read_manifest, write_checkpoint

Timings = dict[str, list[float]]


def build_state(total_mb: int) -> dict[str, Any]:
    """Weights + exp_avg + exp_avg_sq (a third of the bytes each), 10 tensors per layer."""
    torch.manual_seed(0)
    hidden = 768
    layer_params = 12 * hidden * hidden + 13 * hidden
    layers = max(1, round(total_mb * 1_000_000 / 3 / 4 / layer_params))
    model: dict[str, torch.Tensor] = {}
    for i in range(layers):
        p = f"h.{i}."
        model[p + "attn.qkv.weight"] = torch.randn(3 * hidden, hidden) * 0.02
        model[p + "attn.qkv.bias"] = torch.zeros(3 * hidden)
        model[p + "attn.proj.weight"] = torch.randn(hidden, hidden) * 0.02
        model[p + "attn.proj.bias"] = torch.zeros(hidden)
        model[p + "mlp.fc.weight"] = torch.randn(4 * hidden, hidden) * 0.02
        model[p + "mlp.fc.bias"] = torch.zeros(4 * hidden)
        model[p + "mlp.proj.weight"] = torch.randn(hidden, 4 * hidden) * 0.02
        model[p + "mlp.proj.bias"] = torch.zeros(hidden)
        model[p + "ln_1.weight"] = torch.ones(hidden)
        model[p + "ln_1.bias"] = torch.zeros(hidden)
    opt_state = {
        i: {
            "step": torch.tensor(1.0),
            "exp_avg": torch.randn_like(t) * 1e-3,
            "exp_avg_sq": torch.rand_like(t) * 1e-6,
        }
        for i, t in enumerate(model.values())
    }
    groups = [{"lr": 3e-4, "params": list(opt_state)}]
    return {"model": model, "optimizer": {"state": opt_state, "param_groups": groups}, "step": 1}


def state_bytes(state: dict[str, Any]) -> int:
    """Bytes of every tensor in the state built above."""
    tensors = list(state["model"].values())
    tensors += [v for s in state["optimizer"]["state"].values() for v in s.values()]
    return sum(t.numel() * t.element_size() for t in tensors)


def timed(fn: Callable[[], Any]) -> float:
    """Wall seconds of one call."""
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def torch_round(state: Any, root: Path, out: Timings) -> None:
    """torch.save (fsynced) and torch.load."""
    path = root / "state.pt"

    def save() -> None:
        torch.save(state, path)
        fd = os.open(path, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)

    out.setdefault("torch.save", []).append(timed(save))
    out.setdefault("torch.load", []).append(timed(lambda: torch.load(path, weights_only=True)))
    path.unlink()


def dcp_round(state: Any, root: Path, out: Timings) -> None:
    """DCP FileSystemWriter(thread_count=2) save and in-place load, if available."""
    try:
        import torch.distributed.checkpoint as dcp
    except ImportError:
        return
    path = root / "dcp"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "no process group, assuming single process"
        writer = dcp.FileSystemWriter(str(path), thread_count=2)
        out.setdefault("dcp t=2 save", []).append(
            timed(lambda: dcp.save(state, storage_writer=writer))
        )
        reader = dcp.FileSystemReader(str(path))
        out.setdefault("dcp load into", []).append(
            timed(lambda: dcp.load(state, storage_reader=reader))
        )
    shutil.rmtree(path)


def codec_round(state: Any, root: Path, codec: str, threads: int, out: Timings) -> None:
    """Our save, fresh load and in-place load with one codec."""
    path = root / codec

    def save() -> None:
        write_checkpoint(
            path,
            state,
            ckpt_id=str(uuid.uuid4()),
            run="quick",
            step=1,
            codec=codec,
            threads=threads,
        )

    out.setdefault(f"{codec} save", []).append(timed(save))
    manifest = read_manifest(path)
    out.setdefault(f"{codec} load fresh", []).append(
        timed(lambda: read_checkpoint(path, manifest, threads=threads))
    )
    out.setdefault(f"{codec} load into", []).append(
        timed(lambda: read_checkpoint(path, manifest, into=state, threads=threads))
    )
    out.setdefault(f"{codec} ratio", []).append(manifest.logical_bytes / manifest.stored_bytes)
    shutil.rmtree(path)


def report(times: Timings) -> None:
    """Print medians and per-round ratios."""
    for name, values in times.items():
        med = statistics.median(values)
        if name.endswith("ratio"):
            print(f"{name:22s} {med:7.3f}x compression")
            continue
        ref = "torch.load" if "load" in name else "torch.save"
        ratio = statistics.median(v / r for v, r in zip(values, times[ref], strict=True))
        rounds = ", ".join(f"{v:.3f}" for v in values)
        print(f"{name:22s} {med:7.3f} s  {ratio:5.2f}x {ref}  [{rounds}]")


def main() -> None:
    """Run the rounds and print the table."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--mb", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dir", type=Path, default=None)
    args = parser.parse_args()
    state = build_state(args.mb)
    print(f"state: {state_bytes(state) / 1e6:.0f} MB, threads={args.threads}")
    root = Path(args.dir or tempfile.mkdtemp(prefix="ckpt-quick-"))
    root.mkdir(parents=True, exist_ok=True)
    times: Timings = {}
    try:
        for _ in range(args.rounds):
            torch_round(state, root, times)
            dcp_round(state, root, times)
            for codec in CODEC_PRESETS:
                codec_round(state, root, codec, args.threads, times)
    finally:
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)
    report(times)


if __name__ == "__main__":
    main()
