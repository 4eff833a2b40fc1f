"""Hugging Face Trainer saves: the write-once ``CkptStoreTrainer`` against the plain ``Trainer``.

Model: a GPT-2 language model built from a config (no hub download; ``HF_HUB_OFFLINE=1``):
6 layers, width 384, vocabulary 16k (17M parameters, 204 MB per checkpoint with the AdamW
moments); ``--quick``: 2 layers, width 128, vocabulary 4k (0.9M parameters, 11 MB).
Every trainer is built the same way and trained one step (so the optimizer has its
moments). Then, in ONE run with the rounds interleaved (the order rotates every round),
each does one real training step (untimed, followed by a tiny nudge of every weight and
moment, so the store's chunk dedup finds nothing to reuse, as after hundreds of real steps)
and one timed checkpoint save through the ``Trainer``'s own ``_save_checkpoint`` at the
next global step, with ``save_total_limit=2`` for all (rotation is part of a save):

- *plain*: ``transformers.Trainer`` writing ``checkpoint-N`` (safetensors weights,
  ``torch.save`` of optimizer, scheduler and RNG states, trainer state, config, training
  arguments), then every file and directory fsynced, as the store does for its own writes
  (the Trainer itself does not fsync, so its time without that would not be a durable save);
- *store*: ``CkptStoreTrainer(codec="none")`` writing the same state, uncompressed like the
  plain folder, as one store checkpoint (durable, catalogued, metrics recorded): the number
  the target is about. The best-model alias, retention and the loss history run after the
  commit on the trainer's background thread (see ``src/ckptstore/integrations/hf_trainer.py``);
- *store-lz4* (reported, no target): the same with Blosc-LZ4 (``codec="lz4"``);
- *store-async* (reported, no target): ``CkptStoreTrainer(codec="none",
  async_save=True)``: the time the training loop is blocked (staging), and the time until
  the background save committed.

Ratios against *plain* are computed per round, then the median is taken. Target: the
write-once durable save takes <= 1.0x the plain Trainer's.

Usage::

    python benchmarks/bench_hf.py [--quick] [--rounds N] [--tmp DIR] [--out FILE]

Writes ``bench-out/hf.json``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import shutil
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    # Run as a script: make ``benchmarks.*`` importable from the repository root.
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the model is built from a config
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch

from benchmarks.harness import (
    dir_usage,
    fmt_bytes,
    fmt_summary,
    fsync_dir,
    fsync_file,
    release_free_memory,
)

REPO = Path(__file__).resolve().parent.parent
logger = logging.getLogger("bench_hf")
TARGET = 1.0

#: (layers, width, heads, vocabulary) of the GPT-2 config.
SIZES = {"full": (6, 384, 6, 16384), "quick": (2, 128, 2, 4096)}
SEQ = 64


class Tokens(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    """Deterministic random token sequences (causal LM: labels are the inputs)."""

    def __init__(self, vocab: int) -> None:
        self.vocab = vocab

    def __len__(self) -> int:
        return 64

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        gen = torch.Generator().manual_seed(index)
        ids = torch.randint(0, self.vocab, (SEQ,), generator=gen)
        return {"input_ids": ids, "labels": ids}


#: The compared methods: (label, CkptStoreTrainer options or None for the plain Trainer).
METHODS: dict[str, dict[str, Any] | None] = {
    "plain": None,
    "store": {"codec": "none"},
    "store-lz4": {"codec": "lz4"},
    "store-async": {"codec": "none", "async_save": True},
}


def build(kind: str, out: Path, size: str, store: Any = None) -> Any:
    """A trainer of the given kind, trained one step so the optimizer holds its moments."""
    import transformers

    from ckptstore.integrations.hf_trainer import CkptStoreTrainer

    layers, width, heads, vocab = SIZES[size]
    transformers.set_seed(0)
    config = transformers.GPT2Config(n_layer=layers, n_embd=width, n_head=heads,
                                     vocab_size=vocab, n_positions=SEQ)
    model = transformers.GPT2LMHeadModel(config)
    args = transformers.TrainingArguments(
        output_dir=str(out), max_steps=1, save_strategy="no", save_total_limit=2,
        per_device_train_batch_size=4, logging_steps=1, report_to=[], use_cpu=True,
        disable_tqdm=True,
    )
    data = Tokens(vocab)
    options = METHODS[kind]
    if options is None:
        trainer = transformers.Trainer(model=model, args=args, train_dataset=data)
    else:
        trainer = CkptStoreTrainer(model=model, args=args, train_dataset=data, store=store,
                                   run=kind, **options)
    trainer.train()
    return trainer


def train_step(trainer: Any, batch: dict[str, torch.Tensor]) -> None:
    """One optimizer step outside the timing, then every weight and moment nudged.

    One step leaves the embedding rows of tokens absent from the batch, and their AdamW
    moments (zeros), unchanged, so the store's chunk dedup and lz4 would skip or shrink
    them; between two real saves hundreds of steps change everything. The nudge (1e-6
    relative noise, positive for the second moments) stands for those steps, the same for
    every method.
    """
    model = trainer.model
    model.train()
    loss = model(**batch).loss
    loss.backward()
    trainer.optimizer.step()
    trainer.lr_scheduler.step()
    trainer.optimizer.zero_grad()
    with torch.no_grad():
        for param in model.parameters():
            param.mul_(1 + 1e-6 * torch.randn_like(param))
        for moments in trainer.optimizer.state.values():
            for name in ("exp_avg", "exp_avg_sq"):
                if name in moments:
                    moments[name].add_(1e-12 * torch.rand_like(moments[name]))
    trainer.state.global_step += 1
    trainer.state.log_history.append({"loss": float(loss), "step": trainer.state.global_step})


def fsync_tree(root: Path) -> None:
    """fsync every file and directory under ``root``, then ``root``'s parent."""
    for dirpath, _dirs, names in os.walk(root):
        for name in names:
            fsync_file(Path(dirpath) / name)
        fsync_dir(Path(dirpath))
    fsync_dir(root.parent)


