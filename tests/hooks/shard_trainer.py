"""One rank of a job whose state is sharded (DTensors ``Shard(0)`` over a 1-D CPU mesh, or
with ``SHARD_MESH=AxB`` a 2-D mesh: 2-D tensors ``[Shard(0), Shard(1)]``, 1-D ones
``[Shard(0), Replicate()]``), run by test_snapshot_shards.

Usage: ``python shard_trainer.py <run> <last step> <out dir>``, one process per rank, started
by the test with torch's ``RANK``/``WORLD_SIZE``/``MASTER_ADDR``/``MASTER_PORT`` (and the
store's ``CKPT_*`` variables, each rank a node of its own). ``WORLD_REPLICAS=2`` replicates
to the next node. A world of one rank is made ``distributed=True`` (the resharding restart is
the multi-rank one).

The state is a plain dict of DTensors (``params``: three tensors whose rows split unevenly,
one with fewer rows than ranks) plus an optimizer-like dict (``optim``: a momentum DTensor per
parameter and a plain ``step`` tensor, the same on every rank). Each step adds the same
seeded update to the global tensors, so the state of a step does not depend on the world size.
After each ``mgr.step`` rank 0 saves the gathered full tensors to ``<out>/full<step>.pt``;
after a resume every rank saves its local shards and their offsets to
``<out>/resumed<world>_rank<RANK>.pt`` and logs ``resumed <step>`` to
``<out>/rank<RANK>.log`` (``resumed -1`` when fresh).

test_snapshot_shards.py runs each rank as :func:`rank_in_child`, a child of a forkserver that
preloaded torch and ckptstore (a fresh interpreter costs seconds of imports per rank).
"""

from __future__ import annotations

import datetime
import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from ckptstore.hooks.manager import CheckpointManager
from ckptstore.store import CheckpointStore

#: Rows that split unevenly over 2 and 3 ranks; ``bias`` has fewer rows than 3 ranks.
SHAPES = {"weight": (7, 3), "emb": (5, 2), "bias": (2,)}


def main() -> None:
    """Train to the last step, resuming the shards from the agreed snapshots when any."""
    run, last_arg, out_dir = sys.argv[1:4]
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    shape = os.environ.get("SHARD_MESH")
    mesh = init_device_mesh("cpu", tuple(int(n) for n in shape.split("x")) if shape else (world,))
    out = Path(out_dir)

    def shard(full: torch.Tensor) -> Any:
        if mesh.ndim == 1:
            return distribute_tensor(full, mesh, [Shard(0)])
        return distribute_tensor(full, mesh, [Shard(0), Shard(1) if full.dim() > 1
                                              else Replicate()])

    gen = torch.Generator().manual_seed(0)
    params = {k: shard(torch.randn(s, generator=gen)) for k, s in SHAPES.items()}
    optim = {"momentum": {k: shard(torch.zeros(s)) for k, s in SHAPES.items()},
             "step": torch.zeros((), dtype=torch.int64)}
    state = {"params": params, "optim": optim, "step": -1}
    store = CheckpointStore.open()
    log = open(out / f"rank{rank}.log", "a", buffering=1)  # noqa: SIM115
    mgr = CheckpointManager(store, run, snapshot_interval=1, handle_sigterm=False,
                            history=False, replica_host="127.0.0.1",
                            replicas=int(os.environ.get("WORLD_REPLICAS", "1")),
                            # A world of one rank agrees (with itself) only when told to.
                            distributed=True if world == 1 else None)
    restored = mgr.restore_latest(into=state)
    first = -1
    if restored is not None:
        # The DTensors were filled in place; the rest comes from the snapshot.
        assert all(restored["params"][k] is params[k] for k in SHAPES)
        optim["step"].copy_(restored["optim"]["step"])
        first = restored["step"]
        torch.save({"step": first, "shards": {
            f"{group}.{k}": (tuple(d[k].__create_chunk_list__()[0].offsets),
                             d[k].to_local().clone())
            for group, d in (("params", params), ("momentum", optim["momentum"]))
            for k in SHAPES}}, out / f"resumed{world}_rank{rank}.pt")
    log.write(f"resumed {first}\n")
    for step in range(first + 1, int(last_arg) + 1):
        state["step"] = step
        upd = torch.Generator().manual_seed(1000 + step)
        for k, s in SHAPES.items():
            grad = shard(torch.randn(s, generator=upd))
            momentum = optim["momentum"][k]
            momentum.mul_(0.9).add_(grad)
            params[k].add_(momentum, alpha=-0.1)
        optim["step"].add_(1)
        mgr.step(step, lambda: state)
        fulls = {f"params.{k}": params[k].full_tensor() for k in SHAPES}
        fulls.update({f"momentum.{k}": optim["momentum"][k].full_tensor() for k in SHAPES})
        if rank == 0:
            torch.save(fulls, out / f"full{step}.pt")
        log.write(f"done {step}\n")
    mgr.close()
    store.close()
    log.write("finished\n")
    dist.destroy_process_group()


def rank_in_child(args: list[str], env: dict[str, str], drop: list[str], output: str) -> None:
    """:func:`main` in a :mod:`multiprocessing` child: the variables ``drop`` removed from
    the environment and ``env`` added, stdout and stderr appended to the file ``output``,
    ``args`` as on the command line."""
    from process_support import child_main

    child_main(main, __file__, args, env, drop, output)


if __name__ == "__main__":
    main()
