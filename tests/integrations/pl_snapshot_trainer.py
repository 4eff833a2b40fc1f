"""A Lightning run with ``CkptStoreIO(snapshot_interval=1)``, as a child process of
test_lightning.

Usage: ``python pl_snapshot_trainer.py <store> <shm root> <run> <max steps> <log> <hold>``,
or :func:`train` with those arguments in a child of a forkserver that preloaded Lightning (as
test_lightning does: importing it costs seconds per process).
Trains a tiny MLP for ``max steps`` global steps (a ``ModelCheckpoint`` save every 4),
resuming with ``ckpt_path="<run>@latest"`` when the run has a checkpoint or a snapshot.
Appends to ``log``: ``start <step> <digest>`` once the state is restored (0 when fresh) and
``done <step> <digest>`` after each optimizer step, once the step's snapshot is taken (its
commit may still be running). The digest is a sha256 of the weights and the optimizer's
tensors. After logging step ``hold`` (> 0) it waits, at most 120 s, to be killed.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from trainer_support import state_digest

from ckptstore.errors import CheckpointNotFoundError
from ckptstore.integrations.lightning import CkptStoreCallback, CkptStoreIO
from ckptstore.store import CheckpointStore


class _Module(pl.LightningModule):  # type: ignore[misc]
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Tanh(),
                                       torch.nn.Linear(16, 1))

    def training_step(self, batch: Any, index: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.parameters(), lr=0.01)


class _Log(pl.Callback):  # type: ignore[misc]
    """Writes the log lines of the module docstring (listed after CkptStoreCallback, so a
    step is logged after its snapshot was taken)."""

    def __init__(self, out: Any, hold: int) -> None:
        self.out = out
        self.hold = hold

    def on_train_start(self, trainer: Any, module: Any) -> None:
        self.out.write(f"start {trainer.global_step} "
                       f"{state_digest(module, trainer.optimizers[0])}\n")

    def on_train_batch_end(self, trainer: Any, module: Any, *args: Any) -> None:
        step = trainer.global_step
        self.out.write(f"done {step} {state_digest(module, trainer.optimizers[0])}\n")
        if step == self.hold:
            time.sleep(120)  # the parent kills it here at the latest; never hangs for good
            os._exit(3)


def _fit(store: CheckpointStore, run: str, steps: int, out: Any, hold: int,
         ckpt_dir: str, ckpt_path: str | None) -> None:
    gen = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(256, 4, generator=gen),
                                          torch.randn(256, 1, generator=gen))
    io = CkptStoreIO(store, run=run, snapshot_interval=1)
    trainer = pl.Trainer(
        max_steps=steps, plugins=[io], logger=False, enable_progress_bar=False,
        enable_model_summary=False, accelerator="cpu",
        callbacks=[ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=4, save_top_k=-1),
                   CkptStoreCallback(), _Log(out, hold)])
    trainer.fit(_Module(), torch.utils.data.DataLoader(data, batch_size=4),
                ckpt_path=ckpt_path)


def train(store_dir: str, shm_root: str, run: str, steps: str, log: str, hold: str) -> None:
    """Train, resuming from the store's newest state of the run when there is one."""
    torch.set_num_threads(1)
    store = CheckpointStore.open(store_dir, memory_tier_dir=shm_root)
    # Line-buffered, open for the whole life of the process (it may be killed, never closed).
    out = open(log, "a", buffering=1)  # noqa: SIM115
    ckpt_dir = os.path.join(os.path.dirname(log), f"ck-{run}")
    try:
        _fit(store, run, int(steps), out, int(hold), ckpt_dir, f"{run}@latest")
    except CheckpointNotFoundError:  # nothing to resume from: the first start
        _fit(store, run, int(steps), out, int(hold), ckpt_dir, None)
    out.write("finished\n")
    store.close()


def main() -> None:
    """The command line of the module docstring."""
    train(*sys.argv[1:7])


if __name__ == "__main__":
    main()
