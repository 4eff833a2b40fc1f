"""Archive (hot → S3 warm) and demote (warm → cold) against a real moto server."""

from __future__ import annotations

import logging
import threading
import traceback
from pathlib import Path
from typing import Any

import pytest
import torch

from ckptstore import CheckpointStore, ReplicaState, StorageError
from ckptstore.errors import ConfigError, ConflictError, ThawPendingError
from ckptstore.ops.tiering.archive import archive_checkpoints, demote_checkpoints
from ckptstore.ops.tiering.replicas import delete_replica, store_tiers
from ckptstore.ops.tiering.restore import restore_checkpoint
from ckptstore.ops.upkeep.verify import verify_replicas
from ckptstore.storage import is_retryable, iter_chunks
from ckptstore.storage.transfer import owned_files
from ckptstore.testing.s3 import MotoS3

pytestmark = pytest.mark.s3


def _state(seed: int, n: int = 3000) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(seed)
    return {
        "model": {"w": torch.randn(n, generator=gen), "b": torch.arange(64, dtype=torch.int64)},
        "step": seed,
        "half": torch.randn(500, generator=gen).to(torch.bfloat16),
    }


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    return bool(a == b)


def _s3_keys(store: CheckpointStore, tier: str, run: str, ckpt_id: str) -> list[str]:
    t = store_tiers(store)[tier]
    return t.list_prefix(t.prefix_for(run, ckpt_id))


def _open_small_chunks(tmp_path: Path, s3: MotoS3, name: str) -> CheckpointStore:
    return CheckpointStore.open(
        tmp_path / name, warm=s3.url(f"{name}-{id(tmp_path):x}/warm"),
        cold=s3.url(f"{name}-{id(tmp_path):x}/cold"), cold_storage_class="STANDARD_IA",
        storage_options=s3.storage_options, chunk_bytes=4096,
    )


def test_archive_copies_verifies_and_records(tiered_store: CheckpointStore) -> None:
    store = tiered_store
    first = store.save("run-a", 1, _state(1))
    second = store.save("run-a", 2, _state(2))
    written: list[int] = []
    report = archive_checkpoints(store, tier="warm", progress=written.append)
    assert report.archived == [first.id, second.id]
    assert report.ok and report.bytes == sum(written) > 0
    for ck in (first, second):
        now = store.get(ck.id)
        warm = now.replica("warm")
        assert warm is not None and warm.state == ReplicaState.PRESENT
        assert warm.verified_at is not None and warm.bytes > 0
        assert warm.uri.startswith("s3://") and warm.uri.endswith(f"run-a/{ck.id}")
        assert now.replica("hot").state == ReplicaState.PRESENT  # type: ignore[union-attr]
        keys = _s3_keys(store, "warm", "run-a", ck.id)
        # Every file of the hot copy but the chunks it shares with the first checkpoint
        # (hard links there): on S3 those stay under the first one's prefix, once.
        shared = {
            f"{a.name}/c/{c.i}" for a in store.manifest(ck.id).arrays.values()
            for c in a.chunks if c.src is not None
        }
        hot_files = sorted(
            str(p.relative_to(store.hot)) for p in store.checkpoint_dir("run-a", ck.id).rglob("*")
            if p.is_file() and str(p.relative_to(store.checkpoint_dir("run-a", ck.id)))
            not in shared
        )
        assert keys == hot_files
        assert [e.kind for e in store.events(ck.id)].count("archived") == 1
    # Idempotent: nothing left to do.
    again = archive_checkpoints(store, tier="warm")
    assert again.archived == [] and again.ok


def test_archive_then_load_only_from_s3(tiered_store: CheckpointStore) -> None:
    store = tiered_store
    state = _state(7)
    ck = store.save("run-b", 5, state)
    archive_checkpoints(store, ref=ck.ref)
    assert delete_replica(store, ck, "hot") > 0
    assert not store.checkpoint_dir("run-b", ck.id).exists()
    path = restore_checkpoint(store, ck.ref)
    assert path == store.checkpoint_dir("run-b", ck.id)
    assert _equal(store.load(ck.ref), state)


def test_reencode_is_applied_and_reported(tiered_store: CheckpointStore) -> None:
    # Behaviour in depth: tests/ops/tiering/test_reencode.py.
    ck = tiered_store.save("run-c", 1, _state(3))
    report = archive_checkpoints(tiered_store, ref=ck.id, reencode="zstd-3")
    assert report.archived == [ck.id]
    assert report.reencode == "zstd-3" and list(report.reencoded) == [ck.id]


def test_archive_to_unconfigured_tier(store: CheckpointStore) -> None:
    with pytest.raises(ConfigError, match="not configured"):
        archive_checkpoints(store, tier="warm")
    with pytest.raises(ConfigError):
        archive_checkpoints(store, tier="hot")


