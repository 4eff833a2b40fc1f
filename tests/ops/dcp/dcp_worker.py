"""One rank of the distributed checkpoint scenarios (run by torchrun from the tests).

Usage: ``dcp_worker.py <scenario>[,<scenario>...] <store root> <out dir>``; scenarios:

* ``save`` (2 ranks): DTensor state (fp32 + bf16, Shard(0), one tensor replicated, plain
  values), an FSDP2 model with its AdamW state, an async save, a DDP-style replicated save,
  and a save where rank 1 raises mid-write. Rank 0 writes the full reference tensors.
* ``load`` (any world size): loads those checkpoints into Shard(0) and Shard(1) DTensors and
  into a fresh FSDP2 model + optimizer, and compares bit for bit with the references.
* ``kill`` (2 ranks, launched without torchrun): rank 1 SIGKILLs itself after writing its
  first chunk; rank 0 must get an error and nothing may be committed.

Each rank writes ``<out>/<scenario>-rank<r>.json`` with what it saw.
"""

from __future__ import annotations

import datetime
import gc
import json
import os
import sys
import time
import traceback
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from ckptstore import CheckpointStore
from ckptstore.errors import CkptError
from ckptstore.ops.dcp import dcp_writer, load_dcp, save_distributed

warnings.filterwarnings("ignore")


