"""A CkptStoreTrainer run with snapshots every step, as a child process of test_hf_trainer.

Usage: ``python hf_snapshot_trainer.py <store> <shm root> <run> <max steps> <log> <hold>``,
or :func:`train` with those arguments in a child of a forkserver that preloaded this module
(as test_hf_trainer does: importing transformers costs seconds per process).
Trains a tiny BERT for ``max steps`` optimizer steps (a checkpoint every 4), resuming with
``resume_from_checkpoint=True`` when the run has a checkpoint or a snapshot. Appends to
``log``: ``start <step>`` once the state is restored (0 when fresh), ``done <step> <digest>``
when the next step begins or training ends (the step's snapshot is then taken), and
``finished <digest>`` after ``train`` returned. The digest is a sha256 of the weights and the
optimizer's tensors. After logging step ``hold`` (> 0) it waits, at most 120 s, to be killed.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

import torch
import transformers
from trainer_support import TinyData, state_digest

from ckptstore.errors import CheckpointNotFoundError
from ckptstore.integrations.hf_trainer import CkptStoreTrainer
from ckptstore.store import CheckpointStore


class _Log(transformers.TrainerCallback):  # type: ignore[misc]
    """Writes the log lines of the module docstring."""

    def __init__(self, out: Any, hold: int) -> None:
        self.out = out
        self.hold = hold
        self.trainer: CkptStoreTrainer | None = None

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        resumed = self.trainer.resumed_step if self.trainer is not None else None
        self.out.write(f"start {resumed or 0}\n")

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        # The previous step's log, save and snapshot are done when the next step begins.
        if state.global_step > 0:
            self._done(state.global_step, kwargs)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        self._done(state.global_step, kwargs)

    def _done(self, step: int, kwargs: dict[str, Any]) -> None:
        self.out.write(f"done {step} {state_digest(kwargs['model'], kwargs['optimizer'])}\n")
        if step == self.hold:
            time.sleep(120)  # the parent kills it here at the latest; never hangs for good
            os._exit(3)


def train(store_dir: str, shm_root: str, run: str, steps: str, log: str, hold: str) -> None:
    """Train, resuming from the store's newest state of the run when there is one."""
    torch.set_num_threads(1)
    store = CheckpointStore.open(store_dir, memory_tier_dir=shm_root)
    # Line-buffered, open for the whole life of the process (it may be killed, never closed).
    out = open(log, "a", buffering=1)  # noqa: SIM115
    callback = _Log(out, int(hold))
    transformers.set_seed(0)
    config = transformers.BertConfig(vocab_size=100, hidden_size=16, num_hidden_layers=1,
                                     num_attention_heads=2, intermediate_size=32)
    args = transformers.TrainingArguments(
        output_dir=os.path.join(os.path.dirname(log), "out"), max_steps=int(steps),
        save_steps=4, report_to=[], use_cpu=True, per_device_train_batch_size=4,
        logging_steps=1, disable_tqdm=True)
    trainer = CkptStoreTrainer(
        model=transformers.BertForSequenceClassification(config), args=args,
        train_dataset=TinyData(), callbacks=[callback], store=store, run=run,
        snapshot_interval=1)
    callback.trainer = trainer
    try:
        trainer.train(resume_from_checkpoint=True)
    except CheckpointNotFoundError:  # nothing to resume from: the first start
        trainer.train()
    out.write(f"finished {state_digest(trainer.model, trainer.optimizer)}\n")
    store.close()


def main() -> None:
    """The command line of the module docstring."""
    train(*sys.argv[1:7])


if __name__ == "__main__":
    main()