def test_s3_outage_mid_archive_then_rerun(tmp_path: Path) -> None:
    with MotoS3() as s3:
        store = _open_small_chunks(tmp_path, s3, "outage")
        try:
            state = _state(11, n=20_000)  # ~80 KB of float32 = ~20 chunk files of 4 KiB
            ck = store.save("run-o", 1, state)
            puts: list[int] = []
            lock = threading.Lock()

            def stop_after_five(nbytes: int) -> None:
                with lock:
                    puts.append(nbytes)
                    if len(puts) == 5:
                        s3.stop()

            with pytest.raises(StorageError) as info:
                archive_checkpoints(store, tier="warm", progress=stop_after_five, threads=2)
            assert is_retryable(info.value)
            assert "warm tier" in str(info.value)
            now = store.get(ck.id)
            assert now.replica("warm").state == ReplicaState.DELETED  # type: ignore[union-attr]
            assert now.replica("hot").state == ReplicaState.PRESENT  # type: ignore[union-attr]
            assert store.checkpoint_dir("run-o", ck.id).joinpath("COMMITTED").is_file()
            assert [e.kind for e in store.events(ck.id)].count("archived") == 0

            s3.start()
            # Whatever the failed run left has no marker: it is not a checkpoint.
            keys = _s3_keys(store, "warm", "run-o", ck.id)
            assert not any(k.endswith("COMMITTED") for k in keys)
            report = archive_checkpoints(store, tier="warm")
            assert report.archived == [ck.id]
            delete_replica(store, ck, "hot")
            restore_checkpoint(store, ck.ref)
            assert _equal(store.load(ck.ref), state)
        finally:
            store.close()


def test_rerun_after_crash_copies_only_missing(tiered_store: CheckpointStore) -> None:
    store = tiered_store
    ck = store.save("run-r", 1, _state(5))
    warm = store_tiers(store)["warm"]
    hot = store_tiers(store)["hot"]
    # A crashed run left two files (one of them corrupt) and no marker.
    keys = hot.list_prefix(hot.prefix_for("run-r", ck.id))
    chunk = next(k for k in keys if "/c/" in k)
    meta = next(k for k in keys if k.endswith("zarr.json"))
    warm.put_bytes(chunk, hot.get_bytes(chunk))
    warm.put_bytes(meta, b"garbage")
    written: list[int] = []
    archive_checkpoints(store, tier="warm", progress=written.append)
    assert len(written) == len(keys) - 1  # the intact chunk was kept
    assert warm.get_bytes(meta) == hot.get_bytes(meta)


def test_concurrent_archive_runs_copy_each_checkpoint_once(
    tiered_store: CheckpointStore,
) -> None:
    store = tiered_store
    cks = [store.save("run-p", step, _state(step, n=500)) for step in range(4)]
    # Each checkpoint's own files (the chunks a later one shares are linked into its hot
    # directory, but uploaded once, under the first one's prefix).
    files = sum(len(owned_files(store.manifest(ck.id))) for ck in cks)
    puts: list[int] = []
    lock = threading.Lock()
    reports: list[Any] = []
    errors: list[BaseException] = []

    def count(nbytes: int) -> None:
        with lock:
            puts.append(nbytes)

    def worker() -> None:
        try:
            reports.append(archive_checkpoints(store, tier="warm", progress=count))
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=worker) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors
    archived = [i for r in reports for i in r.archived]
    assert sorted(archived) == sorted(ck.id for ck in cks)
    assert len(puts) == files
    for ck in cks:
        assert [e.kind for e in store.events(ck.id)].count("archived") == 1


