"""Train a tiny MLP with checkpointing, crash it, rerun it: it resumes where it left off.

A plain PyTorch loop on synthetic regression data. ``CheckpointManager`` saves every
``--save-every`` steps in the background (the loop only waits while the state is copied into
host memory), keeps the newest ``--keep-last`` checkpoints on the hot tier, and resumes from
the newest committed checkpoint when the script is run again. A ``LossMonitor`` saves a
pinned ``anomaly`` checkpoint if the loss spikes or turns NaN.

Try it::

    python examples/train_mlp.py --store /tmp/mlp-store --steps 400 --crash-at 230
    python examples/train_mlp.py --store /tmp/mlp-store --steps 400    # resumes at 201
    python examples/train_mlp.py --store /tmp/mlp2 --steps 300 --spike-at 150

``--crash-at K`` kills the process with ``os._exit`` at step K (no cleanup, like a node
failure): saves still in flight are lost, committed ones are not. Because batches are derived
from the step number, a resumed run sees exactly the data it would have seen.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from typing import Any

import torch
from torch import nn

from ckptstore.hooks.loss_monitor import LossMonitor
from ckptstore.hooks.manager import CheckpointManager
from ckptstore.store import CheckpointStore

logger = logging.getLogger("train_mlp")


def make_model() -> nn.Module:
    """A small MLP: 32 inputs → 64 → 64 → 1."""
    return nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(),
                         nn.Linear(64, 1))


def batch(step: int, *, spike: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch of ``step`` (deterministic, so a resumed run sees the same data)."""
    gen = torch.Generator().manual_seed(10_000 + step)
    x = torch.randn(64, 32, generator=gen)
    y = x[:, :4].sum(dim=1, keepdim=True) + 0.1 * torch.randn(64, 1, generator=gen)
    if spike:
        # A corrupted batch: labels off by a lot, which makes the loss jump for one step.
        y = y + 25.0
    return x, y


def main(argv: list[str] | None = None) -> int:
    """Run the demo; returns the process exit status."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--store", required=True, help="store directory (created if missing)")
    parser.add_argument("--run", default="mlp-demo", help="run name")
    parser.add_argument("--steps", type=int, default=400, help="train up to this step")
    parser.add_argument("--save-every", type=int, default=50, help="save interval in steps")
    parser.add_argument("--keep-last", type=int, default=3, help="checkpoints kept on hot tier")
    parser.add_argument("--crash-at", type=int, default=None, help="os._exit at this step")
    parser.add_argument("--spike-at", type=int, default=None, help="corrupt this step's batch")
    args = parser.parse_args(argv)
    # The demo prints what happens itself; the library's warnings would repeat it.
    logging.basicConfig(level=logging.ERROR, format="%(levelname)s %(name)s: %(message)s")

    # A model this small gains nothing from intra-op threads; one thread also leaves the other
    # core to the background save.
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    store = CheckpointStore.open(args.store)
    mgr = CheckpointManager(
        store,
        args.run,
        save_interval=args.save_every,
        keep_last=args.keep_last,
        async_save=True,
        config={"model": "mlp-32-64-64-1", "lr": 3e-3, "batch": 64},
    )
    monitor = LossMonitor(window_size=50, threshold=0.5, manager=mgr)

    step = 0

    def state_fn() -> dict[str, Any]:
        return {"model": model.state_dict(), "optim": opt.state_dict(), "step": step}

    restored = mgr.restore_latest()
    if restored is None:
        start = 1
        print(f"[{args.run}] no checkpoint yet: starting from step 1")
    else:
        model.load_state_dict(restored["model"])
        opt.load_state_dict(restored["optim"])
        start = int(restored["step"]) + 1
        assert mgr.resumed_from is not None
        print(f"[{args.run}] resumed from {mgr.resumed_from.ref} (step {restored['step']})")

    started = time.perf_counter()
    blocked = 0.0
    saves = 0
    loss_value = float("nan")
    with mgr:  # closing waits until the last saves are committed
        for step in range(start, args.steps + 1):
            x, y = batch(step, spike=step == args.spike_at)
            loss = nn.functional.mse_loss(model(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            loss_value = loss.item()
            # The monitor first: an anomaly save counts as this step's save for the manager.
            if monitor.update(step, loss_value):
                print(f"  step {step:5d}  loss {loss_value:8.4f}  LOSS ANOMALY, pinned save: "
                      f"{monitor.anomalies[-1].reason}")
            result = mgr.step(step, state_fn, metrics={"loss": loss_value})
            if result is not None:
                saves += 1
                blocked += getattr(result, "blocked_s", 0.0)
                print(f"  step {step:5d}  loss {loss_value:8.4f}  save submitted")
            if step == args.crash_at:
                print(f"  step {step:5d}  simulated crash (os._exit): in-flight saves are lost")
                sys.stdout.flush()
                os._exit(3)
    elapsed = time.perf_counter() - started
    print(f"[{args.run}] trained steps {start}..{args.steps} in {elapsed:.2f}s, final loss "
          f"{loss_value:.4f}; {saves} saves, training blocked {blocked * 1e3:.1f} ms in total")
    print(f"[{args.run}] checkpoints on the hot tier (keep_last={args.keep_last} + pinned):")
    for ck in store.list(run=args.run, order_by="step"):
        flags = ", ".join(filter(None, ["pinned" if ck.pinned else "", *ck.tags]))
        loss_at = ck.metrics.get("loss", float("nan"))
        print(f"    {ck.ref:>16}  step {ck.step:5d}  loss {loss_at:8.4f}  "
              f"{ck.stored_bytes:>8d} B  {flags}")
    store.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
