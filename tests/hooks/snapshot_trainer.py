"""A deterministic training loop with snapshots, run as a child process by test_snapshots.

Usage: ``python snapshot_trainer.py <store> <shm root> <run> <steps> <log> [save_interval]``
(test_snapshots.py runs :func:`train_in_child` in a child of a forkserver that preloaded
torch and ckptstore instead: a fresh interpreter costs seconds of imports per start)
(``$TRAINER_PEER=host:port``: also replicate each snapshot to that replica server;
``$TRAINER_ASYNC=1``: asynchronous snapshot copies, guarded by the optimizer's pre-hook).
Appends ``resumed <step> <digest>`` once restored (``resumed -1 -`` when fresh) and
``done <step> <digest>`` after every ``mgr.step``, where the digest is a sha256 of every
tensor of the state after that step; the same inputs give the same digests bit for bit.
"""

from __future__ import annotations

import hashlib
import os
import sys
import time
from typing import Any

import torch

from ckptstore.hooks.manager import CheckpointManager
from ckptstore.store import CheckpointStore


def digest(state: dict[str, Any]) -> str:
    """sha256 of the state's tensors in a fixed order."""
    h = hashlib.sha256()
    for name, p in sorted(state["model"].items()):
        h.update(name.encode())
        h.update(p.detach().contiguous().view(torch.uint8).numpy().tobytes())
    for index in sorted(state["optim"]["state"]):
        for name, t in sorted(state["optim"]["state"][index].items()):
            h.update(f"{index}.{name}".encode())
            h.update(t.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def train(store_dir: str, shm_root: str, run: str, steps: str, log: str,
          save_interval: int = 7) -> None:
    """Train ``steps`` steps, resuming from the store when it holds a state."""
    pause = float(os.environ.get("TRAINER_PAUSE", "0.01"))
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 8))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    store = CheckpointStore.open(store_dir, memory_tier_dir=shm_root)
    # Line-buffered, open for the whole life of the process (it is killed, never closed).
    out = open(log, "a", buffering=1)  # noqa: SIM115

    def state_fn() -> dict[str, Any]:
        return {"model": model.state_dict(), "optim": opt.state_dict(), "step": step}

    peer = os.environ.get("TRAINER_PEER")  # host:port of a neighbour's replica server
    # $TRAINER_ASYNC=1: the snapshot copy overlaps the next step, the optimizer guarded.
    snapshot_async = os.environ.get("TRAINER_ASYNC") == "1"
    mgr = CheckpointManager(store, run, snapshot_interval=1, save_interval=save_interval,
                            handle_sigterm=False, history=False,
                            replicas=2 if peer else 1, peer=peer or None,
                            snapshot_async=snapshot_async,
                            optimizer=opt if snapshot_async else None)
    restored = mgr.restore_latest()
    step = first = -1
    if restored is not None:
        model.load_state_dict(restored["model"])
        opt.load_state_dict(restored["optim"])
        step = first = restored["step"]
        out.write(f"resumed {step} {digest(state_fn())}\n")
    else:
        out.write("resumed -1 -\n")
    for step in range(first + 1, int(steps)):  # state_fn reads step
        gen = torch.Generator().manual_seed(1000 + step)
        x = torch.randn(16, 32, generator=gen)
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
        mgr.step(step, state_fn)
        out.write(f"done {step} {digest(state_fn())}\n")
        time.sleep(pause)
    mgr.close()
    store.close()
    out.write("finished\n")


def main() -> None:
    """:func:`train` on the command line's arguments."""
    store_dir, shm_root, run, steps, log = sys.argv[1:6]
    save_interval = int(sys.argv[6]) if len(sys.argv) > 6 else 7
    train(store_dir, shm_root, run, steps, log, save_interval)


def train_in_child(args: list[str], env: dict[str, str], err: str) -> None:
    """:func:`train` in a :mod:`multiprocessing` child: ``env`` added to the environment
    (``$CKPT_FAULT_POINT``, ``$TRAINER_*``), the child's stderr appended to the file ``err``,
    ``args`` as on the command line."""
    os.environ.update(env)
    fd = os.open(err, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 2)
    os.close(fd)
    train(*args[:5], *(int(a) for a in args[5:]))


if __name__ == "__main__":
    main()