def test_credentials_never_leak_from_archive(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    secret = "SECRET-MARKER-5f1c2b9e77"
    caplog.set_level(logging.DEBUG)
    with MotoS3(secret_access_key=secret) as s3:
        store = CheckpointStore.open(
            tmp_path / "creds", warm="s3://no-such-bucket-ckpt/warm",
            storage_options=s3.storage_options,
        )
        try:
            ck = store.save("run-s", 1, _state(1, n=100))
            texts = []
            for _ in range(2):
                try:
                    archive_checkpoints(store, tier="warm")
                except StorageError as exc:
                    texts.append("".join(traceback.format_exception(exc)))
                s3.stop()
            s3.start()
            events = [str(e) for e in store.events(ck.id)]
        finally:
            store.close()
    assert len(texts) == 2
    everything = "\n".join(texts + events + [r.getMessage() for r in caplog.records])
    assert secret not in everything
    assert "no-such-bucket-ckpt" in texts[0]


def test_demote_warm_to_cold(tiered_store: CheckpointStore) -> None:
    store = tiered_store
    state = _state(21)
    ck = store.save("run-d", 1, state)
    archive_checkpoints(store, tier="warm")
    assert demote_checkpoints(store, older_than_days=1).archived == []  # too young
    report = demote_checkpoints(store, older_than_days=0)
    assert report.archived == [ck.id] and report.removed == [ck.id]
    now = store.get(ck.id)
    assert now.replica("cold").state == ReplicaState.PRESENT  # type: ignore[union-attr]
    assert now.replica("warm").state == ReplicaState.DELETED  # type: ignore[union-attr]
    assert _s3_keys(store, "warm", "run-d", ck.id) == []
    assert "demoted" in [e.kind for e in store.events(ck.id)]
    delete_replica(store, ck, "hot")
    restore_checkpoint(store, ck.ref)
    assert store.get(ck.id).replica("hot").state == ReplicaState.PRESENT  # type: ignore[union-attr]
    assert _equal(store.load(ck.ref), state)


def test_delta_archives_its_base_first_and_base_copies_are_protected(
    tiered_store: CheckpointStore, save_delta: Any
) -> None:
    store = tiered_store
    base_state = _state(31, n=4000)
    base = store.save("run-x", 1, base_state)
    delta_state = {**base_state, "step": 2, "half": base_state["half"] + 1}
    delta = save_delta(store, "run-x", 2, delta_state, base)
    report = archive_checkpoints(store, ref=delta.id)
    assert report.archived == [base.id, delta.id]
    # The hot delta reads the base's hot chunks: that copy may not go first.
    with pytest.raises(ConflictError, match="read by other checkpoints"):
        delete_replica(store, base, "hot")
    delete_replica(store, delta, "hot")
    delete_replica(store, base, "hot")
    assert not store.checkpoint_dir("run-x", base.id).exists()
    # Restoring the delta brings its base back whole.
    restore_checkpoint(store, delta.id)
    assert store.get(base.id).replica("hot").state == ReplicaState.PRESENT  # type: ignore[union-attr]
    assert _equal(store.load(delta.id), delta_state)
    # Chunk-level reclamation keeps exactly the chunk files the warm delta reads.
    delete_replica(store, base, "warm", keep_referenced=True)
    kept = _s3_keys(store, "warm", "run-x", base.id)
    reads = [r for r in iter_chunks(store.manifest(delta.id)) if r.owner == base.id]
    assert len(kept) == len(reads) > 0 and all("/c/" in k for k in kept)
    assert store.get(base.id).replica("warm").state == ReplicaState.DELETED  # type: ignore[union-attr]


def test_demote_keeps_a_base_copy_its_deltas_still_read(
    tiered_store: CheckpointStore, save_delta: Any
) -> None:
    store = tiered_store
    base = store.save("run-y", 1, _state(41))
    delta = save_delta(store, "run-y", 2, {**_state(41), "step": 2}, base)
    archive_checkpoints(store)
    report = demote_checkpoints(store, older_than_days=0, run="run-y")
    assert report.archived == [base.id, delta.id]
    assert sorted(report.removed) == sorted([base.id, delta.id])
    assert store.get(base.id).replica("warm").state == ReplicaState.DELETED  # type: ignore[union-attr]


def test_demote_to_glacier_is_size_verified_and_a_restore_thaws_it(
    tmp_path: Path, s3: MotoS3
) -> None:
    store = CheckpointStore.open(
        tmp_path / "glacier", warm=s3.url(f"g{id(tmp_path):x}/warm"),
        cold=s3.url(f"g{id(tmp_path):x}/cold"), cold_storage_class="GLACIER",
        storage_options=s3.storage_options,
    )
    try:
        ck = store.save("run-g", 1, _state(51))
        archive_checkpoints(store, tier="warm")
        report = demote_checkpoints(store, older_than_days=0)
        assert report.archived == [ck.id] and report.removed == [ck.id]
        cold = store.get(ck.id).replica("cold")
        assert cold is not None and cold.state == ReplicaState.PRESENT and cold.verified_at
        # Only presence and sizes can be checked without a restore request.
        assert verify_replicas(store, ref=ck.id, tier="cold").ok == [f"{ck.id}@cold"]
        delete_replica(store, ck, "hot")
        # Not readable until S3 restores the objects: the restore asks for that (the thaw
        # itself is tests/ops/tiering/test_thaw.py) and says when it should be ready.
        with pytest.raises(ThawPendingError, match="thawing, expected ready in"):
            restore_checkpoint(store, ck.id)
    finally:
        store.close()


def test_archive_to_a_local_warm_tier(tmp_path: Path) -> None:
    store = CheckpointStore.open(tmp_path / "s", warm=str(tmp_path / "nas"))
    try:
        state = _state(61)
        ck = store.save("run-l", 1, state)
        archive_checkpoints(store)
        assert (tmp_path / "nas" / "run-l" / ck.id / "COMMITTED").is_file()
        assert store.get(ck.id).replica("warm").uri == str(tmp_path / "nas" / "run-l" / ck.id)  # type: ignore[union-attr]
        delete_replica(store, ck, "hot")
        restore_checkpoint(store, ck.id)
        assert _equal(store.load(ck.id), state)
        assert verify_replicas(store).clean
    finally:
        store.close()
