"""Restore from S3 tiers into the hot tier (or any directory), and safe replica deletion."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from ckptstore import CheckpointNotFoundError, CheckpointStore, ReplicaState
from ckptstore.errors import ConflictError
from ckptstore.format import read_checkpoint, read_manifest
from ckptstore.ops.tiering.archive import archive_checkpoints
from ckptstore.ops.tiering.replicas import delete_replica, store_tiers
from ckptstore.ops.tiering.restore import ensure_hot, restore_checkpoint

pytestmark = pytest.mark.s3


def _state(seed: int) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(2000, generator=gen), "i": torch.arange(10), "note": f"s{seed}"}


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    return bool(a == b)


def _archived_only(store: CheckpointStore, run: str, step: int, state: Any,
                   tier: str = "warm") -> Any:
    ck = store.save(run, step, state)
    archive_checkpoints(store, ref=ck.id, tier=tier)
    delete_replica(store, ck, "hot")
    return store.get(ck.id)


def test_restore_to_hot_records_replica_and_event(tiered_store: CheckpointStore) -> None:
    store = tiered_store
    state = _state(1)
    ck = _archived_only(store, "run-a", 1, state)
    written: list[int] = []
    path = restore_checkpoint(store, ck.ref, progress=written.append)
    assert path == store.checkpoint_dir("run-a", ck.id)
    hot = store.get(ck.id).replica("hot")
    assert hot is not None and hot.state == ReplicaState.PRESENT and hot.verified_at
    assert hot.bytes == sum(written)
    events = [e for e in store.events(ck.id) if e.kind == "restored"]
    assert events and events[0].detail["from"] == "warm"
    assert _equal(store.load(ck.id), state)
    # Already hot: nothing is copied again.
    again: list[int] = []
    assert restore_checkpoint(store, ck.ref, progress=again.append) == path
    assert again == []


def test_store_load_is_transparent(tiered_store: CheckpointStore) -> None:
    if not hasattr(CheckpointStore, "tiers"):
        pytest.skip("store.py does not route loads through ops.restore.ensure_hot yet")
    store = tiered_store
    state = _state(9)
    ck = _archived_only(store, "run-z", 1, state)
    assert _equal(store.load(ck.ref), state)
    assert store.get(ck.id).replica("hot").state == ReplicaState.PRESENT  # type: ignore[union-attr]


def test_ensure_hot(tiered_store: CheckpointStore) -> None:
    store = tiered_store
    state = _state(2)
    ck = _archived_only(store, "run-e", 1, state)
    directory = ensure_hot(store, ck)
    assert ensure_hot(store, store.get(ck.id)) == directory
    assert _equal(store.load(ck.id), state)


def test_restore_into_a_directory(tiered_store: CheckpointStore, tmp_path: Path) -> None:
    store = tiered_store
    state = _state(3)
    ck = _archived_only(store, "run-t", 1, state)
    path = restore_checkpoint(store, ck.id, to=tmp_path / "out")
    assert path == tmp_path / "out" / "run-t" / ck.id
    manifest = read_manifest(path, expected_digest=ck.manifest_digest)
    assert _equal(read_checkpoint(path, manifest), state)
    assert store.get(ck.id).replica("hot").state == ReplicaState.DELETED  # type: ignore[union-attr]


def test_restore_falls_back_to_the_next_tier(tiered_store: CheckpointStore) -> None:
    store = tiered_store
    state = _state(4)
    ck = store.save("run-f", 1, state)
    archive_checkpoints(store, ref=ck.id, tier="warm")
    archive_checkpoints(store, ref=ck.id, tier="cold")
    delete_replica(store, ck, "hot")
    warm = store_tiers(store)["warm"]
    chunk = next(k for k in warm.list_prefix(warm.prefix_for("run-f", ck.id)) if "/c/" in k)
    warm.delete(chunk)  # the warm copy lost a chunk behind the catalog's back
    restore_checkpoint(store, ck.id)
    restored = [e for e in store.events(ck.id) if e.kind == "restored"]
    assert restored[0].detail["from"] == "cold"
    assert _equal(store.load(ck.id), state)


def test_concurrent_restores_copy_once(tiered_store: CheckpointStore) -> None:
    store = tiered_store
    state = _state(5)
    ck = _archived_only(store, "run-c", 1, state)
    written: list[int] = []
    lock = threading.Lock()
    paths: list[Path] = []

    def count(nbytes: int) -> None:
        with lock:
            written.append(nbytes)

    def worker() -> None:
        paths.append(restore_checkpoint(store, ck.id, progress=count))

    threads = [threading.Thread(target=worker) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert len(paths) == 3 and len(set(paths)) == 1
    assert sum(written) == store.get(ck.id).replica("hot").bytes  # type: ignore[union-attr]
    assert [e.kind for e in store.events(ck.id)].count("restored") == 1


def test_no_copy_anywhere(store: CheckpointStore) -> None:
    ck = store.save("run-n", 1, _state(6))
    store.catalog.set_replica(ck.id, "hot", state=ReplicaState.DAMAGED)
    with pytest.raises(CheckpointNotFoundError, match="no readable PRESENT copy"):
        restore_checkpoint(store, ck.id)


def test_last_verified_copy_is_never_deleted(tiered_store: CheckpointStore) -> None:
    store = tiered_store
    ck = store.save("run-l", 1, _state(7))
    with pytest.raises(ConflictError, match="last verified copy"):
        delete_replica(store, ck, "hot")
    assert store.checkpoint_dir("run-l", ck.id).joinpath("COMMITTED").is_file()
    archive_checkpoints(store, ref=ck.id)
    delete_replica(store, ck, "hot")
    with pytest.raises(ConflictError, match="last verified copy"):
        delete_replica(store, ck, "warm")
    assert store.get(ck.id).replica("warm").state == ReplicaState.PRESENT  # type: ignore[union-attr]


def test_delete_removes_marker_first_and_records(tiered_store: CheckpointStore) -> None:
    store = tiered_store
    ck = store.save("run-m", 1, _state(8))
    archive_checkpoints(store, ref=ck.id)
    warm = store_tiers(store)["warm"]
    order: list[str] = []
    original = warm.delete

    def spy(key: str) -> bool:
        order.append(key)
        return original(key)

    warm.delete = spy  # type: ignore[method-assign]
    try:
        assert delete_replica(store, ck, "warm") > 3
    finally:
        del warm.delete
    assert order[0].endswith("/COMMITTED")
    assert warm.list_prefix(warm.prefix_for("run-m", ck.id)) == []
    assert store.get(ck.id).replica("warm").state == ReplicaState.DELETED  # type: ignore[union-attr]
    assert "replica_deleted" in [e.kind for e in store.events(ck.id)]
