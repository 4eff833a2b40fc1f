"""One rank of the multi-node scenarios: simulated nodes on one machine, no shared disk.

Usage: ``multinode_worker.py <scenario> <out dir>``; every other input comes from the
environment each simulated node's launcher sets: ``CKPT_HOST`` (the node), ``CKPT_HOT`` (its
own hot directory), ``CKPT_ROOT``, ``CKPT_CATALOG_URL`` (PostgreSQL), ``CKPT_WARM`` and
``CKPT_S3_ENDPOINT_URL`` (moto), and torch's ``RANK``/``WORLD_SIZE``/... . Scenarios:

* ``save`` (2 nodes x 2 ranks, torchrun): DTensor fp32 + bf16 state (Shard(0), a replicated
  tensor, plain values) and an FSDP2 model with its AdamW state, saved as ``mn@1``; the same
  state changed, saved as ``mn@2`` by a store with ``replicas = 2``; and a save through a
  SQLite catalog, which must be refused on every rank. Rank 0 writes the full references.
* ``load`` (1 node x 3 ranks): ``mn@2`` without any S3 tier (its own part and the peer copy
  of the lost node's part), ``mn@1`` without S3 (must fail naming the lost node), and
  ``mn@1`` with S3; into Shard(0) and Shard(1) DTensors and a fresh FSDP2 model, bit-exact.
* ``replace`` (2 nodes x 1 rank, node B replaced by one with an empty disk): ``mn@2``
  without S3 (node A sends node B's part from the copy it keeps), ``mn@1`` with S3 (both
  nodes share the download of node B's part), and ``mn@1`` with S3 reachable from node B
  only (node A's share of the downloads fails; node B fetches it), into Shard(0) DTensors,
  bit-exact.
* ``tiny`` (2 nodes x 1 rank): one small parted checkpoint ``agents@1``.
* ``marked`` (2 nodes x 1 rank): parted checkpoints ``enc-a@1``, ``enc-b@1``, ``enc-c@1``
  (a run each) whose ``mark`` tensor holds a run of values no random tensor does, half on
  each node (the encrypted-tier tests search the tier's bytes for it).
* ``s3hot`` (2 nodes x 1 rank, ``CKPT_HOT=s3://...``): every rank uploads its own shards
  straight to object storage; the checkpoint loads back at Shard(0) and Shard(1).
* ``kill`` (2 nodes x 1 rank): ``kill@1`` commits (``dcp.save`` with ``store.dcp_writer``
  as context manager); the rank on the second node SIGKILLs
  itself after its first chunk of ``kill@2``; the survivor must fail fast and nothing may
  commit (the test then loads ``kill@1`` and has each node clean up).

Each rank writes ``<out>/<scenario>-ws<world>-rank<rank>.json``.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import sys
import time
import traceback
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

sys.path.insert(0, str(Path(__file__).parent))
from dcp_worker import _full, _model, _same, _train_step, shutdown_distributed

from ckptstore import CheckpointStore
from ckptstore.errors import CkptError
from ckptstore.ops.dcp import save_distributed

warnings.filterwarnings("ignore")

#: Shards of at least this many bytes get arrays of their own (smaller ones are packed).
PACK_BELOW = 32 * 1024


def _state(mesh: Any, placement: Any, *, seed: int, zeros: bool = False) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    big = torch.randn(1201, 300, generator=g)  # 1.4 MB fp32: an array per shard
    wide = torch.randn(400, 256, generator=g).to(torch.bfloat16)  # bf16, an array per shard
    small = torch.randn(37, 16, generator=g)  # packed per rank
    rep = torch.randn(5, 7, generator=g)
    if zeros:
        big, wide, small, rep = (torch.zeros_like(t) for t in (big, wide, small, rep))
    return {
        "w": {
            "big": distribute_tensor(big, mesh, [placement]),
            "wide": distribute_tensor(wide, mesh, [placement]),
            "small": distribute_tensor(small, mesh, [placement]),
            "rep": distribute_tensor(rep, mesh, [Replicate()]),
        },
        "meta": {"step": 0 if zeros else 7, "names": [] if zeros else ["a", "b"]},
    }


def _bump(state: dict[str, Any]) -> None:
    with torch.no_grad():
        for value in state["w"].values():
            value.to_local().add_(1.0)


def scenario_save(out: Path, rank: int, ws: int) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (ws,))
    report: dict[str, Any] = {"host": os.environ["CKPT_HOST"]}
    state = _state(mesh, Shard(0), seed=1)
    model, opt = _model(mesh, seed=2)
    _train_step(model, opt)
    msd, osd = get_state_dict(model, opt)
    state["model"], state["optim"] = msd, osd
    refs = {"mn1": _full(state)}
    with CheckpointStore.open() as store:
        t0 = time.perf_counter()
        ck = save_distributed(store, "mn", 1, state, pack_below=PACK_BELOW)
        report["mn1"], report["mn1_s"] = ck.id, time.perf_counter() - t0
        report["mn1_hosts"] = list(ck.hosts)
    _bump(state)
    refs["mn2"] = _full(state)
    with CheckpointStore.open(replicas=2) as store:
        ck = save_distributed(store, "mn", 2, state, pack_below=PACK_BELOW)
        report["mn2"] = ck.id
        # close() waits for the part on its way to the neighbour node.
    # The embedded SQLite catalog lives on one host: a save across hosts must be refused.
    shared = out / "sqlite-store"
    if rank != 0:
        dist.barrier()
    # Its own hot tier: this node's CKPT_HOT belongs to the PostgreSQL store (refused).
    with CheckpointStore.open(shared, catalog_url=f"sqlite:///{shared}/catalog.db",
                              hot=str(shared / "hot")) as store:
        if rank == 0:
            dist.barrier()
        try:
            save_distributed(store, "lite", 1, state)
            report["sqlite"] = "saved"
        except CkptError as exc:
            report["sqlite"] = f"{type(exc).__name__}: {exc}"
    if rank == 0:
        torch.save(refs, out / "ref.pt")
    return report


def _load_into(store: CheckpointStore, ref: str, mesh: Any, expected: Any) -> dict[str, list[str]]:
    diffs: dict[str, list[str]] = {}
    for name, placement in (("shard0", Shard(0)), ("shard1", Shard(1))):
        target = _state(mesh, placement, seed=99, zeros=True)
        store.load(ref, into=target)
        assert isinstance(target["w"]["big"], DTensor)
        assert target["w"]["big"].placements == (placement,)
        want = {k: expected[k] for k in ("w", "meta")}
        diffs[name] = _same(_full({k: target[k] for k in ("w", "meta")}), want)
    model, opt = _model(mesh, seed=7)
    _train_step(model, opt)  # materialise the optimizer state the checkpoint overwrites
    msd, osd = get_state_dict(model, opt)
    target = {"model": msd, "optim": osd}
    store.load(ref, into=target)
    set_state_dict(model, opt, model_state_dict=target["model"], optim_state_dict=target["optim"])
    msd, osd = get_state_dict(model, opt)
    diffs["fsdp"] = _same(_full({"model": msd, "optim": osd}),
                          {"model": expected["model"], "optim": expected["optim"]})
    return diffs


def scenario_load(out: Path, rank: int, ws: int) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (ws,))
    ids = json.loads((out / "save-ws4-rank0.json").read_text())
    refs = torch.load(out / "ref.pt", weights_only=True)
    report: dict[str, Any] = {"host": os.environ["CKPT_HOST"]}
    with CheckpointStore.open(warm="") as store:  # no S3 at all
        assert "warm" not in store.tiers
        report["mn2_local"] = _load_into(store, ids["mn2"], mesh, refs["mn2"])
        try:
            _load_into(store, ids["mn1"], mesh, refs["mn1"])
            report["mn1_local"] = "loaded"
        except CkptError as exc:
            report["mn1_local"] = f"{type(exc).__name__}: {exc}"
    shares = _Lines()
    log = logging.getLogger("ckptstore.ops.dcp.share")
    log.addHandler(shares)
    log.setLevel(logging.INFO)
    try:
        with CheckpointStore.open() as store:
            report["mn1_s3"] = _load_into(store, ids["mn1"], mesh, refs["mn1"])
    finally:
        log.removeHandler(shares)
    report["shared"] = shares.lines
    return report


class _Lines(logging.Handler):
    """Keeps the messages logged (what the ranks say about their shared reads)."""

    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def scenario_replace(out: Path, rank: int, ws: int) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (ws,))
    ids = json.loads((out / "save-ws4-rank0.json").read_text())
    refs = torch.load(out / "ref.pt", weights_only=True)
    report: dict[str, Any] = {"host": os.environ["CKPT_HOST"]}
    shares = _Lines()
    log = logging.getLogger("ckptstore.ops.dcp.share")
    log.addHandler(shares)
    log.setLevel(logging.INFO)
    try:
        # mn@2 without S3: node B's part only exists in the copy node A keeps. Then mn@1
        # with S3 on both nodes, and with S3 on node B only: node A's share of the
        # downloads fails, and node B reads those files itself.
        cases: list[tuple[str, str, dict[str, Any]]] = [
            ("mn2_local", "mn2", {"warm": ""}), ("mn1_s3", "mn1", {}),
            ("mn1_a_offline", "mn1", {"warm": ""} if rank == 0 else {}),
        ]
        for name, ref, options in cases:
            before = len(shares.lines)
            with CheckpointStore.open(**options) as store:
                target = _state(mesh, Shard(0), seed=99, zeros=True)
                store.load(ids[ref], into=target)
            want = {k: refs[ref][k] for k in ("w", "meta")}
            report[name] = _same(_full(target), want)
            report[f"{name}_shared"] = shares.lines[before:]
        # Node A's copy of a chunk of node B's part is gone, and no S3: node A cannot send
        # it, and both ranks must fail with an error naming it (nobody left waiting).
        with CheckpointStore.open(warm="") as store:
            chunk = next((store.checkpoint_dir("mn", ids["mn2"]) / "dcp_ranks" / "r2"
                          / "w.big").glob("c.*"), None)
            aside = chunk.with_name("aside") if chunk is not None else None
            if rank == 0 and chunk is not None and aside is not None:
                chunk.rename(aside)
            dist.barrier()
            before = len(shares.lines)
            try:
                store.load(ids["mn2"], into=_state(mesh, Shard(0), seed=99, zeros=True))
                report["mn2_damaged"] = "loaded"
            except CkptError as exc:
                report["mn2_damaged"] = f"{type(exc).__name__}: {exc}"
            report["mn2_damaged_shared"] = shares.lines[before:]
            dist.barrier()
            if rank == 0 and chunk is not None and aside is not None:
                aside.rename(chunk)
    finally:
        log.removeHandler(shares)
    return report


def scenario_tiny(out: Path, rank: int, ws: int) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (ws,))
    state = _state(mesh, Shard(0), seed=3)
    with CheckpointStore.open() as store:
        ck = save_distributed(store, "agents", 1, state, pack_below=PACK_BELOW)
    full = _full(state)
    if rank == 0:
        torch.save(full, out / "tiny.pt")
    return {"host": os.environ["CKPT_HOST"], "id": ck.id, "hosts": list(ck.hosts)}


def marker() -> torch.Tensor:
    """The values ``marked`` saves as ``mark`` (Shard(0): the first half on rank 0)."""
    return torch.arange(8192, dtype=torch.float32) * 0.5 + 12345.0


def scenario_marked(out: Path, rank: int, ws: int) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (ws,))
    ids = []
    fulls = {}
    with CheckpointStore.open() as store:
        for seed, run in enumerate(("enc-a", "enc-b", "enc-c")):
            state = _state(mesh, Shard(0), seed=10 + seed)
            state["mark"] = distribute_tensor(marker(), mesh, [Shard(0)])
            ck = save_distributed(store, run, 1, state, pack_below=PACK_BELOW)
            ids.append(ck.id)
            fulls[ck.id] = _full(state)
    if rank == 0:
        torch.save(fulls, out / "marked.pt")
    return {"host": os.environ["CKPT_HOST"], "ids": ids, "hosts": list(ck.hosts)}


def scenario_kill(out: Path, rank: int, ws: int) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (ws,))
    state = _state(mesh, Shard(0), seed=1)
    expected = _full(state)
    report: dict[str, Any] = {"host": os.environ["CKPT_HOST"]}
    with CheckpointStore.open() as store:
        # The first one through DCP's own API: the writer's context manager gives each
        # node's part its manifest and marker on the way out.
        import torch.distributed.checkpoint as dcp

        with store.dcp_writer("kill", 1, pack_below=PACK_BELOW) as writer:
            dcp.save(state, storage_writer=writer)
        report["first"] = writer.checkpoint.id
        dist.barrier()
        if rank == 1:
            os.environ["CKPT_FAULT_POINT"] = "dcp.chunk_written:1"
        started = time.perf_counter()
        try:
            save_distributed(store, "kill", 2, state, pack_below=PACK_BELOW)
            report["second"] = "saved"
        except CkptError as exc:
            report["second"] = f"{type(exc).__name__}: {exc}"
        report["error_after_s"] = time.perf_counter() - started
        report["latest"] = store.latest("kill").id
    if rank == 0:
        torch.save(expected, out / "kill.pt")
    return report


def scenario_s3hot(out: Path, rank: int, ws: int) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (ws,))
    state = _state(mesh, Shard(0), seed=5)
    expected = _full(state)
    diffs: dict[str, list[str]] = {}
    with CheckpointStore.open() as store:  # CKPT_HOT is an s3:// URL: no local disk used
        ck = save_distributed(store, "direct", 1, state, pack_below=PACK_BELOW)
        for name, placement in (("shard0", Shard(0)), ("shard1", Shard(1))):
            target = _state(mesh, placement, seed=99, zeros=True)
            store.load(ck.id, into=target)
            diffs[name] = _same(_full(target), expected)
    if rank == 0:
        torch.save(expected, out / "s3hot.pt")
    return {"host": os.environ["CKPT_HOST"], "id": ck.id, "hosts": list(ck.hosts),
            "diffs": diffs}


SCENARIOS = {"save": scenario_save, "load": scenario_load, "replace": scenario_replace,
             "tiny": scenario_tiny, "marked": scenario_marked,
             "kill": scenario_kill, "s3hot": scenario_s3hot}


def main() -> int:
    scenario, out = sys.argv[1], Path(sys.argv[2])
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank, ws = dist.get_rank(), dist.get_world_size()
    try:
        report = SCENARIOS[scenario](out, rank, ws)
        report["ok"] = True
    except BaseException as exc:
        report = {"ok": False, "error": f"{type(exc).__name__}: {exc}",
                  "trace": traceback.format_exc()}
    (out / f"{scenario}-ws{ws}-rank{rank}.json").write_text(json.dumps(report, default=str))
    if scenario != "kill":
        dist.barrier()
    left = shutdown_distributed()
    if left:
        print(f"rank {rank}: gloo threads outlived destroy_process_group(): {left}",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
