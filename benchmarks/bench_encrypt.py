"""Encrypted copies against plain ones: archive, bundle export and push throughput, same state.

State: :func:`benchmarks.state.build_state` (GPT-2 small after one AdamW step: 1.49 GB of
fp32 weights and moments; ``--quick``: the 13.9M-parameter preset of the same structure,
167 MB), saved once into a store with a local hot tier and the default codec.

In alternating rounds (default 3, quick 2; the first of each pair rotates every round):

* **archive**: ``archive_checkpoints`` to a warm tier in a local directory, from a store
  without ``[tiers] encrypt_to`` against one with it (the same state saved once into each):
  a plain copy (data, manifest, marker, each read back and compared) against a sealed copy
  under ``.sealed/<copy id>`` (each object encrypted, written and read back). The warm copy
  is deleted after each round.
* **export**: ``export_bundle`` (plain tar of the hot copy) against ``export_sealed`` (the
  same members, each AES-256-GCM encrypted under a fresh data key wrapped for one X25519
  recipient; ``ckpt export --encrypt-to``).
* **push**: ``push_checkpoints`` into a fresh remote store whose warm tier is a local
  directory (copy, read back and compare, commit in its catalog) against ``push_sealed``
  (``ckpt push --encrypt-to``: encrypt and write the objects, envelope last). The encrypted
  push does not read its objects back (the reader checks every chunk's blake3 after
  decryption), so it does less I/O than the plain one; the ratio is what a user sees.

Throughput ratio = plain seconds / encrypted seconds (>= 0.8 is the target: encryption costs
at most 20%). Each round's copies are removed before the next.

Usage::

    python benchmarks/bench_encrypt.py [--quick] [--rounds N] [--tmp DIR] [--out FILE]

Prints one line per round and the medians; writes ``bench-out/encrypt.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import time
from functools import partial
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    # Run as a script: make ``benchmarks.*`` importable from the repository root.
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from benchmarks.harness import fmt_bytes, release_free_memory
from benchmarks.state import build_state, state_bytes
from ckptstore import CheckpointStore
from ckptstore.format.sealed import SEALED_DIR
from ckptstore.ops.sharing.bundle import export_bundle
from ckptstore.ops.sharing.crypt import generate_encryption_keypair
from ckptstore.ops.sharing.push import push_checkpoints
from ckptstore.ops.sharing.sealed import export_sealed
from ckptstore.ops.sharing.sealed_remote import push_sealed
from ckptstore.ops.tiering.archive import archive_checkpoints
from ckptstore.ops.tiering.replicas import delete_replica

REPO = Path(__file__).resolve().parent.parent
TARGET = 0.8


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; return the exit status."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="13.9M-parameter model (167 MB)")
    p.add_argument("--rounds", type=int, default=None, help="rounds (default 3, quick 2)")
    p.add_argument("--tmp", type=Path, default=None,
                   help="scratch folder (default: bench-out/tmp in the repository)")
    p.add_argument("--out", type=Path, default=REPO / "bench-out" / "encrypt.json")
    args = p.parse_args(argv)
    tmp = (args.tmp or REPO / "bench-out" / "tmp").resolve() / f"encrypt-{os.getpid()}"
    tmp.mkdir(parents=True)
    try:
        return _run(args, tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _timed(fn: Any) -> float:
    start = time.perf_counter()
    fn()
    elapsed = time.perf_counter() - start
    release_free_memory()
    return elapsed


def _remote(tmp: Path, name: str) -> Path:
    config = tmp / f"{name}.toml"
    config.write_text(f'root = "{tmp / name}"\n[tiers]\nwarm = "{tmp / name / "warm"}"\n')
    return config


def _run(args: argparse.Namespace, tmp: Path) -> int:
    preset = "quick" if args.quick else "gpt2-small"
    rounds = args.rounds or (2 if args.quick else 3)
    _, pub = generate_encryption_keypair(tmp / "keys", "bench")
    store = CheckpointStore.open(tmp / "store", warm=str(tmp / "warm"))
    sealing = CheckpointStore.open(tmp / "sealing", warm=str(tmp / "sealing-warm"),
                                   encrypt_to=[str(pub)])
    rows: list[dict[str, Any]] = []
    try:
        state = build_state(preset)
        nbytes = state_bytes(state)
        ck = store.save("bench", 1, state)
        sealed_ck = sealing.save("bench", 1, state)
        del state
        release_free_memory()
        print(f"state: {fmt_bytes(nbytes)} ({preset}); {platform.machine()}, "
              f"{os.cpu_count()} CPUs, torch {torch.__version__}, threads "
              f"{store.settings.threads}", flush=True)
        for r in range(rounds):
            plain_tar, sealed_tar = tmp / "plain.tar", tmp / "sealed.tar"
            remote = CheckpointStore.open(config=_remote(tmp, f"remote-{r}"))
            try:
                jobs = {
                    "archive_plain": partial(archive_checkpoints, store, ref=ck.id),
                    "archive_sealed": partial(archive_checkpoints, sealing, ref=sealed_ck.id),
                    "export_plain": partial(export_bundle, store, ck.id, plain_tar),
                    "export_sealed": partial(export_sealed, store, ck.id, sealed_tar, [pub]),
                    "push_plain": partial(push_checkpoints, store, remote, [ck.id],
                                          remote="bench"),
                    "push_sealed": partial(push_sealed, store, remote, [ck.id],
                                           remote="bench", encrypt_to=[pub]),
                }
                order = list(jobs)
                if r % 2:  # swap each plain/encrypted pair
                    order = [order[i ^ 1] for i in range(len(order))]
                times = {name: _timed(jobs[name]) for name in order}
                remote.tier("warm").delete_prefix(f"{SEALED_DIR}/")
                for owner, done in ((store, ck), (sealing, sealed_ck)):
                    delete_replica(owner, owner.get(done.id), "warm")
            finally:
                remote.close()
                shutil.rmtree(tmp / f"remote-{r}", ignore_errors=True)
            plain_tar.unlink(missing_ok=True)
            sealed_tar.unlink(missing_ok=True)
            row = {"round": r + 1, **times,
                   "archive_ratio": times["archive_plain"] / times["archive_sealed"],
                   "export_ratio": times["export_plain"] / times["export_sealed"],
                   "push_ratio": times["push_plain"] / times["push_sealed"]}
            rows.append(row)
            print(f"round {r + 1}: archive plain {times['archive_plain']:.2f} s, encrypted "
                  f"{times['archive_sealed']:.2f} s ({row['archive_ratio']:.2f}x) | "
                  f"export plain {times['export_plain']:.2f} s, encrypted "
                  f"{times['export_sealed']:.2f} s ({row['export_ratio']:.2f}x) | push plain "
                  f"{times['push_plain']:.2f} s, encrypted {times['push_sealed']:.2f} s "
                  f"({row['push_ratio']:.2f}x)", flush=True)
    finally:
        store.close()
        sealing.close()
    archive_ratio = statistics.median(row["archive_ratio"] for row in rows)
    export_ratio = statistics.median(row["export_ratio"] for row in rows)
    push_ratio = statistics.median(row["push_ratio"] for row in rows)
    for what, ratio in (("archive", archive_ratio), ("export", export_ratio), ("push", push_ratio)):
        verdict = "met" if ratio >= TARGET else "MISSED"
        print(f"{what}: encrypted / plain throughput {ratio:.2f}x (target >= {TARGET}: "
              f"{verdict})")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "preset": preset, "state_bytes": nbytes, "rounds": rows,
        "archive_ratio_median": archive_ratio, "export_ratio_median": export_ratio,
        "push_ratio_median": push_ratio,
        "target": TARGET,
        "machine": {"arch": platform.machine(), "cpus": os.cpu_count(),
                    "torch": torch.__version__},
    }, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
