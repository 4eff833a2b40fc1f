"""Losing a node of a two-node job: resume from the neighbour's memory, or from S3.

Two simulated nodes, each its own ``torchrun --nnodes 2 --node-rank K`` launch (c10d
rendezvous on 127.0.0.1), each with its own ``CKPT_HOST``, store root, hot directory and
shared memory; one SQLite catalog and a moto S3 server on loopback (started here, the warm
tier) are all they share. Each node runs one rank training the MLP of
``bench_every_step.py`` (4 x 1024x1024 + AdamW, ~50 MB of state, one intra-op thread) data
parallel: gradients averaged with ``all_reduce`` every step, so the state is the same on both
ranks, as DDP keeps it. Every rank runs ``CheckpointManager(snapshot_interval=1,
replicas=2, replicated=True)``; the rank on ``node-0`` also saves durably every 50 steps
(a data-parallel job saves from one rank). Per round:

1. **train**: node-1's rank stops after a random step K past the first durable save (logged),
   and both launches are SIGKILLed, node-1's first: a node lost at a known step. Untimed:
   the durable checkpoint is archived from node-0 to S3 (``ckpt archive``).
2. **peer**: node-1 is replaced (its shared memory and hot directory emptied) and both nodes
   are launched again; every rank restores with ``mgr.restore_latest(into=...)`` (a
   collective: the ranks agree on one step). node-0's rank reads its own memory; the
   replacement's rank fetches the state from node-0's replica server.
3. **s3**: the same replacement, launched as the job would be without peer replicas
   (``replicas=1``): no step is readable by every rank, so both resume from the durable
   checkpoint, the replacement's rank from S3 (node-0's from its hot tier).

Each rank times its restore from a barrier to the restored state (the agreement included);
the figure is the replacement rank's, and the job's (the slower rank's) is printed beside it.
Every restored state is checked bit for bit against the digest the training logged at that
step. Targets (issue: checkpoint every step): the replacement's resume from the neighbour's
replica <= 0.3x its restore from S3; steps lost <= ``snapshot_interval`` (1).

Usage::

    .venv/bin/python benchmarks/bench_node_loss.py [--quick] [--rounds N] [--tmp DIR] [--out FILE]

Writes ``bench-out/node_loss.json``.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    # Run as a script: make ``benchmarks.*`` importable from the repository root.
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

REPO = Path(__file__).resolve().parent.parent
RUN = "lost"
SAVE_INTERVAL = 50
NODES = ("node-0", "node-1")
#: Seconds any one launch may take (imports, rendezvous, training to step 100 or a restore).
LAUNCH_TIMEOUT_S = 300


def verdict(ok: bool) -> str:
    return "met" if ok else "MISSED"


# ---------------------------------------------------------------- one rank (under torchrun)
def _digest(state: dict[str, Any]) -> str:
    """sha256 of every tensor of the model and optimizer state, in a fixed order."""
    h = hashlib.sha256()
    tensors = sorted(state["model"].items())
    for index in sorted(state["optim"]["state"]):
        tensors += [(f"{index}.{k}", v) for k, v in sorted(state["optim"]["state"][index].items())]
    for name, t in tensors:
        h.update(name.encode())
        h.update(t.detach().reshape(-1).contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def rank_main(out_dir: str, last: int) -> None:
    """Train to step ``last``, or (``last`` < 0) only restore; log to ``<out>/<host>.log``:
    ``pid <pid>``, then ``done <step> <digest>`` per step (``hanging`` after
    ``$BENCH_HANG_AFTER``), ``durable <step>`` once a durable save committed, or ``resumed
    <step> <seconds> <digest>``."""
    import torch
    import torch.distributed as dist

    from benchmarks.bench_every_step import make_mlp
    from ckptstore.hooks.manager import CheckpointManager
    from ckptstore.ops.writing.async_save import SaveHandle
    from ckptstore.store import CheckpointStore

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    world = dist.get_world_size()
    host = os.environ["CKPT_HOST"]
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = make_mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    # AdamW's state exists from here on: a restarted trainer restores into it.
    model(torch.zeros(1, 1024)).sum().backward()
    opt.step()
    x = torch.randn(64, 1024, generator=torch.Generator().manual_seed(dist.get_rank()))
    store = CheckpointStore.open()
    out = open(Path(out_dir) / f"{host}.log", "a", buffering=1)  # noqa: SIM115 (may be killed)
    out.write(f"pid {os.getpid()}\n")
    durable = host == NODES[0]
    mgr = CheckpointManager(store, RUN, snapshot_interval=1,
                            save_interval=SAVE_INTERVAL if durable else None, keep_last=2,
                            handle_sigterm=False, history=False,
                            replicas=int(os.environ["BENCH_REPLICAS"]),
                            replica_host="127.0.0.1", replicated=True)

    def state_fn() -> dict[str, Any]:
        return {"model": model.state_dict(), "optim": opt.state_dict()}

    if last < 0:
        live = state_fn()
        dist.barrier()  # both ranks start the clock together
        t0 = time.perf_counter()
        restored = mgr.restore_latest(into=live)
        seconds = time.perf_counter() - t0
        assert restored is not None and mgr.resumed_step is not None
        out.write(f"resumed {mgr.resumed_step} {seconds:.6f} {_digest(restored)}\n")
    hang_after = int(os.environ.get("BENCH_HANG_AFTER", "-1"))
    for step in range(1, last + 1):
        opt.zero_grad(set_to_none=True)
        model(x).square().mean().backward()
        for p in model.parameters():
            assert p.grad is not None
            dist.all_reduce(p.grad)
            p.grad /= world
        opt.step()
        handle = mgr.step(step, state_fn)
        out.write(f"done {step} {_digest(state_fn())}\n")
        if isinstance(handle, SaveHandle):
            out.write(f"durable {handle.result().step}\n")
        if step == hang_after:
            out.write("hanging\n")
            # Waits for the SIGKILL that takes the node away; bounded all the same.
            threading.Event().wait(LAUNCH_TIMEOUT_S)
            os._exit(3)
    mgr.close()
    store.close()
    dist.destroy_process_group()


# ---------------------------------------------------------------- the launcher
class Cluster:
    """Two simulated nodes under one scratch directory."""

    def __init__(self, tmp: Path, shm: Path, env: dict[str, str]) -> None:
        self.tmp, self.shm, self.base = tmp, shm, env
        self.out = tmp / "out"

    def env(self, node: str, **extra: str) -> dict[str, str]:
        env = dict(self.base)
        for var in ("CKPT_CONFIG", "CKPT_REPLICAS", "PREFECT_API_URL", "BENCH_HANG_AFTER"):
            env.pop(var, None)
        env.update(OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo", CKPT_HOST=node,
                   CKPT_CATALOG_URL=f"sqlite:///{self.tmp / 'catalog.db'}",
                   CKPT_ROOT=str(self.tmp / f"root-{node}"), CKPT_HOT=str(self.tmp / f"hot-{node}"),
                   CKPT_MEMORY_TIER_DIR=str(self.shm / node), BENCH_REPLICAS="2")
        env.update(extra)
        return env

    def launch(self, last: int, extra: dict[str, dict[str, str]] | None = None
               ) -> list[subprocess.Popen[bytes]]:
        """One ``torchrun --nnodes 2 --node-rank K`` per node, rendezvous on loopback."""
        from ckptstore.testing.ports import free_port

        torchrun = Path(sys.executable).with_name("torchrun")
        port, rdzv = free_port(), f"nodeloss-{uuid.uuid4().hex[:8]}"
        self.out.mkdir(parents=True, exist_ok=True)
        for node in NODES:
            (self.out / f"{node}.log").unlink(missing_ok=True)
        procs = []
        for k, node in enumerate(NODES):
            with (self.tmp / f"{node}.out").open("a") as log:
                cmd = [str(torchrun), "--nnodes", "2", "--node-rank", str(k),
                       "--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint",
                       f"127.0.0.1:{port}", "--rdzv-id", rdzv, "--max-restarts", "0",
                       str(Path(__file__).resolve()), "--rank", str(self.out), str(last)]
                procs.append(subprocess.Popen(
                    cmd, env=self.env(node, **(extra or {}).get(node, {})), stdout=log,
                    stderr=subprocess.STDOUT, start_new_session=True))
        return procs

    def log(self, node: str) -> list[list[str]]:
        path = self.out / f"{node}.log"
        return [line.split() for line in path.read_text().splitlines()] if path.exists() else []

    def tails(self) -> str:
        return "\n".join(f"--- {n}\n" + (self.tmp / f"{n}.out").read_text()[-3000:]
                         for n in NODES if (self.tmp / f"{n}.out").exists())

    def kill(self, proc: subprocess.Popen[bytes], node: str) -> None:
        """SIGKILL a whole launch, its rank included (bounded wait until all are gone)."""
        from ckptstore.testing.launches import kill_launch

        pids = [int(w[1]) for w in self.log(node) if w[0] == "pid"]
        kill_launch(proc, pids, "bench_node_loss.py", LAUNCH_TIMEOUT_S)

    def wait(self, procs: list[subprocess.Popen[bytes]]) -> None:
        try:
            codes = [p.wait(timeout=LAUNCH_TIMEOUT_S) for p in procs]
        finally:
            for proc, node in zip(procs, NODES, strict=True):
                self.kill(proc, node)
        if codes != [0, 0]:
            raise RuntimeError(f"a launch failed: exit codes {codes}\n{self.tails()}")

    def replace(self, node: str) -> None:
        """The node's replacement: same host name, an empty memory and an empty disk."""
        shutil.rmtree(self.shm / node, ignore_errors=True)
        shutil.rmtree(self.tmp / f"hot-{node}", ignore_errors=True)
        shutil.rmtree(self.tmp / f"root-{node}", ignore_errors=True)