def timed_save(kind: str, trainer: Any, out: Path) -> tuple[float, float | None]:
    """One durable save; returns (seconds the caller waited, seconds until committed)."""
    release_free_memory()
    t0 = time.perf_counter()
    trainer._save_checkpoint(trainer.model, trial=None)
    if METHODS[kind] is None:
        fsync_tree(out / f"checkpoint-{trainer.state.global_step}")
    blocked = time.perf_counter() - t0
    if not (METHODS[kind] or {}).get("async_save"):
        return blocked, None
    trainer.wait()
    return blocked, time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    """Run the interleaved rounds and print the table; exit status 0 (targets reported)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="small model, 5 rounds")
    p.add_argument("--rounds", type=int, default=None, help="timed rounds (default 8, quick 5)")
    p.add_argument("--tmp", type=Path, default=None, help="scratch directory")
    p.add_argument("--out", type=Path, default=REPO / "bench-out" / "hf.json")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.ERROR)
    warnings.filterwarnings("ignore")
    try:
        import transformers
    except ImportError:
        print("bench_hf: transformers is not installed (pip install 'ckptstore[hf]'); skipped")
        return 0
    transformers.logging.set_verbosity_error()
    from ckptstore.store import CheckpointStore

    size = "quick" if args.quick else "full"
    rounds = args.rounds or (5 if args.quick else 8)
    tmp = (args.tmp or REPO / "bench-out" / "tmp").resolve() / f"hf-{os.getpid()}"
    tmp.mkdir(parents=True, exist_ok=True)
    print(f"# bench_hf ({size}): {platform.node()}, {os.cpu_count()} CPUs, torch "
          f"{torch.__version__}, transformers {transformers.__version__}, python "
          f"{platform.python_version()}")
    started = time.perf_counter()
    kinds = tuple(METHODS)
    waited: dict[str, list[float]] = {k: [] for k in kinds}
    committed: list[float] = []
    ratios: dict[str, list[float]] = {k: [] for k in kinds if k != "plain"}
    stored: dict[str, int] = {}
    try:
        store = CheckpointStore.open(tmp / "store")
        try:
            outs = {k: tmp / k for k in kinds}
            trainers = {k: build(k, outs[k], size, store) for k in kinds}
            params = sum(t.numel() for t in trainers["plain"].model.parameters())
            batch = Tokens(SIZES[size][3])[0]
            batch = {k: v.unsqueeze(0).repeat(4, 1) for k, v in batch.items()}
            # Untimed warm-up round: first writes, lazy imports, the staging pool.
            for kind in kinds:
                train_step(trainers[kind], batch)
                timed_save(kind, trainers[kind], outs[kind])
            plain_dir = outs["plain"] / f"checkpoint-{trainers['plain'].state.global_step}"
            stored["plain"], checkpoint_files = dir_usage(plain_dir)
            print(f"model: GPT-2 {SIZES[size][0]} layers, width {SIZES[size][1]}, "
                  f"{params / 1e6:.1f}M parameters; one checkpoint folder "
                  f"{fmt_bytes(stored['plain'])} in {checkpoint_files} files; "
                  f"{rounds} rounds, order rotating")
            for rnd in range(rounds):
                shift = rnd % len(kinds)
                this: dict[str, float] = {}
                for kind in kinds[shift:] + kinds[:shift]:
                    train_step(trainers[kind], batch)
                    seconds, until_commit = timed_save(kind, trainers[kind], outs[kind])
                    this[kind] = seconds
                    waited[kind].append(seconds)
                    if until_commit is not None:
                        committed.append(until_commit)
                for kind, values in ratios.items():
                    values.append(this[kind] / this["plain"])
            for t in trainers.values():
                if hasattr(t, "wait"):
                    t.wait()
            live: dict[str, int] = {}
            for ck in store.list():
                live[ck.run] = live.get(ck.run, 0) + 1
                stored[ck.run] = ck.stored_bytes
        finally:
            store.close()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    ratio = statistics.median(ratios["store"])
    ok = ratio <= TARGET
    rows: list[tuple[str, list[float], str]] = [
        ("plain Trainer: checkpoint-N folder + fsync", waited["plain"], "plain"),
        ("CkptStoreTrainer(codec='none'): one store checkpoint (durable, catalogued)",
         waited["store"], "store"),
        ("CkptStoreTrainer (codec='lz4')", waited["store-lz4"],
         "store-lz4"),
        ("CkptStoreTrainer(codec='none', async_save=True): training loop blocked",
         waited["store-async"], "store-async"),
        ("CkptStoreTrainer(codec='none', async_save=True): until committed", committed, ""),
    ]
    print("\n| save | seconds: median (min-max) | x plain, per round | bytes on disk |")
    print("|---|---|---|---|")
    for label, values, kind in rows:
        per_round = fmt_summary(ratios[kind], 2) if kind in ratios else "-"
        size_text = fmt_bytes(stored[kind]) if kind in stored else "-"
        print(f"| {label} | {fmt_summary(values, 3)} | {per_round} | {size_text} |")
    print(f"\ntarget: write-once durable save time <= {TARGET:.1f}x the plain Trainer's "
          f"(both uncompressed): {ratio:.2f}x -> {'met' if ok else 'MISSED'}")
    print(f"(no target) with codec='lz4': "
          f"{statistics.median(ratios['store-lz4']):.2f}x; training loop blocked by an async "
          f"save: {statistics.median(ratios['store-async']):.2f}x")
    if args.quick:
        print(f"note: --quick checkpoints are {fmt_bytes(stored['plain'])}; there the fixed "
              "cost of a store checkpoint (catalog transactions, one fsync per chunk and "
              "metadata file) weighs more than at the full size")
    print(f"save_total_limit=2 honoured by the store: {live}")
    results: dict[str, Any] = {
        "quick": args.quick, "size": size, "rounds": rounds, "params": params,
        "checkpoint_files": checkpoint_files, "stored_bytes": stored,
        "seconds": waited, "store_async_committed_s": committed,
        "ratios": ratios, "ratio": ratio, "target": TARGET, "met": ok,
        "elapsed_s": time.perf_counter() - started,
    }
    print(f"(total {results['elapsed_s']:.0f}s)")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
