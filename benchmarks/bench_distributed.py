"""Two-rank save and load of the benchmark state: ckptstore's DCP backend vs DCP's own.

Each of 2 processes (gloo on loopback) holds half of every tensor of the GPT-2-small + AdamW
state (1.49 GB; ``--quick``: 167 MB) as a DTensor ``Shard(0)``; 0-d tensors (AdamW ``step``)
are replicated. Per round, in rotating order, each method saves the sharded state and
loads it back into the live DTensors (hot: right after the save; cold: after every file of
the checkpoint was fsynced and dropped from the page cache):

* ``dcp``: ``FileSystemWriter(thread_count=2, sync_files=True)`` / ``FileSystemReader``;
* ``ckptstore-lz4`` / ``ckptstore-none``: ``save_distributed`` (= ``store.save(...,
  distributed=True)``: DCP with :class:`~ckptstore.ops.dcp.ZarrStorageWriter`,
  catalog row included) and ``load_dcp(..., into=state)`` (= ``store.load(ref, into=state)``)
  with 2 writer/reader threads per rank (the store's default);
* ``<method>@N`` (``--methods``): the same with N threads per rank (DCP: ``thread_count``).

Times are wall time on rank 0 from a barrier before to a barrier after (the slowest rank
counts). Ratios are per round against DCP, then the median. Every load is checked against
a crc32c fingerprint of the local shards.

Usage::

    .venv/bin/python benchmarks/bench_distributed.py [--quick] [--rounds N] [--tmp DIR]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
import warnings
from functools import partial
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    # Run as a script: make ``benchmarks.*`` importable from the repository root.
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import crc32c
import torch

from benchmarks.harness import can_evict, dir_usage, evict, fmt_bytes

METHODS = ("dcp", "ckptstore-lz4", "ckptstore-none")
#: Writer/reader threads per rank when a method name has no ``@N`` suffix (both sides' default).
DEFAULT_THREADS = 2
WORLD = 2


def _shard(state: Any, mesh: Any) -> Any:
    from torch.distributed.tensor import Shard, distribute_tensor

    if isinstance(state, torch.Tensor):
        if state.dim() == 0:
            return state.clone()
        # Every rank built the same state: shard from local data, no communication.
        return distribute_tensor(state, mesh, [Shard(0)], src_data_rank=None)
    if isinstance(state, dict):
        return {k: _shard(v, mesh) for k, v in state.items()}
    if isinstance(state, list):
        return [_shard(v, mesh) for v in state]
    return state


def _locals(state: Any, prefix: str = "") -> list[tuple[str, torch.Tensor]]:
    from torch.distributed.tensor import DTensor

    if isinstance(state, DTensor):
        return [(prefix, state.to_local())]
    if isinstance(state, torch.Tensor):
        return [(prefix, state)]
    if isinstance(state, dict):
        return [p for k, v in state.items() for p in _locals(v, f"{prefix}/{k}")]
    if isinstance(state, list):
        return [p for i, v in enumerate(state) for p in _locals(v, f"{prefix}/{i}")]
    return []


def _fingerprint(state: Any) -> dict[str, int]:
    return {
        k: crc32c.crc32c(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().data)
        for k, t in _locals(state)
    }


def _scramble(state: Any) -> None:
    """Overwrite the live shards so a load that does nothing cannot pass the check."""
    with torch.no_grad():
        for _, t in _locals(state):
            t.view(torch.uint8).fill_(0x5A) if t.dim() else t.fill_(-1)


def _dcp_save(state: Any, path: Path, threads: int) -> None:
    from torch.distributed.checkpoint.filesystem import FileSystemWriter
    from torch.distributed.checkpoint.state_dict_saver import save

    writer = FileSystemWriter(str(path), thread_count=threads, sync_files=True)
    save(state, storage_writer=writer)


def _dcp_load(state: Any, path: Path) -> None:
    from torch.distributed.checkpoint.filesystem import FileSystemReader
    from torch.distributed.checkpoint.state_dict_loader import load

    load(state, storage_reader=FileSystemReader(str(path)))


def _ours_save(store: Any, state: Any, step: int, codec: str, holder: dict[str, Any]) -> None:
    from ckptstore.ops.dcp import save_distributed

    holder["ck"] = save_distributed(store, "bench", step, state, codec=codec)


def _ours_load(store: Any, state: Any, holder: dict[str, Any]) -> None:
    from ckptstore.format import read_manifest
    from ckptstore.ops.dcp import load_dcp

    ck = holder["ck"]
    directory = store.checkpoint_dir(ck.run, ck.id)
    manifest = read_manifest(directory, expected_digest=ck.manifest_digest)
    load_dcp(directory, manifest, into=state, threads=store.settings.threads)


def worker(args: argparse.Namespace) -> None:
    """One rank: build and shard the state, run the rounds, rank 0 writes the results."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from benchmarks.state import build_state
    from ckptstore import CheckpointStore

    warnings.filterwarnings("ignore")
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=600))
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (WORLD,))
    full = build_state("quick" if args.quick else "gpt2-small", seed=0)
    state = _shard(full, mesh)
    del full
    expected = _fingerprint(state)
    local_bytes = sum(t.nbytes for _, t in _locals(state))
    tmp = Path(args.tmp)
    if rank != 0:
        dist.barrier()
    methods = args.methods.split(",")
    stores = {
        n: CheckpointStore.open(tmp / "store", threads=n)
        for n in sorted({_threads(m) for m in methods})
    }
    if rank == 0:
        dist.barrier()
    cold_ok = can_evict()

    def timed(fn: Any) -> float:
        dist.barrier()
        started = time.perf_counter()
        fn()
        dist.barrier()
        return time.perf_counter() - started

    def evict_all(path: Path) -> None:
        if rank == 0:
            evict(path)
        dist.barrier()

    results: dict[str, dict[str, list[float]]] = {
        m: {"save": [], "hot": [], "cold": []} for m in methods
    }
    usage: dict[str, tuple[int, int]] = {}
    for rnd in range(args.rounds):
        order = methods[rnd % len(methods):] + methods[: rnd % len(methods)]
        for method in order:
            threads = _threads(method)
            store = stores[threads]
            if method.startswith("dcp"):
                path = tmp / f"dcp-{rnd}"
                save = partial(_dcp_save, state, path, threads)
                load = partial(_dcp_load, state, path)
            else:
                holder: dict[str, Any] = {}
                codec = method.split("@")[0].split("-", 1)[1]
                save = partial(_ours_save, store, state, rnd, codec, holder)
                load = partial(_ours_load, store, state, holder)
            results[method]["save"].append(timed(save))
            if not method.startswith("dcp"):
                ck = holder["ck"]
                path = store.checkpoint_dir(ck.run, ck.id)
            for kind in ("hot", "cold") if cold_ok else ("hot",):
                if kind == "cold":
                    evict_all(path)
                _scramble(state)
                results[method][kind].append(timed(load))
                if _fingerprint(state) != expected:
                    raise SystemExit(f"{method}: {kind} load returned other values")
            dist.barrier()
            if rank == 0:
                usage[method] = dir_usage(path)
                shutil.rmtree(path, ignore_errors=True)
            dist.barrier()
            if rank == 0:
                print(f"round {rnd + 1} {method}: save {results[method]['save'][-1]:.2f} s, "
                      f"hot {results[method]['hot'][-1]:.2f} s"
                      + (f", cold {results[method]['cold'][-1]:.2f} s" if cold_ok else ""),
                      flush=True)
    for opened in stores.values():
        opened.close()
    if rank == 0:
        out = {
            "preset": "quick" if args.quick else "gpt2-small",
            "world_size": WORLD,
            "state_bytes_per_rank": local_bytes,
            "rounds": args.rounds,
            "methods": methods,
            "times": results,
            "usage": usage,
        }
        Path(args.out).write_text(json.dumps(out, indent=2))
    dist.destroy_process_group()