def _round(cluster: Cluster, rng: random.Random) -> dict[str, Any]:
    lost_node, survivor = NODES[1], NODES[0]
    kill_after = SAVE_INTERVAL + rng.randint(2, SAVE_INTERVAL - 2)
    procs = cluster.launch(10**6, {lost_node: {"BENCH_HANG_AFTER": str(kill_after)}})
    try:
        deadline = time.monotonic() + LAUNCH_TIMEOUT_S
        while ["hanging"] not in cluster.log(lost_node):
            if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
                raise RuntimeError(f"node-1 never reached step {kill_after}\n{cluster.tails()}")
            time.sleep(0.05)
        cluster.kill(procs[1], lost_node)
        # The job is torn down, as a scheduler does when a node is lost.
        cluster.kill(procs[0], survivor)
    finally:
        for proc, node in zip(procs, NODES, strict=True):
            cluster.kill(proc, node)
    digests = {int(w[1]): w[2] for w in cluster.log(lost_node) if w[0] == "done"}
    survivor_digests = {int(w[1]): w[2] for w in cluster.log(survivor) if w[0] == "done"}
    assert all(survivor_digests[s] == d for s, d in digests.items() if s in survivor_digests)
    if not any(w[0] == "durable" for w in cluster.log(survivor)):
        raise RuntimeError(f"no durable save committed before step {kill_after}")
    # Untimed: the durable checkpoint's copy on S3, made from the surviving node.
    subprocess.run([str(Path(sys.executable).with_name("ckpt")), "archive", "--run", RUN],
                   env=cluster.env(survivor), check=True, stdout=subprocess.DEVNULL)
    row: dict[str, Any] = {"killed_after": kill_after}
    for mode, replicas in (("peer", "2"), ("s3", "1")):
        cluster.replace(lost_node)
        extra = {n: {"BENCH_REPLICAS": replicas} for n in NODES}
        cluster.wait(cluster.launch(-1, extra))
        for node in NODES:
            words = next(w for w in cluster.log(node) if w[0] == "resumed")
            step, seconds, digest = int(words[1]), float(words[2]), words[3]
            if digest != digests.get(step, survivor_digests.get(step)):
                raise RuntimeError(f"{mode}: {node} restored step {step} with another state")
            row[f"{mode}_{node}_s"] = seconds
            row[f"{mode}_step"] = step
    row["durable_step"] = row["s3_step"]
    row["lost"] = kill_after - row["peer_step"]
    return row


