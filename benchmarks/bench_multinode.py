"""Two simulated nodes without a shared filesystem: save, and restore after losing a node.

Two processes (one per simulated node, gloo on loopback), each with its own ``CKPT_HOST`` and
its own hot directory, hold half of every tensor of the GPT-2-small + AdamW state (1.49 GB;
``--quick``: 167 MB) as a DTensor ``Shard(0)``; 0-d tensors (AdamW ``step``) are
replicated. The only storage both see: a PostgreSQL catalog and a moto S3 server on loopback
(started here). Per round, in rotating order:

Saves (wall time on rank 0, barrier to barrier: the slowest node counts):

* ``dcp-shared``: DCP's ``FileSystemWriter(thread_count=2, sync_files=True)`` into ONE
  directory both nodes write (what a shared filesystem would give them);
* ``dcp-s3``: DCP's fsspec writer (``FsspecWriter``, thread_count=2) straight to the same
  moto S3 endpoint;
* ``ckptstore``: ``save_distributed`` (each node writes its own part to its own disk, the
  catalog commits one part per node), codec ``--codec`` (default ``none``, as DCP stores),
  ``replicas = 2``: after the commit, off the timed path, each node sends its part to the
  other (waited for before the restores, untimed).

Restores of the ``ckptstore`` checkpoint, after each node archived its part to S3 (not
timed), into the live DTensors (node A's files evicted from the page cache first):

* ``node-loss-peer``: node B's disk is gone; the job resumes on node A alone (both ranks
  there, as on a cluster that shrinks to its survivors): everything comes from node A's
  disk, its own part and the copy of node B's part it keeps; no S3;
* ``node-loss-peer-replaced``: node B's disk is gone; the job resumes on node A plus a
  replacement node B with an empty disk: node A reads node B's part from the copy it keeps
  and sends it over the process group (no S3), and its own part from disk;
* ``node-loss``: the same without the copy (node A's copy of node B's part deleted first):
  node B's part comes from S3, its download shared by both nodes (each fetches a share and
  sends what the other needs), node A's own part from its disk;
* ``full-s3``: both hot directories deleted; every byte comes from S3;
* ``dcp-s3-load``: DCP's ``FsspecReader`` loading the ``dcp-s3`` checkpoint (reference).

Targets: save <= 1.0x ``dcp-shared``; restore after a node loss <= 0.6x a full restore from
S3. Ratios are per round, then the median. Each step also reports the CPU seconds both
nodes and the S3 server (in this launcher process) used together. Every load is checked
against a crc32c fingerprint of the local shards.

Needs PostgreSQL on 127.0.0.1:5432 (``--pg-url``): a throwaway database is created and
dropped.

Usage::

    .venv/bin/python benchmarks/bench_multinode.py [--quick] [--rounds N] [--codec C] [--no-dcp-s3]
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
import uuid
import warnings
from functools import partial
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    # Run as a script: make ``benchmarks.*`` importable from the repository root.
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.bench_distributed import _fingerprint, _locals, _scramble, _shard
from benchmarks.harness import can_evict, dir_usage, evict, fmt_bytes

NODES = ("node-a", "node-b")
SAVES = ("dcp-shared", "dcp-s3", "ckptstore")
RESTORES = ("node-loss-peer", "node-loss-peer-replaced", "node-loss", "full-s3", "dcp-s3-load")
PG_ADMIN = "postgresql+psycopg://postgres@127.0.0.1:5432/test"


def _dcp_save_shared(state: Any, path: Path) -> None:
    from torch.distributed.checkpoint.filesystem import FileSystemWriter
    from torch.distributed.checkpoint.state_dict_saver import save

    save(state, storage_writer=FileSystemWriter(str(path), thread_count=2, sync_files=True))


def _dcp_s3(url: str, endpoint: str, *, write: bool) -> Any:
    # Not re-exported by torch.distributed.checkpoint in every build: the module is stable.
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter

    if write:
        return FsspecWriter(url, thread_count=2, endpoint_url=endpoint)
    return FsspecReader(url, endpoint_url=endpoint)


def _ours_save(holder: list[Any], save: Any, store: Any, step: int, state: Any) -> None:
    holder.append(save(store, "bench", step, state))


def worker(args: argparse.Namespace) -> None:
    """One node's rank: build and shard the state, run the rounds, rank 0 writes results."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict_loader import load
    from torch.distributed.checkpoint.state_dict_saver import save
    from torch.distributed.device_mesh import init_device_mesh

    from benchmarks.state import build_state
    from ckptstore import CheckpointStore
    from ckptstore.ops.dcp import save_distributed
    from ckptstore.ops.dcp.peers import peers_for
    from ckptstore.ops.tiering.archive import archive_checkpoints
    from ckptstore.ops.tiering.parts import remove_local_parts

    warnings.filterwarnings("ignore")
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=900))
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (len(NODES),))
    full = build_state("quick" if args.quick else "gpt2-small", seed=0)
    state = _shard(full, mesh)
    del full
    expected = _fingerprint(state)
    local_bytes = sum(t.nbytes for _, t in _locals(state))
    tmp = Path(args.tmp)
    hot = Path(os.environ["CKPT_HOT"])
    me = os.environ["CKPT_HOST"]
    store = CheckpointStore.open(codec=args.codec, replicas=2)
    # This rank when its job resumes on node A (a process "moved" to the survivor). After
    # node A's own open has marked its hot tier as this store's: before that, node B's
    # rank would find an unmarked directory while its own host's hot tier is marked, and
    # the store rightly refuses it as another store's (it did, by the race of the opens).
    dist.barrier()
    hot_a = tmp / f"hot-{NODES[0]}"
    on_a = CheckpointStore.open(codec=args.codec, hot=str(hot_a))
    cold = can_evict()

    # CPU seconds of both nodes and of the launcher (the moto S3 server runs there), summed
    # over each timed step: on this machine they all share the same cores.
    ours: list[Any] = [None] * len(NODES)
    dist.all_gather_object(ours, os.getpid())
    pids = [*ours, os.getppid()]
    cpu: dict[str, list[float]] = {}

    def timed(fn: Any, name: str) -> float:
        dist.barrier()
        before = _cpu_seconds(pids) if rank == 0 else 0.0
        started = time.perf_counter()
        fn()
        dist.barrier()
        took = time.perf_counter() - started
        if rank == 0:
            cpu.setdefault(name, []).append(_cpu_seconds(pids) - before)
        return took

    def check(what: str) -> None:
        if _fingerprint(state) != expected:
            raise SystemExit(f"{what}: the load returned other values")

    # Every method once, untimed, on a small state: imports, connections (PostgreSQL, S3),
    # the gloo group replicas = 2 creates at the first save; then the measured rounds.
    import torch
    from torch.distributed.tensor import Shard, distribute_tensor

    small = {"w": distribute_tensor(torch.ones(512, 256), mesh, [Shard(0)])}
    _dcp_save_shared(small, tmp / "shared" / "warm-up")
    saves = tuple(m for m in SAVES if not (args.no_dcp_s3 and m == "dcp-s3"))
    if "dcp-s3" in saves:
        save(small, storage_writer=_dcp_s3(f"{args.s3_url}/warm-up", args.endpoint, write=True))
        load(small, storage_reader=_dcp_s3(f"{args.s3_url}/warm-up", args.endpoint, write=False))
    first = save_distributed(store, "warm-up", 0, small)
    peers_for(store).wait()
    archive_checkpoints(store, ref=first.id)
    dist.barrier()
    store.load(first.id, into=small)
    times: dict[str, list[float]] = {m: [] for m in (*SAVES, *RESTORES)}
    usage: dict[str, tuple[int, int]] = {}
    for rnd in range(args.rounds):
        order = saves[rnd % len(saves):] + saves[: rnd % len(saves)]
        for method in order:
            if method == "dcp-shared":
                path = tmp / "shared" / f"dcp-{rnd}"
                times[method].append(timed(partial(_dcp_save_shared, state, path), method))
                dist.barrier()
                if rank == 0:
                    usage[method] = dir_usage(path)
                    shutil.rmtree(path, ignore_errors=True)
            elif method == "dcp-s3":
                url = f"{args.s3_url}/dcp-{rnd}"
                writer = _dcp_s3(url, args.endpoint, write=True)
                times[method].append(timed(partial(save, state, storage_writer=writer), method))
                _scramble(state)
                reader = _dcp_s3(url, args.endpoint, write=False)
                times["dcp-s3-load"].append(timed(partial(load, state, storage_reader=reader),
                                                     "dcp-s3-load"))
                check("dcp-s3-load")
                dist.barrier()
                if rank == 0:  # moto keeps objects in memory: drop what was measured
                    s3 = store.tier("warm").fs
                    s3.rm(url.removeprefix("s3://"), recursive=True)
            else:
                holder: list[Any] = []
                times[method].append(timed(partial(
                    _ours_save, holder, save_distributed, store, rnd, state), method))
                ck = holder[0]
                mine = hot / ck.run / ck.id
                usage[method] = dir_usage(mine) if rank == 0 else (0, 0)
                peers_for(store).wait()  # the copy to the neighbour node (untimed)
                archive_checkpoints(store, ref=ck.id)  # each node uploads its own part
                dist.barrier()
                # Warm the S3 client's connections, as the DCP reader's were above.
                for opened in (store, on_a):
                    warm = opened.tier("warm")
                    warm.get_bytes(warm.key_for(ck.run, ck.id, "manifest.json"))
                # Node loss: node B's disk is gone; node A's files are read cold.
                if rank == 1:
                    shutil.rmtree(mine)
                elif cold:
                    evict(mine)
                dist.barrier()
                # The job resumes on node A alone: this rank runs there now.
                os.environ["CKPT_HOST"] = NODES[0]
                _scramble(state)
                times["node-loss-peer"].append(timed(partial(on_a.load, ck.id, into=state),
                                                        "node-loss-peer"))
                check("node-loss-peer")
                os.environ["CKPT_HOST"] = me
                if rank == 0 and cold:
                    evict(mine)
                dist.barrier()
                # A replacement node B joins with an empty disk: node B's part comes from
                # the copy node A keeps.
                _scramble(state)
                times["node-loss-peer-replaced"].append(
                    timed(partial(store.load, ck.id, into=state), "node-loss-peer-replaced"))
                check("node-loss-peer-replaced")
                if rank == 0:  # without that copy: node B's part comes from S3
                    remove_local_parts(store, store.get(ck.id), parts=[NODES[1]])
                    if cold:
                        evict(mine)
                dist.barrier()
                _scramble(state)
                times["node-loss"].append(timed(partial(store.load, ck.id, into=state),
                                                "node-loss"))
                check("node-loss")
                if rank == 0:
                    shutil.rmtree(mine)
                dist.barrier()
                _scramble(state)
                times["full-s3"].append(timed(partial(store.load, ck.id, into=state), "full-s3"))
                check("full-s3")
                dist.barrier()
                if rank == 0:  # moto keeps objects in memory: drop what was measured
                    warm = store.tier("warm")
                    warm.delete_prefix(warm.prefix_for(ck.run, ck.id))
            if rank == 0:
                last = {m: round(v[-1], 2) for m, v in times.items() if len(v) > rnd}
                print(f"round {rnd + 1} after {method}: {last}", flush=True)
    store.close()
    on_a.close()
    if rank == 0:
        out = {
            "preset": "quick" if args.quick else "gpt2-small",
            "nodes": len(NODES),
            "codec": args.codec,
            "state_bytes_per_rank": local_bytes,
            "rounds": args.rounds,
            "times": times,
            "cpu": cpu,
            "usage": usage,
            "cold": cold,
        }
        Path(args.out).write_text(json.dumps(out, indent=2))
    dist.destroy_process_group()


