"""One rank of a multi-rank training loop with snapshots, run by test_snapshot_world.

Usage: ``python world_trainer.py <run> <steps> <out dir>``, one process per rank, under
``torchrun`` or started by the test with torch's ``RANK``/``WORLD_SIZE``/``MASTER_ADDR``/
``MASTER_PORT`` (and ``LOCAL_RANK``/``LOCAL_WORLD_SIZE``/``GROUP_RANK``). The store comes
from the environment (``CKPT_ROOT``, ``CKPT_HOT``, ``CKPT_CATALOG_URL``, and each node's own
``CKPT_MEMORY_TIER_DIR`` and ``CKPT_HOST``). ``<steps>`` is the last step, or one per rank
(``"6,5"``). ``WORLD_REPLICAS=2`` replicates to the next node (neighbours found through the
process group); ``WORLD_SYNC=1`` averages the gradients across ranks every step (as DDP
does: every rank then needs every other at every step); ``WORLD_PAUSE`` paces the steps;
``WORLD_REPLICATED=1`` makes the rank's own buffer the same on every rank (the whole state is
then replicated, as with DDP; needs ``WORLD_SYNC=1``) and tells the manager so;
``WORLD_HANG_AFTER=K`` stops this rank after step ``K`` (logged) until it is killed (at most
``WORLD_HANG_S`` seconds, then it exits 3): a node lost at a known step.

The state of each rank is a tiny model, its AdamW state and a buffer of its own (different
on every rank, so a rank resuming another's state is caught). Appends to
``<out>/rank<RANK>.log``: ``host <CKPT_HOST> <pid>``, ``resumed <step> <digest>`` (``resumed -1 -``
when fresh), then ``done <step> <digest>`` after every ``mgr.step``, and ``finished``; the
digest is a sha256 of every tensor of the state, so the same inputs give the same digests bit
for bit.

test_snapshot_world.py runs the ranks it starts itself (not those under torchrun) as
:func:`rank_in_child`, children of a forkserver that preloaded torch and ckptstore (a fresh
interpreter costs seconds of imports per rank).
"""

from __future__ import annotations

import datetime
import hashlib
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ckptstore.hooks.manager import CheckpointManager
from ckptstore.store import CheckpointStore


def digest(state: dict[str, Any]) -> str:
    """sha256 of the state's tensors in a fixed order."""
    h = hashlib.sha256()
    tensors = [(f"model.{k}", v) for k, v in sorted(state["model"].items())]
    tensors.append(("own", state["own"]))
    for index in sorted(state["optim"]["state"]):
        for name, t in sorted(state["optim"]["state"][index].items()):
            tensors.append((f"optim.{index}.{name}", t))
    for name, t in tensors:
        h.update(name.encode())
        h.update(t.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def main() -> None:
    """Train to the last step, resuming from the ranks' agreed snapshot when there is one."""
    run, steps_arg, out_dir = sys.argv[1:4]
    # Bounded: a rank whose peer is gone fails its collective after this, not after 30 min.
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    steps = [int(s) for s in steps_arg.split(",")]
    last = steps[rank] if len(steps) > 1 else steps[0]
    sync = os.environ.get("WORLD_SYNC") == "1"
    replicas = int(os.environ.get("WORLD_REPLICAS", "1"))
    pause = float(os.environ.get("WORLD_PAUSE", "0"))
    replicated = os.environ.get("WORLD_REPLICATED") == "1"
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 4)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    own = torch.zeros(8)
    store = CheckpointStore.open()
    # Line-buffered, open for the whole life of the process (it may be killed, never closed).
    out = open(Path(out_dir) / f"rank{rank}.log", "a", buffering=1)  # noqa: SIM115
    out.write(f"host {os.environ.get('CKPT_HOST', '-')} {os.getpid()}\n")
    hang_after = int(os.environ.get("WORLD_HANG_AFTER", "-1"))
    step = -1

    def state_fn() -> dict[str, Any]:
        return {"model": model.state_dict(), "optim": opt.state_dict(), "own": own,
                "step": step}

    mgr = CheckpointManager(store, run, snapshot_interval=1, handle_sigterm=False,
                            history=False, replicas=replicas, replica_host="127.0.0.1",
                            replicated=replicated)
    restored = mgr.restore_latest()
    first = -1
    if restored is not None:
        model.load_state_dict(restored["model"])
        opt.load_state_dict(restored["optim"])
        own.copy_(restored["own"])
        step = first = restored["step"]
        out.write(f"resumed {step} {digest(state_fn())}\n")
    else:
        out.write("resumed -1 -\n")
    for step in range(first + 1, last + 1):  # state_fn reads step
        gen = torch.Generator().manual_seed(1000 * step + rank)
        same = torch.Generator().manual_seed(1000 * step)
        x = torch.randn(8, 16, generator=gen)
        opt.zero_grad()
        model(x).square().mean().backward()
        if sync:
            for p in model.parameters():
                assert p.grad is not None
                dist.all_reduce(p.grad)
                p.grad /= world
        opt.step()
        own.add_(torch.randn(8, generator=same if replicated else gen))
        mgr.step(step, state_fn)
        out.write(f"done {step} {digest(state_fn())}\n")
        if step == hang_after:
            out.write("hanging\n")
            # Waits for the SIGKILL that takes the node away; bounded all the same.
            threading.Event().wait(float(os.environ.get("WORLD_HANG_S", "120")))
            os._exit(3)
        if pause:
            time.sleep(pause)  # pacing only: the test waits on the log, not on time
    mgr.close()
    store.close()
    out.write("finished\n")
    dist.destroy_process_group()


def rank_in_child(args: list[str], env: dict[str, str], drop: list[str], output: str) -> None:
    """:func:`main` in a :mod:`multiprocessing` child: the variables ``drop`` removed from
    the environment and ``env`` added, stdout and stderr appended to the file ``output``,
    ``args`` as on the command line."""
    from process_support import child_main

    child_main(main, __file__, args, env, drop, output)


if __name__ == "__main__":
    main()
