"""Scrubbing replicas: detect damage on S3 and on the hot tier, mark DAMAGED, repair."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from ckptstore import CheckpointStore, ReplicaState
from ckptstore.ops.tiering.archive import archive_checkpoints
from ckptstore.ops.tiering.replicas import store_tiers
from ckptstore.ops.upkeep.verify import verify_replicas
from ckptstore.storage import S3Tier
from ckptstore.testing.s3 import MotoS3

pytestmark = pytest.mark.s3


def _state(seed: int) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(3000, generator=gen), "b": torch.randn(7, generator=gen)}


def _flip_bit_on_s3(s3: MotoS3, store: CheckpointStore, run: str, ckpt_id: str) -> str:
    """Overwrite one chunk object with one bit flipped, behind our write-once API."""
    warm = store_tiers(store)["warm"]
    assert isinstance(warm, S3Tier)
    key = next(k for k in warm.list_prefix(warm.prefix_for(run, ckpt_id)) if "/c/" in k)
    data = bytearray(warm.get_bytes(key))
    data[len(data) // 2] ^= 0x10
    s3.client().put_object(Bucket=s3.bucket, Key=f"{warm.prefix}/{key}", Body=bytes(data))
    return key


def test_bit_flip_on_s3_is_marked_damaged_and_repaired_from_hot(
    tiered_store: CheckpointStore, s3: MotoS3
) -> None:
    store = tiered_store
    ck = store.save("run-v", 1, _state(1))
    archive_checkpoints(store, ref=ck.id)
    clean = verify_replicas(store, ref=ck.id)
    assert clean.ok == [f"{ck.id}@hot", f"{ck.id}@warm"] and clean.clean
    key = _flip_bit_on_s3(s3, store, "run-v", ck.id)
    warm = store_tiers(store)["warm"]
    hot = store_tiers(store)["hot"]
    assert warm.get_bytes(key) != hot.get_bytes(key)

    report = verify_replicas(store, ref=ck.id, tier="warm", repair=False)
    assert list(report.damaged) == [f"{ck.id}@warm"]
    assert store.get(ck.id).replica("warm").state == ReplicaState.DAMAGED  # type: ignore[union-attr]

    report = verify_replicas(store, ref=ck.id, tier="warm")
    assert report.repaired == [f"{ck.id}@warm"] and report.clean
    assert warm.get_bytes(key) == hot.get_bytes(key)
    replica = store.get(ck.id).replica("warm")
    assert replica is not None and replica.state == ReplicaState.PRESENT
    kinds = [e.kind for e in store.events(ck.id)]
    assert "repaired" in kinds and kinds.count("verified") >= 3
    repaired = next(e for e in store.events(ck.id) if e.kind == "repaired")
    assert repaired.detail["from"] == "hot"


def test_damaged_hot_copy_is_repaired_from_s3(tiered_store: CheckpointStore) -> None:
    store = tiered_store
    state = _state(2)
    ck = store.save("run-h", 1, state)
    archive_checkpoints(store, ref=ck.id)
    chunk = next(store.checkpoint_dir("run-h", ck.id).glob("float32/c/*"))
    data = bytearray(chunk.read_bytes())
    data[5] ^= 0xFF
    chunk.write_bytes(bytes(data))
    report = verify_replicas(store, ref=ck.id)
    assert list(report.damaged) == [f"{ck.id}@hot"]
    assert report.repaired == [f"{ck.id}@hot"]
    loaded = store.load(ck.id)
    assert torch.equal(loaded["w"], state["w"])


def test_missing_object_found_by_shallow_check(tiered_store: CheckpointStore) -> None:
    store = tiered_store
    ck = store.save("run-s", 1, _state(3))
    archive_checkpoints(store, ref=ck.id)
    warm = store_tiers(store)["warm"]
    warm.delete(warm.key_for("run-s", ck.id, "float32/zarr.json"))
    report = verify_replicas(store, ref=ck.id, tier="warm", deep=False, repair=False)
    assert any("zarr.json" in p for p in report.damaged[f"{ck.id}@warm"])


def test_no_intact_donor_is_reported(tiered_store: CheckpointStore, s3: MotoS3) -> None:
    store = tiered_store
    ck = store.save("run-d", 1, _state(4))
    archive_checkpoints(store, ref=ck.id)
    _flip_bit_on_s3(s3, store, "run-d", ck.id)
    hot_chunk = next(store.checkpoint_dir("run-d", ck.id).glob("float32/c/*"))
    hot_chunk.unlink()
    report = verify_replicas(store, ref=ck.id)
    assert set(report.damaged) == {f"{ck.id}@hot", f"{ck.id}@warm"}
    assert set(report.unrepaired) == {f"{ck.id}@hot", f"{ck.id}@warm"}
    assert not report.clean
    states = {r.tier: r.state for r in store.get(ck.id).replicas}
    assert states == {"hot": ReplicaState.DAMAGED, "warm": ReplicaState.DAMAGED}