def _cpu_seconds(pids: list[int]) -> float:
    """User + system CPU seconds the processes ``pids`` have used so far (Linux)."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0.0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += (int(fields[11]) + int(fields[12])) / tick  # utime, stime
    return total


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def _ratio(a: list[float], b: list[float]) -> float:
    ratios = [x / y for x, y in zip(a, b, strict=False) if y]
    return _median(ratios)


def report(path: Path) -> str:
    """The results table: median seconds and per-round ratios, then the targets."""
    doc = json.loads(path.read_text())
    t = doc["times"]
    lines = [
        f"state: {doc['preset']}, {doc['nodes']} simulated nodes x 1 rank, "
        f"{fmt_bytes(doc['state_bytes_per_rank'])} per rank, codec {doc['codec']}, "
        f"{doc['rounds']} rounds; median seconds, ratios per round then median; CPU: "
        "seconds used by both nodes and the S3 server together (they share this machine's "
        f"{os.cpu_count()} CPUs)",
        "| step | median s | x dcp-shared save | x full restore from S3 | CPU s | "
        "CPU x full restore |",
        "|---|---|---|---|---|---|",
    ]
    c = doc.get("cpu", {})

    def used(m: str) -> str:
        return f"{_median(c[m]):.2f}" if c.get(m) else "-"

    for m in (m for m in SAVES if t[m]):
        ratio = _ratio(t[m], t["dcp-shared"])
        lines.append(f"| save {m} | {_median(t[m]):.2f} | {ratio:.2f} | - | {used(m)} | - |")
    for m in (m for m in RESTORES if t[m]):
        cpu_ratio = (f"{_ratio(c[m], c['full-s3']):.2f}" if c.get(m) and c.get("full-s3")
                     else "-")
        lines.append(f"| restore {m} | {_median(t[m]):.2f} | - | "
                     f"{_ratio(t[m], t['full-s3']):.2f} | {used(m)} | {cpu_ratio} |")
    save_ratio = _ratio(t["ckptstore"], t["dcp-shared"])
    lines.append("")
    lines.append(f"save ckptstore / dcp-shared = {save_ratio:.2f} (target <= 1.0: "
                 f"{'met' if save_ratio <= 1.0 else 'MISSED'})")
    for name in ("node-loss-peer", "node-loss-peer-replaced", "node-loss"):
        ratio = _ratio(t[name], t["full-s3"])
        lines.append(f"restore {name} / full-s3 = {ratio:.2f} (target <= 0.6: "
                     f"{'met' if ratio <= 0.6 else 'MISSED'})")
    if t["dcp-s3-load"]:
        lines.append(f"restore node-loss / dcp-s3-load = "
                     f"{_ratio(t['node-loss'], t['dcp-s3-load']):.2f}")
    usage = doc.get("usage", {})
    if "dcp-shared" in usage and "ckptstore" in usage:
        lines.append(f"node A's part on disk: {fmt_bytes(usage['ckptstore'][0])} in "
                     f"{usage['ckptstore'][1]} files; DCP shared dir (both ranks): "
                     f"{fmt_bytes(usage['dcp-shared'][0])} in {usage['dcp-shared'][1]} files")
    return "\n".join(lines)


def _pg_database(admin: str) -> str:
    from sqlalchemy import create_engine, text
    from sqlalchemy.engine import make_url

    name = f"ckpt_bench_{uuid.uuid4().hex[:10]}"
    engine = create_engine(admin, isolation_level="AUTOCOMMIT")
    try:
        with engine.connect() as conn:
            conn.execute(text(f'CREATE DATABASE "{name}"'))
    finally:
        engine.dispose()
    return str(make_url(admin).set(database=name).render_as_string(hide_password=False))


def _drop(admin: str, url: str) -> None:
    from sqlalchemy import create_engine, text
    from sqlalchemy.engine import make_url

    name = make_url(url).database
    engine = create_engine(admin, isolation_level="AUTOCOMMIT")
    try:
        with engine.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
    finally:
        engine.dispose()


def main(argv: list[str] | None = None) -> int:
    """Start moto and a catalog, launch the two nodes, wait, print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="167 MB state, 2 rounds")
    parser.add_argument("--rounds", type=int, default=None, help="rounds (default 3; quick 2)")
    parser.add_argument("--codec", default="none", help="ckptstore codec preset (none, lz4)")
    parser.add_argument("--tmp", default="bench-out/tmp-multinode", help="scratch directory")
    parser.add_argument("--out", default="bench-out/multinode.json", help="results JSON")
    parser.add_argument("--pg-url", default=PG_ADMIN, help="PostgreSQL maintenance database")
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds for the run")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--s3-url", help=argparse.SUPPRESS)
    parser.add_argument("--endpoint", help=argparse.SUPPRESS)
    parser.add_argument("--no-dcp-s3", action="store_true",
                        help="leave out DCP's S3 writer and reader (about 2 minutes a round); "
                             "every other figure and ratio is measured as usual")
    args = parser.parse_args(argv)
    if args.rounds is None:
        args.rounds = 2 if args.quick else 3
    if args.worker:
        worker(args)
        return 0
    from ckptstore.catalog import migrate
    from ckptstore.testing.s3 import MotoS3

    tmp = Path(args.tmp).resolve()
    shutil.rmtree(tmp, ignore_errors=True)
    (tmp / "shared").mkdir(parents=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    try:
        catalog = _pg_database(args.pg_url)
    except Exception as exc:  # no PostgreSQL here: say so, like a missing optional tool
        print(f"skipped: saves across hosts need a PostgreSQL catalog and {args.pg_url} "
              f"cannot be reached ({type(exc).__name__}); pass --pg-url")
        return 0
    try:
        migrate.upgrade(catalog)
        with MotoS3(fail_fast=False) as s3:
            from ckptstore.testing.ports import free_port

            port = free_port()
            procs = []
            for rank, node in enumerate(NODES):
                env = dict(os.environ, RANK=str(rank), LOCAL_RANK="0", WORLD_SIZE=str(len(NODES)),
                           LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                           GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1", CKPT_HOST=node,
                           CKPT_HOT=str(tmp / f"hot-{node}"), CKPT_ROOT=str(tmp / f"root-{node}"),
                           CKPT_CATALOG_URL=catalog, CKPT_WARM=s3.url("warm"),
                           CKPT_S3_ENDPOINT_URL=s3.endpoint_url)
                for var in ("CKPT_CONFIG", "CKPT_REPLICAS", "PREFECT_API_URL"):
                    env.pop(var, None)
                cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", "--tmp",
                       str(tmp), "--out", args.out, "--rounds", str(args.rounds), "--codec",
                       args.codec, "--s3-url", s3.url("dcp"), "--endpoint", s3.endpoint_url]
                cmd += ["--quick"] if args.quick else []
                cmd += ["--no-dcp-s3"] if args.no_dcp_s3 else []
                procs.append(subprocess.Popen(cmd, env=env))
            deadline = time.monotonic() + args.timeout
            codes = []
            for p in procs:
                try:
                    codes.append(p.wait(timeout=max(1.0, deadline - time.monotonic())))
                except subprocess.TimeoutExpired:
                    p.kill()
                    codes.append(p.wait())
    finally:
        _drop(args.pg_url, catalog)
        shutil.rmtree(tmp, ignore_errors=True)
    if any(codes):
        print(f"a node failed: exit codes {codes}", file=sys.stderr)
        return 1
    print(report(Path(args.out)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
