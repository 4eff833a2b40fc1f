"""Archive to S3 and restore from S3: ckptstore against a plain ``s3fs`` upload and the hot tier.

Endpoint: a real moto S3 server on 127.0.0.1 (:class:`ckptstore.testing.s3.MotoS3`, fake
credentials in the environment). moto is an in-process Python server sharing the CPUs with the
benchmark, so absolute MB/s are far below real S3; the same-round ratios are what matter.

State: the synthetic transformer training state of ``bench_convert.py`` (weights + AdamW
moments, fp32), ~300 MB (``--quick``: ~50 MB), saved once with the store's defaults (codec
``lz4``, 8 MiB chunks) into a store whose warm tier is ``s3://<bucket>/warm``.

Then, in alternating rounds (default 3; the first of each pair rotates every round):

* **archive**: ``archive_checkpoints(store, ref=id, tier="warm")``: per file read the hot copy,
  check its crc32c against the manifest, PUT (``If-None-Match: *``), GET it back and compare
  crc32c, then record the verified replica in the catalog. Every byte crosses the wire twice.
* **s3fs.put**: ``S3FileSystem.put(<hot checkpoint dir>, "<bucket>/baseline/rN",
  recursive=True)`` of the same files: one PUT each, nothing verified. Then, timed apart,
  **read back**: ``fs.cat`` of every uploaded object + crc32c compared with the local file's
  (local crc32c computed beforehand, untimed), i.e. the verification archive does; and
  **s3fs.get**: ``fs.get(..., <dir>, recursive=True)`` of the same objects (download only, the
  baseline of a restore).
* **load from hot**: ``store.load(id)`` with the hot copy in the page cache, and again after
  evicting its pages (``posix_fadvise(DONTNEED)``, where available).
* **load from S3**: the hot copy is deleted as retention would (``delete_replica(store, ck,
  "hot")``), then
  ``restore_checkpoint(store, id, to=<dir>)`` (S3 → a plain directory, then every chunk
  re-hashed with blake3: ``deep=True``, the default) and ``store.load(id)``, which restores to
  the hot tier the same way (verified, recorded) and then loads.

After each round the warm copy is deleted (``delete_replica(store, ck, "warm")``), so the next
round copies everything again. Ratios are computed per round, then the median is reported.

Usage::

    python benchmarks/bench_archive.py [--quick] [--rounds N] [--tmp DIR] [--out FILE]

Prints a table; writes ``bench-out/archive.json``.
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
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    # Run as a script: make ``benchmarks.*`` importable from the repository root.
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import crc32c
import s3fs
import torch

from benchmarks.bench_convert import build_state
from benchmarks.harness import (
    can_evict,
    dir_usage,
    evict,
    fmt_bytes,
    fmt_summary,
    release_free_memory,
    resident_fraction,
)
from benchmarks.state import fingerprint, state_bytes
from ckptstore import CheckpointStore
from ckptstore.ops.tiering.archive import archive_checkpoints
from ckptstore.ops.tiering.replicas import delete_replica
from ckptstore.ops.tiering.restore import restore_checkpoint
from ckptstore.records import Checkpoint, ReplicaState
from ckptstore.testing.s3 import MotoS3

__all__ = ["main"]

REPO = Path(__file__).resolve().parent.parent

ARCHIVE = "archive (PUT + read back + record)"
PUT = "s3fs.put (PUT only)"
READBACK = "s3fs read back + crc32c"
GET = "s3fs.get to a dir (download only)"
HOT = "store.load, hot (page cache)"
HOT_COLD = "store.load, hot (cold cache)"
RESTORE_DIR = "restore_checkpoint(to=dir) from S3"
LOAD_S3 = "store.load, S3 only (restore + load)"


def _timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    started = time.perf_counter()
    out = fn()
    return time.perf_counter() - started, out


def _present(store: CheckpointStore, ck: Checkpoint, tier: str) -> bool:
    replica = store.get(ck.id).replica(tier)
    return replica is not None and replica.state == ReplicaState.PRESENT


class _Baseline:
    """Plain s3fs transfers of a checkpoint directory: upload, read-back check, download."""

    def __init__(self, s3: MotoS3) -> None:
        # Its own instance (not s3fs's shared cache), so the store's client is not reused.
        self.fs = s3fs.S3FileSystem(endpoint_url=s3.endpoint_url, skip_instance_cache=True)
        self.bucket = s3.bucket

    def put(self, local: Path, prefix: str) -> None:
        self.fs.put(str(local), f"{self.bucket}/{prefix}", recursive=True)

    def read_back(self, local: Path, prefix: str, crcs: dict[str, int]) -> int:
        """Download every object under ``prefix`` and compare with ``crcs``; return bytes."""
        root = f"{self.bucket}/{prefix}"
        self.fs.invalidate_cache()
        objects = self.fs.find(root)
        if len(objects) != len(crcs):
            raise AssertionError(f"{len(objects)} objects under {root}, expected {len(crcs)}")
        total = 0
        # fs.cat on a list fetches concurrently (s3fs's async batch), like archive's threads.
        for path, data in self.fs.cat(objects).items():
            rel = path[len(root) + 1:]
            if crc32c.crc32c(data) != crcs[rel]:
                raise AssertionError(f"{path} differs from {local / rel} after upload")
            total += len(data)
        return total

    def get(self, prefix: str, local: Path) -> None:
        self.fs.get(f"{self.bucket}/{prefix}", str(local), recursive=True)

    def remove(self, prefix: str) -> None:
        self.fs.rm(f"{self.bucket}/{prefix}", recursive=True)
        self.fs.invalidate_cache()


def _local_crcs(root: Path) -> dict[str, int]:
    return {
        str(p.relative_to(root)): crc32c.crc32c(p.read_bytes())
        for p in sorted(root.rglob("*")) if p.is_file()
    }


def _warm_up(store: CheckpointStore, base: _Baseline, tmp: Path) -> None:
    """Every step once on a tiny checkpoint: imports, S3 connections, first-call set-up."""
    ck = store.save("warmup", 1, {"w": torch.ones(1024)})
    archive_checkpoints(store, ref=ck.id, tier="warm")
    directory = store.checkpoint_dir(ck.run, ck.id)
    base.put(directory, "baseline/warmup")
    base.read_back(directory, "baseline/warmup", _local_crcs(directory))
    base.get("baseline/warmup", tmp / "get-warmup")
    shutil.rmtree(tmp / "get-warmup")
    base.remove("baseline/warmup")
    delete_replica(store, ck, "hot")
    restore_checkpoint(store, ck.id, to=tmp / "restore-warmup")
    shutil.rmtree(tmp / "restore-warmup")
    store.load(ck.id)
    delete_replica(store, store.get(ck.id), "warm")


def run(target_bytes: int, rounds: int, tmp: Path) -> dict[str, Any]:
    """Start moto, save once, then alternate the measured steps for ``rounds`` rounds."""
    state = build_state(target_bytes)
    nbytes = state_bytes(state)
    expected = fingerprint(state)
    with MotoS3(fail_fast=False) as s3:
        # fail_fast=False: default botocore timeouts and retries; moto on a loaded 2-core
        # machine can take longer than the fail-fast 20 s read timeout for a large GET.
        store = CheckpointStore.open(tmp / "store", warm=s3.url("warm"),
                                     storage_options=s3.storage_options, memory_tier_bytes=0)
        base = _Baseline(s3)
        try:
            _warm_up(store, base, tmp)
            started = time.perf_counter()
            ck = store.save("bench", 1, state)
            save_s = time.perf_counter() - started
            del state
            release_free_memory()
            directory = store.checkpoint_dir(ck.run, ck.id)
            stored, files = dir_usage(directory)
            crcs = _local_crcs(directory)
            times: dict[str, list[float]] = {
                name: [] for name in (ARCHIVE, PUT, READBACK, GET, HOT, HOT_COLD, RESTORE_DIR,
                                      LOAD_S3)
            }
            archived_bytes = 0
            # Proof that eviction works here (mincore), for the cold-cache row.
            evicted: list[float | None] = []

            def archive() -> None:
                nonlocal archived_bytes
                seconds, report = _timed(
                    lambda: archive_checkpoints(store, ref=ck.id, tier="warm"))
                if report.archived != [ck.id]:
                    raise AssertionError(f"archive did not copy {ck.id}: {report.summary()}")
                archived_bytes = report.bytes
                times[ARCHIVE].append(seconds)

            def baseline(r: int) -> None:
                prefix = f"baseline/r{r}"
                times[PUT].append(_timed(lambda: base.put(directory, prefix))[0])
                seconds, got = _timed(lambda: base.read_back(directory, prefix, crcs))
                if got != stored:
                    raise AssertionError(f"read back {got} bytes, uploaded {stored}")
                times[READBACK].append(seconds)
                out = tmp / f"get-{r}"
                times[GET].append(_timed(lambda: base.get(prefix, out))[0])
                got, _ = dir_usage(out)
                if got != stored:
                    raise AssertionError(f"s3fs.get wrote {got} bytes, uploaded {stored}")
                shutil.rmtree(out)
                base.remove(prefix)

            def check(loaded: Any, what: str) -> None:
                if fingerprint(loaded) != expected:
                    raise AssertionError(f"{what} returned different values")

            def from_hot() -> None:
                seconds, loaded = _timed(lambda: store.load(ck.id))
                check(loaded, HOT)
                times[HOT].append(seconds)
                del loaded
                release_free_memory()
                if can_evict():
                    evict(directory)
                    if not evicted:
                        evicted.append(resident_fraction(directory))
                    seconds, loaded = _timed(lambda: store.load(ck.id))
                    check(loaded, HOT_COLD)
                    times[HOT_COLD].append(seconds)
                    del loaded
                    release_free_memory()

            def from_s3(r: int) -> None:
                # The hot copy goes the way retention removes it; the warm copy is verified.
                delete_replica(store, store.get(ck.id), "hot")
                out = tmp / f"restore-{r}"
                seconds, _ = _timed(lambda: restore_checkpoint(store, ck.id, to=out))
                times[RESTORE_DIR].append(seconds)
                shutil.rmtree(out)
                if _present(store, ck, "hot"):
                    raise AssertionError("restore to a directory recorded a hot replica")
                seconds, loaded = _timed(lambda: store.load(ck.id))
                check(loaded, LOAD_S3)
                times[LOAD_S3].append(seconds)
                del loaded
                release_free_memory()
                if not _present(store, ck, "hot"):
                    raise AssertionError("store.load did not restore the hot copy")

            for r in range(rounds):
                steps: list[Callable[[], None]] = [archive, partial(baseline, r)]
                if r % 2:
                    steps.reverse()
                loads: list[Callable[[], None]] = [from_hot, partial(from_s3, r)]
                if r % 2:
                    loads.reverse()
                for step in steps + loads:
                    step()
                # Next round copies everything again (hot is PRESENT and verified again).
                delete_replica(store, store.get(ck.id), "warm")
                print(f"round {r + 1}/{rounds}: " + "; ".join(
                    f"{name} {values[-1]:.2f}s" for name, values in times.items()
                    if len(values) > r), flush=True)
        finally:
            store.close()

    def ratio(num: str, den: str | tuple[str, ...]) -> float | None:
        dens = (den,) if isinstance(den, str) else den
        if not times[num] or any(not times[d] for d in dens):
            return None
        per_round = [times[num][i] / sum(times[d][i] for d in dens)
                     for i in range(len(times[num]))]
        return statistics.median(per_round)

    return {
        "state_bytes": nbytes,
        "stored_bytes": stored,
        "archived_bytes": archived_bytes,
        "files": files,
        "codec": ck.codec,
        "save_s": save_s,
        "resident_after_evict": evicted[0] if evicted else None,
        "rounds": rounds,
        "times": times,
        "ratios": {
            "archive / s3fs.put": ratio(ARCHIVE, PUT),
            "archive / (s3fs.put + read back)": ratio(ARCHIVE, (PUT, READBACK)),
            "load S3 only / load hot (page cache)": ratio(LOAD_S3, HOT),
            "load S3 only / load hot (cold cache)": ratio(LOAD_S3, HOT_COLD),
            "restore_checkpoint(to=dir) / s3fs.get": ratio(RESTORE_DIR, GET),
        },
    }


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; return the exit status (0: measured; targets are not enforced)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="~50 MB state instead of ~300 MB")
    p.add_argument("--rounds", type=int, default=3, help="alternating rounds (default 3)")
    p.add_argument("--tmp", type=Path, default=None,
                   help="scratch folder (default: bench-out/tmp in the repository)")
    p.add_argument("--out", type=Path, default=REPO / "bench-out" / "archive.json")
    args = p.parse_args(argv)
    if args.rounds < 1:
        p.error("--rounds must be at least 1")
    # moto's werkzeug server and botocore log every request otherwise.
    logging.basicConfig(level=logging.ERROR)

    tmp = (args.tmp or REPO / "bench-out" / "tmp").resolve() / f"archive-{os.getpid()}"
    tmp.mkdir(parents=True)
    print(f"# bench_archive ({'quick' if args.quick else 'full'}): {platform.machine()}, "
          f"{os.cpu_count()} CPUs, torch {torch.__version__}, s3fs {s3fs.__version__}",
          flush=True)
    started = time.perf_counter()
    try:
        result = run(int(50e6 if args.quick else 300e6), args.rounds, tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    result["quick"] = args.quick
    result["elapsed_s"] = time.perf_counter() - started
    _print(result)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    return 0


def _print(result: dict[str, Any]) -> None:
    stored = result["stored_bytes"]
    print(f"\nstate {fmt_bytes(result['state_bytes'])}; hot copy {fmt_bytes(stored)} in "
          f"{result['files']} files (codec {result['codec']}), saved in "
          f"{result['save_s']:.2f}s; archive reported {fmt_bytes(result['archived_bytes'])}; "
          f"resident after evict {result['resident_after_evict']}")
    print(f"\n| step | seconds, median (min-max) over {result['rounds']} rounds | MB/s |")
    print("|---|---|---:|")
    for name, values in result["times"].items():
        if not values:
            continue
        print(f"| {name} | {fmt_summary(values)} | "
              f"{stored / statistics.median(values) / 1e6:.0f} |")
    print("\nMB/s = bytes of the hot copy / median time. Archive verifies every file on S3 "
          "(GET back + crc32c) before recording it; restores re-hash every chunk (blake3).")
    print("\n| ratio (median of per-round ratios) | value |")
    print("|---|---:|")
    for name, value in result["ratios"].items():
        print(f"| {name} | {'-' if value is None else f'{value:.2f}x'} |")


if __name__ == "__main__":
    raise SystemExit(main())
