"""Train a small Lightning model whose checkpoints go into a ckptstore store, then resume it.

``CkptStoreIO`` replaces Lightning's file writes: every ``ModelCheckpoint`` save becomes a
checkpoint of the run (saved in the background with ``--async-save``), the files Lightning
keeps (top-k, ``last.ckpt``) become aliases plus small pointer files, and files Lightning
drops lose their alias so the store's retention can prune them. ``CkptStoreCallback`` records
the logged metrics with each save.

Try it::

    python examples/train_lightning.py --store /tmp/pl-store --steps 40
    python examples/train_lightning.py --store /tmp/pl-store --steps 60 --resume pl-demo@latest
    ckpt ls --run pl-demo --store /tmp/pl-store

Needs the ``lightning`` extra: ``pip install 'ckptstore[lightning]'``.
"""

from __future__ import annotations

import argparse
import logging
import sys
import warnings
from pathlib import Path
from typing import Any

import torch

try:
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import ModelCheckpoint
except ImportError:  # pragma: no cover - shown to people running the example without it
    sys.exit("this example needs Lightning: pip install 'ckptstore[lightning]'")

from ckptstore.integrations.lightning import CkptStoreCallback, CkptStoreIO
from ckptstore.store import CheckpointStore

logger = logging.getLogger("train_lightning")


class Regressor(pl.LightningModule):  # type: ignore[misc]
    """A small MLP on synthetic regression data."""

    def __init__(self, lr: float = 0.01, hidden: int = 64) -> None:
        """Build the model; ``lr`` and ``hidden`` are saved as hyper-parameters."""
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Sequential(torch.nn.Linear(16, hidden), torch.nn.GELU(),
                                       torch.nn.Linear(hidden, 1))

    def training_step(self, batch: Any, index: int) -> torch.Tensor:
        """One MSE step; logs ``train_loss``."""
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss, prog_bar=False)
        return loss

    def configure_optimizers(self) -> Any:
        """AdamW with a step LR schedule."""
        opt = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, 20)}


def data() -> torch.utils.data.DataLoader[Any]:
    """Deterministic synthetic data: y = sum of the first 4 inputs + noise."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1024, 16, generator=gen)
    y = x[:, :4].sum(dim=1, keepdim=True) + 0.1 * torch.randn(1024, 1, generator=gen)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=32)


def main(argv: list[str] | None = None) -> int:
    """Train (or resume) and list the run's checkpoints; returns the exit status."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--store", required=True, help="store directory (created if missing)")
    parser.add_argument("--run", default="pl-demo", help="run name")
    parser.add_argument("--steps", type=int, default=40, help="train until this global step")
    parser.add_argument("--save-every", type=int, default=10, help="checkpoint interval")
    parser.add_argument("--resume", default=None,
                        help="a store reference to resume from, e.g. pl-demo@latest")
    parser.add_argument("--async-save", action="store_true", help="save in the background")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    warnings.filterwarnings("ignore", module="lightning")
    with CheckpointStore.open(args.store) as store:
        io = CkptStoreIO(store, run=args.run, async_save=args.async_save)
        keep = ModelCheckpoint(dirpath=Path(args.store) / "lightning" / args.run, save_top_k=2,
                               monitor="train_loss", every_n_train_steps=args.save_every,
                               save_last="link")
        trainer = pl.Trainer(max_steps=args.steps, plugins=[io],
                             callbacks=[keep, CkptStoreCallback()], logger=False,
                             enable_progress_bar=False, enable_model_summary=False,
                             accelerator="cpu")
        trainer.fit(Regressor(), data(), ckpt_path=args.resume)
        print(f"trained {args.run} to step {trainer.global_step}; best: {keep.best_model_path}")
        for ck in store.list(run=args.run, order_by="created_at"):
            loss = ck.metrics.get("train_loss")
            shown = f"{loss:.4f}" if loss is not None else "-"
            print(f"  {ck.ref:<16} step {ck.step:>4}  train_loss {shown}  "
                  f"aliases {', '.join(ck.aliases) or '-'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