def _report(rows: list[dict[str, Any]]) -> dict[str, Any]:
    lost, kept = NODES[1], NODES[0]
    print("| killed after step | resumed step (peer) | durable step | replacement from "
          "neighbour s | replacement from S3 s | ratio | job (slower rank): peer s, S3 s |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        job_peer = max(r[f"peer_{n}_s"] for n in NODES)
        job_s3 = max(r[f"s3_{n}_s"] for n in NODES)
        print(f"| {r['killed_after']} | {r['peer_step']} | {r['durable_step']} | "
              f"{r[f'peer_{lost}_s']:.3f} | {r[f's3_{lost}_s']:.3f} | "
              f"{r[f'peer_{lost}_s'] / r[f's3_{lost}_s']:.2f} | {job_peer:.3f}, {job_s3:.3f} "
              f"(node-0 {r[f'peer_{kept}_s']:.3f}, {r[f's3_{kept}_s']:.3f}) |")
    ratio = statistics.median(r[f"peer_{lost}_s"] / r[f"s3_{lost}_s"] for r in rows)
    steps_lost = max(r["lost"] for r in rows)
    print(f"target: node lost, the replacement resumes from the neighbour's replica <= 0.3x a "
          f"restore from S3: {ratio:.2f} -> {verdict(ratio <= 0.3)}")
    print(f"target: steps lost <= snapshot_interval (1): {steps_lost} -> "
          f"{verdict(steps_lost <= 1)}")
    return {"rows": rows, "ratio": ratio, "lost": steps_lost,
            "met": {"resume_time": ratio <= 0.3, "steps_lost": steps_lost <= 1}}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--rank"]:
        rank_main(argv[1], int(argv[2]))
        return 0
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="one round (a sanity run)")
    p.add_argument("--rounds", type=int, default=None, help="node losses (default 3)")
    p.add_argument("--tmp", type=Path, default=None, help="scratch directory")
    p.add_argument("--out", type=Path, default=REPO / "bench-out" / "node_loss.json")
    args = p.parse_args(argv)
    rounds = args.rounds or (1 if args.quick else 3)
    from ckptstore.testing.s3 import MotoS3

    tmp = (args.tmp or REPO / "bench-out" / "tmp").resolve() / f"node-loss-{os.getpid()}"
    base = Path("/dev/shm") if Path("/dev/shm").is_dir() else tmp
    shm = base / f"ckpt-bench-{uuid.uuid4().hex[:8]}"
    print(f"\n## Node loss, two torchrun launches: {rounds} rounds, MLP 4x1024x1024 + AdamW "
          f"data parallel, snapshot every step, replicas=2, durable save every {SAVE_INTERVAL}")
    rows = []
    try:
        with MotoS3(fail_fast=False) as s3:
            for i in range(rounds):
                shutil.rmtree(tmp, ignore_errors=True)
                shutil.rmtree(shm, ignore_errors=True)
                tmp.mkdir(parents=True)
                # A warm tier of its own per round, as the catalog and disks are.
                env = dict(os.environ, CKPT_WARM=s3.url(f"warm-{i}"),
                           CKPT_S3_ENDPOINT_URL=s3.endpoint_url)
                rows.append(_round(Cluster(tmp, shm, env), random.Random(i)))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)
    results = _report(rows)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
