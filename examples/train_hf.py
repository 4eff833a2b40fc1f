"""Fine-tune a tiny BERT with the Hugging Face Trainer, its checkpoints written once, straight
into a store, then resume from a store reference.

``CkptStoreTrainer`` is a ``transformers.Trainer`` whose checkpoint saves go into the store
instead of ``checkpoint-N`` folders: weights, optimizer, scheduler, RNG states and trainer
state become one checkpoint of the run per save step, with the logged metrics, and the
training loss goes into the run's metric history (``ckpt ui`` plots it). ``save_total_limit``
is applied by the store's retention. ``trainer.train(resume_from_checkpoint="run@latest")``
resumes with the Trainer's own resume, bit-exactly, anywhere the store is reachable.
(``ckptstore.integrations.hf.CkptStoreCallback`` is the alternative that ingests the folders
the plain Trainer writes; it writes every checkpoint twice.)

The model is built from a config (no download) and trained on synthetic data.

Try it::

    python examples/train_hf.py --store /tmp/hf-store --steps 8
    python examples/train_hf.py --store /tmp/hf-store --steps 12 --resume bert-demo@latest

Needs the ``hf`` extra: ``pip install 'ckptstore[hf]'``.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything is built locally
try:
    import transformers
except ImportError:  # pragma: no cover - shown to people running the example without it
    sys.exit("this example needs transformers: pip install 'ckptstore[hf]'")

from ckptstore.integrations.hf_trainer import CkptStoreTrainer
from ckptstore.store import CheckpointStore

logger = logging.getLogger("train_hf")


class Synthetic(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    """Token sequences whose label is whether token 0 is even (learnable, deterministic)."""

    def __len__(self) -> int:
        """Number of examples."""
        return 256

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        """Example ``index``."""
        gen = torch.Generator().manual_seed(index)
        ids = torch.randint(0, 100, (16,), generator=gen)
        return {"input_ids": ids, "labels": torch.tensor(int(ids[0]) % 2)}


def make_trainer(store: CheckpointStore, run: str, output_dir: str, steps: int,
                 save_every: int) -> Any:
    """A store-writing Trainer for a 1-layer BERT classifier built from its config."""
    transformers.set_seed(0)
    config = transformers.BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=1,
                                     num_attention_heads=2, intermediate_size=64)
    model = transformers.BertForSequenceClassification(config)
    args = transformers.TrainingArguments(
        output_dir=output_dir, max_steps=steps, save_steps=save_every, logging_steps=1,
        per_device_train_batch_size=8, report_to=[], use_cpu=True, disable_tqdm=True,
        save_total_limit=2,
    )
    return CkptStoreTrainer(model=model, args=args, train_dataset=Synthetic(),
                            store=store, run=run)


def main(argv: list[str] | None = None) -> int:
    """Train (or resume) and list the run's checkpoints; returns the exit status."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--store", required=True, help="store directory (created if missing)")
    parser.add_argument("--run", default="bert-demo", help="run name")
    parser.add_argument("--steps", type=int, default=8, help="train until this global step")
    parser.add_argument("--save-every", type=int, default=4, help="checkpoint interval")
    parser.add_argument("--resume", default=None, help="a store reference to resume from")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    transformers.logging.set_verbosity_error()
    with CheckpointStore.open(args.store) as store, tempfile.TemporaryDirectory() as scratch:
        # output_dir gets no checkpoint folder: the store keeps the checkpoints.
        trainer = make_trainer(store, args.run, str(Path(scratch) / "out"), args.steps,
                               args.save_every)
        if args.resume:
            print(f"resuming from {args.resume}")
        trainer.train(resume_from_checkpoint=args.resume)
        print(f"trained {args.run} to step {trainer.state.global_step}")
        for ck in store.list(run=args.run, order_by="created_at"):
            loss = ck.metrics.get("loss")
            shown = f"{loss:.4f}" if loss is not None else "-"
            print(f"  {ck.ref:<18} step {ck.step:>4}  loss {shown}  "
                  f"{ck.stored_bytes / 1e6:.2f} MB stored")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