def _threads(method: str) -> int:
    """Threads per rank of a method name (``name@N``)."""
    _, _, n = method.partition("@")
    return int(n) if n else DEFAULT_THREADS


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def report(path: Path) -> str:
    """Render the results table (ratios per round against DCP, then the median)."""
    doc = json.loads(path.read_text())
    times = doc["times"]
    lines = [
        f"state: {doc['preset']}, {WORLD} ranks, {fmt_bytes(doc['state_bytes_per_rank'])} per "
        f"rank, {doc['rounds']} rounds; median seconds (ratio to dcp, per round then median)",
        "| method | save s | x dcp | load hot s | x dcp | load cold s | x dcp | on disk | x dcp "
        "| files |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    base_bytes = doc["usage"]["dcp"][0]
    for method in doc["methods"]:
        row = [method]
        for kind in ("save", "hot", "cold"):
            values = times[method][kind]
            ratios = [a / b for a, b in zip(values, times["dcp"][kind], strict=False) if b]
            row += [f"{_median(values):.2f}", f"{_median(ratios):.2f}" if ratios else "-"]
        size, files = doc["usage"][method]
        row += [fmt_bytes(size), f"{size / base_bytes:.3f}", str(files)]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Launch the 2 ranks, wait, print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="167 MB state, 2 rounds")
    parser.add_argument("--rounds", type=int, default=None, help="rounds (default 3; quick 2)")
    parser.add_argument("--tmp", default="bench-out/tmp-distributed", help="scratch directory")
    parser.add_argument("--out", default="bench-out/distributed.json", help="results JSON")
    parser.add_argument("--methods", default=",".join(METHODS),
                        help="comma-separated; a suffix @N sets threads per rank (default 2)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.rounds is None:
        args.rounds = 2 if args.quick else 3
    if args.worker:
        worker(args)
        return 0
    tmp = Path(args.tmp)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    from ckptstore.testing.ports import free_port

    port = free_port()
    procs = []
    for rank in range(WORLD):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD),
                   LOCAL_WORLD_SIZE=str(WORLD), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                   GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1")
        cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", "--tmp", str(tmp),
               "--out", args.out, "--rounds", str(args.rounds), "--methods", args.methods]
        cmd += ["--quick"] if args.quick else []
        procs.append(subprocess.Popen(cmd, env=env))
    codes = [p.wait() for p in procs]
    shutil.rmtree(tmp, ignore_errors=True)
    if any(codes):
        print(f"a rank failed: exit codes {codes}", file=sys.stderr)
        return 1
    print(report(Path(args.out)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