def _bits(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().cpu().contiguous()
    width = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    return t.view(width)


def _full(value: Any) -> Any:
    if isinstance(value, DTensor):
        return value.full_tensor().clone()  # Replicate returns the local tensor itself
    if isinstance(value, dict):
        return {k: _full(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_full(v) for v in value]
    return value


def _same(a: Any, b: Any, path: str = "") -> list[str]:
    """Differences between two nested states (tensors compared bit for bit)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return [f"{path}: {type(a).__name__} vs {type(b).__name__}"]
        if a.dtype != b.dtype or a.shape != b.shape or not torch.equal(_bits(a), _bits(b)):
            what = f"{a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)}"
            return [f"{path}: tensors differ ({what})"]
        return []
    if isinstance(a, dict) and isinstance(b, dict):
        if set(map(str, a)) != set(map(str, b)):
            return [f"{path}: keys {sorted(map(str, a))} vs {sorted(map(str, b))}"]
        bs = {str(k): v for k, v in b.items()}
        return [d for k, v in a.items() for d in _same(v, bs[str(k)], f"{path}/{k}")]
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        if len(a) != len(b):
            return [f"{path}: lengths {len(a)} vs {len(b)}"]
        pairs = enumerate(zip(a, b, strict=True))
        return [d for i, (x, y) in pairs for d in _same(x, y, f"{path}/{i}")]
    return [] if a == b else [f"{path}: {a!r} vs {b!r}"]


def _dt_state(mesh: Any, placement: Any, *, seed: int, zeros: bool = False) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    big = torch.randn(1201, 300, generator=g)  # 1.4 MB: a grid array of its own
    small = torch.randn(37, 16, generator=g)  # packed per rank
    half = torch.randn(120, 64, generator=g).to(torch.bfloat16)
    rep = torch.randn(5, 7, generator=g)
    if zeros:
        big, small, half, rep = (torch.zeros_like(t) for t in (big, small, half, rep))
    return {
        "w": {
            "big": distribute_tensor(big, mesh, [placement]),
            "small": distribute_tensor(small, mesh, [placement]),
            "half": distribute_tensor(half, mesh, [placement]),
            "rep": distribute_tensor(rep, mesh, [Replicate()]),
        },
        "plain": rep.clone(),
        "meta": {"step": 0 if zeros else 5, "names": [] if zeros else ["a", "b"]},
    }


def _model(mesh: Any, seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(16, 12), torch.nn.ReLU(), torch.nn.Linear(12, 5))
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, opt


def _train_step(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(3))
    model(x).square().mean().backward()
    opt.step()
    opt.zero_grad()


class _FailingPlanner(DefaultSavePlanner):
    """Raises on one rank after that rank's writer resolved its first item."""

    def __init__(self, rank: int) -> None:
        super().__init__()
        self.fail = rank
        self.calls = 0

    def resolve_data(self, write_item: Any) -> Any:
        self.calls += 1
        if dist.get_rank() == self.fail and self.calls > 1:
            raise RuntimeError("injected failure while resolving a shard")
        return super().resolve_data(write_item)


def scenario_save(store: CheckpointStore, out: Path, rank: int, ws: int) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (ws,))
    report: dict[str, Any] = {}
    state = _dt_state(mesh, Shard(0), seed=1)
    ref_dt = _full(state)
    t0 = time.perf_counter()
    report["dt"] = save_distributed(store, "dt", 1, state, metrics={"loss": 1.5}).id
    report["dt_s"] = time.perf_counter() - t0

    model, opt = _model(mesh, seed=2)
    _train_step(model, opt)
    msd, osd = get_state_dict(model, opt)
    fsdp_state = {"model": msd, "optim": osd}
    ref_fsdp = _full(fsdp_state)
    report["fsdp"] = save_distributed(store, "fsdp", 1, fsdp_state).id

    # dcp.async_save with our writer as the (bounded) stager, on its own gloo group so the
    # background collectives never interleave with the training thread's.
    import torch.distributed.checkpoint as dcp

    group = dist.new_group(backend="gloo")
    writer = dcp_writer(store, "dt", 2)
    future = dcp.async_save(state, storage_writer=writer, process_group=group)
    for value in state["w"].values():  # training goes on: the staged copy must not change
        value.to_local().add_(1.0)
    future.result(timeout=60)
    report["async"] = writer.checkpoint.id

    ddp = {"w": torch.arange(12.0).reshape(3, 4), "epoch": 3}
    report["ddp"] = save_distributed(store, "ddp", 1, ddp).id

    # One rank raises mid-save: every rank must get an error, nothing may be committed.
    from ckptstore.ops.dcp import ZarrStorageWriter

    failing = ZarrStorageWriter(store, "dt", 3)
    try:
        with failing:
            dcp.save(state, storage_writer=failing, planner=_FailingPlanner(rank=1))
        report["fail"] = None
    except BaseException as exc:  # DCP raises CheckpointException (a BaseException)
        report["fail_raw"] = type(exc).__name__
    try:
        bad = {"x": distribute_tensor(torch.ones(4, 4), mesh, [Shard(0)])}
        save_distributed(store, "dt", 3, bad, codec="no-such-codec")
        report["bad_codec"] = None
    except CkptError as exc:
        report["bad_codec"] = f"{type(exc).__name__}: {exc}"
    report["failed_id"] = failing.ckpt_id
    if rank == 0:
        torch.save({"dt": ref_dt, "fsdp": ref_fsdp, "ddp": ddp}, out / "ref.pt")
    return report


def scenario_load(store: CheckpointStore, out: Path, rank: int, ws: int) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (ws,))
    ids = json.loads((out / "save-rank0.json").read_text())
    ref = torch.load(out / "ref.pt", weights_only=True)
    report: dict[str, Any] = {"diffs": {}}

    def load_into(ckpt_id: str, into: dict[str, Any]) -> dict[str, Any]:
        ck = store.catalog.get(ckpt_id)
        directory = store.checkpoint_dir(ck.run, ck.id)
        from ckptstore.format import read_manifest

        manifest = read_manifest(directory, expected_digest=ck.manifest_digest)
        result: dict[str, Any] = load_dcp(directory, manifest, into=into)
        return result

    for name, placement in (("shard0", Shard(0)), ("shard1", Shard(1))):
        target = _dt_state(mesh, placement, seed=99, zeros=True)
        loaded = load_into(ids["dt"], target)
        assert loaded["w"]["big"].placements == (placement,)
        report["diffs"][f"dt-{name}"] = _same(_full(loaded), ref["dt"])

    model, opt = _model(mesh, seed=7)
    msd, osd = get_state_dict(model, opt)
    _train_step(model, opt)  # materialise the optimizer state the checkpoint overwrites
    msd, osd = get_state_dict(model, opt)
    target = {"model": msd, "optim": osd}
    load_into(ids["fsdp"], target)
    set_state_dict(model, opt, model_state_dict=target["model"], optim_state_dict=target["optim"])
    msd, osd = get_state_dict(model, opt)
    report["diffs"]["fsdp"] = _same(_full({"model": msd, "optim": osd}), ref["fsdp"])

    target = _dt_state(mesh, Shard(0), seed=99, zeros=True)
    loaded = load_into(ids["async"], target)
    report["diffs"]["async"] = _same(_full(loaded), ref["dt"])
    return report


