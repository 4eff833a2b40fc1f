#!/usr/bin/env python3
"""The stack's example trainer: a tiny MLP whose checkpoints go to the stack's store.

The store is what the environment says (``CKPT_CATALOG_URL``, ``CKPT_HOT``, ``CKPT_WARM``,
``CKPT_S3_ENDPOINT_URL``, ``CKPT_HOST``, ... or ``CKPT_CONFIG``'s file). Every committed
checkpoint triggers the archive flow (``CheckpointManager(archive=True)``); with
``PREFECT_API_URL`` set that is a ``run_deployment`` of ``ckpt-archive/ckptstore``, which an
agent of the work pool runs. Run again, the trainer resumes from the run's newest checkpoint.

Exit status: 0 when training finished and every archive run was handed to the Prefect server,
1 when a save or a hand-off failed.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

import torch
from torch import nn

from ckptstore.flows import get_runner
from ckptstore.hooks.manager import CheckpointManager
from ckptstore.store import CheckpointStore


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch of ``step``: derived from the step, so a resumed run sees the same data."""
    gen = torch.Generator().manual_seed(10_000 + step)
    x = torch.randn(32, 16, generator=gen)
    return x, x[:, :4].sum(dim=1, keepdim=True)


def main(argv: list[str] | None = None) -> int:
    """Train, save, trigger archiving; returns the exit status."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run", default="mlp-stack", help="run name")
    parser.add_argument("--steps", type=int, default=60, help="train up to this step")
    parser.add_argument("--save-every", type=int, default=None,
                        help="save interval in steps (default: CKPT_SAVE_INTERVAL, else 20)")
    parser.add_argument("--handoff-timeout", type=float, default=120.0,
                        help="seconds to wait for the archive runs to reach the server")
    args = parser.parse_args(argv)

    # A model this small gains nothing from intra-op threads; leave the cores to the saves.
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    store = CheckpointStore.open()
    settings = store.settings
    mgr = CheckpointManager(
        store,
        args.run,
        save_interval=args.save_every or settings.save_interval or 20,
        archive=True,
        config={"model": "mlp-16-32-1", "lr": 3e-3, "batch": 32},
    )
    step = 0

    def state_fn() -> dict[str, Any]:
        return {"model": model.state_dict(), "optim": opt.state_dict(), "step": step}

    restored = mgr.restore_latest()
    start = 1
    if restored is not None:
        model.load_state_dict(restored["model"])
        opt.load_state_dict(restored["optim"])
        start = int(restored["step"]) + 1
        print(f"[{args.run}] resumed from {mgr.resumed_from.ref if mgr.resumed_from else '?'}")
    started = time.perf_counter()
    loss_value = float("nan")
    with mgr:  # leaving waits until the last save is committed (and its archive triggered)
        for step in range(start, args.steps + 1):
            x, y = _batch(step)
            loss = nn.functional.mse_loss(model(x), y)
            opt.zero_grad(set_to_none=True)
            torch.autograd.backward(loss)
            opt.step()
            loss_value = loss.item()
            mgr.step(step, state_fn, metrics={"loss": loss_value})
    print(f"[{args.run}] trained steps {start}..{args.steps} in "
          f"{time.perf_counter() - started:.1f}s, final loss {loss_value:.4f}")

    # The archive triggers only enqueue; hand every run to the server before exiting, and say
    # whether each hand-off worked (the runs themselves finish on the agents).
    source = str(settings.source) if settings.source is not None else None
    runner = get_runner(str(settings.root), source)
    idle = runner.wait_idle(args.handoff_timeout)
    failed = [r for r in runner.results if not r.ok]
    for result in runner.results:
        outcome = f"flow run {result.result}" if result.ok else f"FAILED: {result.error}"
        print(f"[{args.run}] archive {result.params.get('ref')}: {outcome}")
    runner.close(wait=False)
    print(f"[{args.run}] {len(store.list(run=args.run))} checkpoint(s) in the catalog")
    store.close()
    if not idle:
        print(f"[{args.run}] archive hand-offs still pending after {args.handoff_timeout}s",
              file=sys.stderr)
    return 0 if idle and not failed else 1


if __name__ == "__main__":
    sys.exit(main())