def scenario_kill(store: CheckpointStore, out: Path, rank: int, ws: int) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (ws,))
    state = _dt_state(mesh, Shard(0), seed=1)
    report: dict[str, Any] = {"first": save_distributed(store, "kill", 1, state).id}
    if rank == 1:
        os.environ["CKPT_FAULT_POINT"] = "dcp.chunk_written:1"
    started = time.perf_counter()
    try:
        save_distributed(store, "kill", 2, state)
        report["second"] = "saved"
    except CkptError as exc:
        report["second"] = f"{type(exc).__name__}: {exc}"
    report["error_after_s"] = time.perf_counter() - started
    return report


SCENARIOS = {"save": scenario_save, "load": scenario_load, "kill": scenario_kill}


def run_scenario(scenario: str, store: CheckpointStore, out_dir: Path) -> dict[str, Any]:
    """Run one scenario on this rank and write its report; return the report."""
    rank, ws = dist.get_rank(), dist.get_world_size()
    try:
        report = SCENARIOS[scenario](store, out_dir, rank, ws)
        report["ok"] = True
    except BaseException as exc:
        report = {"ok": False, "error": f"{type(exc).__name__}: {exc}",
                  "trace": traceback.format_exc()}
    (out_dir / f"{scenario}-ws{ws}-rank{rank}.json").write_text(json.dumps(report, default=str))
    if scenario == "save" and rank == 0:
        (out_dir / "save-rank0.json").write_text(json.dumps(report, default=str))
    return report


def gloo_threads() -> list[str]:
    """Names of this process's gloo threads still running (Linux: ``/proc/self/task``)."""
    names = []
    for task in Path("/proc/self/task").iterdir():
        try:
            name = (task / "comm").read_text().strip()
        except OSError:  # the thread ended while we listed them
            continue
        if "gloo" in name:  # pt_gloo_runloop (ProcessGroupGloo workers), gloo_tcp_loop
            names.append(name)
    return sorted(names)


def shutdown_distributed() -> list[str]:
    """Destroy every process group so that gloo's threads end now; return any left (none).

    ``dist.destroy_process_group()`` alone does not end them here: DTensor's process-wide
    caches (sharding propagation, redistribute planners and transforms, mesh topology) keep
    every DeviceMesh the scenarios used, and a DeviceMesh keeps its process groups (in
    ``_pg_registry``). Gloo's worker threads then run on into interpreter shutdown, where one
    still releasing a finished collective needs the GIL to drop a tensor's Python object;
    CPython ends such a thread with ``pthread_exit``, whose unwinding through gloo's
    ``noexcept`` destructors calls ``std::terminate``: "terminate called without an active
    exception", SIGABRT, now and then. So the caches are dropped and the meshes collected
    first; the last reference to the group then goes in ``destroy_process_group``, whose
    destructor joins the threads while the interpreter is still whole.
    """
    import torch.distributed.tensor._collective_utils as dt_collectives
    import torch.distributed.tensor._redistribute as dt_redistribute
    from torch.distributed.tensor import debug as dt_debug

    dt_debug._clear_sharding_prop_cache()
    dt_redistribute.clear_redistribute_planner_cache()
    dt_redistribute._gen_transform_infos.cache_clear()
    dt_collectives.MeshTopoInfo.build_from_mesh.cache_clear()
    gc.collect()  # FSDP modules and their meshes sit in reference cycles
    dist.destroy_process_group()
    return gloo_threads()


def main() -> int:
    scenarios, root, out_dir = sys.argv[1].split(","), sys.argv[2], Path(sys.argv[3])
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank = dist.get_rank()
    # Rank 0 opens (and on first use creates) the catalog before the others.
    if rank != 0:
        dist.barrier()
    store = CheckpointStore.open(root, chunk_bytes=256 * 1024)
    if rank == 0:
        dist.barrier()
    for scenario in scenarios:
        run_scenario(scenario, store, out_dir)
        if scenario != "kill":
            dist.barrier()  # the next scenario reads this one's reports and references
    store.close()
    left = shutdown_distributed()
    if left:
        print(f"rank {rank}: gloo threads outlived destroy_process_group(): {left}",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
