"""Thawing a GLACIER-class cold copy: real moto S3 (RestoreObject) and a real catalog.

moto completes a restore at once (``head_object`` then answers ``Restore:
ongoing-request="false", expiry-date=...``), so a thaw is "pending" until our poll looks at
the objects: the first load asks and raises, the poll finds them readable and restores.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

import pytest
import torch

from ckptstore import CheckpointStore
from ckptstore.errors import InvalidNameError, StorageError, ThawPendingError
from ckptstore.ops.tiering.archive import archive_checkpoints
from ckptstore.ops.tiering.replicas import delete_replica
from ckptstore.ops.tiering.retention import REASON_THAWING, apply_retention, plan_retention
from ckptstore.ops.tiering.thaw_poll import complete_thaw
from ckptstore.records import Checkpoint, ReplicaState, ThawState
from ckptstore.retention import RetentionPolicy
from ckptstore.storage.s3 import RestoreState, S3Tier
from ckptstore.testing.s3 import MotoS3


def _state(i: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + i)
    return {"w": torch.randn(32, 8, generator=gen), "n": torch.arange(4) * i}


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture
def glacier_store(tmp_path: Path, s3: MotoS3) -> Iterator[CheckpointStore]:
    """warm = STANDARD S3, cold = GLACIER-class S3 (moto), Standard retrieval."""
    prefix = uuid.uuid4().hex[:12]
    opened = CheckpointStore.open(
        tmp_path / "store", warm=s3.url(f"{prefix}/warm"), cold=s3.url(f"{prefix}/cold"),
        cold_storage_class="GLACIER", storage_options=s3.storage_options,
    )
    try:
        yield opened
    finally:
        opened.close()


def _cold_only(store: CheckpointStore, run: str, step: int) -> Checkpoint:
    ck = store.save(run, step, _state(step))
    archive_checkpoints(store, ref=ck.id, tier="cold")
    delete_replica(store, store.catalog.get(ck.id), "hot")
    return store.catalog.get(ck.id)


def _cold_tier(store: CheckpointStore) -> S3Tier:
    tier = store.tier("cold")
    assert isinstance(tier, S3Tier)
    return tier


def _chunk_keys(tier: S3Tier, ck: Checkpoint) -> list[str]:
    keys = tier.list_prefix(tier.prefix_for(ck.run, ck.id))
    return [k for k in keys if "/c/" in k]


def test_first_load_requests_the_thaw_and_records_it(glacier_store: CheckpointStore) -> None:
    ck = _cold_only(glacier_store, "cold", 1)
    tier = _cold_tier(glacier_store)
    chunks = _chunk_keys(tier, ck)
    assert chunks and all(tier.restore_state(k) == RestoreState.ARCHIVED for k in chunks)

    before = datetime.now(UTC)
    with pytest.raises(ThawPendingError, match=r"thawing, expected ready in ~5 h") as info:
        glacier_store.load(ck.id)
    assert info.value.checkpoint_id == ck.id and info.value.tier == "cold"
    assert 4.9 * 3600 < info.value.ready_in_s <= 5 * 3600
    assert isinstance(info.value, StorageError)  # storage handlers keep catching it

    (thaw,) = glacier_store.catalog.thaws(checkpoint_ids=[ck.id])
    assert thaw.state == ThawState.PENDING and thaw.retrieval == "Standard"
    assert thaw.objects >= len(chunks) and before <= thaw.requested_at
    assert (thaw.expected_ready_at - thaw.requested_at).total_seconds() == pytest.approx(
        5 * 3600, abs=5)
    # S3 was asked for every archived object (moto restores at once).
    assert all(tier.restore_state(k) == RestoreState.RESTORED for k in chunks)

    # A second load before the expected time asks nothing again and says the same.
    with pytest.raises(ThawPendingError):
        glacier_store.load(ck.id)
    assert glacier_store.catalog.get_thaw(ck.id, "cold") == thaw
    assert glacier_store.catalog.events(ck.id, kind="thaw_requested")


def test_poll_completes_and_the_load_is_bit_exact(glacier_store: CheckpointStore) -> None:
    ck = _cold_only(glacier_store, "cold", 2)
    with pytest.raises(ThawPendingError):
        glacier_store.load(ck.id)

    sleeps: list[float] = []
    path = complete_thaw(glacier_store, ck.id, poll_s=0.01, timeout_s=30, sleep=sleeps.append)

    assert path == glacier_store.checkpoint_dir(ck.run, ck.id)
    assert sleeps == []  # moto had already restored the objects
    hot = glacier_store.catalog.get(ck.id).replica("hot")
    assert hot is not None and hot.state == ReplicaState.PRESENT and hot.verified_at
    thaw = glacier_store.catalog.get_thaw(ck.id, "cold")
    assert thaw is not None and thaw.state == ThawState.DONE
    assert _equal(glacier_store.load(ck.id), _state(2))


def test_thaw_store_method_without_a_prior_load(glacier_store: CheckpointStore) -> None:
    ck = _cold_only(glacier_store, "cold", 3)
    # Nothing requested yet: the poll asks, then finds the objects readable.
    glacier_store.thaw(ck.id, poll_s=0.01, timeout_s=30)
    assert _equal(glacier_store.load(ck.id), _state(3))
    thaw = glacier_store.catalog.get_thaw(ck.id, "cold")
    assert thaw is not None and thaw.state == ThawState.DONE


def test_prefetch_of_a_glacier_only_checkpoint_thaws_it(glacier_store: CheckpointStore) -> None:
    ck = _cold_only(glacier_store, "cold", 4)
    with pytest.raises(ThawPendingError):
        glacier_store.prefetch(ck.id)
    # The prefetch lease stays: the checkpoint is wanted, retention must wait for it.
    assert glacier_store.catalog.leases(checkpoint_ids=[ck.id])
    glacier_store.thaw(ck.id, poll_s=0.01, timeout_s=30)
    assert glacier_store.prefetch(ck.id).bytes_moved == 0
    assert _equal(glacier_store.load(ck.id), _state(4))


def test_retention_keeps_the_warm_copy_while_a_thaw_is_pending(
        glacier_store: CheckpointStore, s3: MotoS3) -> None:
    old = glacier_store.save("keep", 1, _state(1))
    glacier_store.save("keep", 2, _state(2))
    archive_checkpoints(glacier_store, run="keep", tier="warm")
    archive_checkpoints(glacier_store, run="keep", tier="cold")
    delete_replica(glacier_store, glacier_store.catalog.get(old.id), "hot")
    # The warm copy is damaged: the restore falls back to the GLACIER copy and thaws it.
    warm = glacier_store.tier("warm")
    assert isinstance(warm, S3Tier)
    key = _chunk_keys(warm, old)[0]
    bucket_key = f"{warm.prefix}/{key}"
    body = s3.client().get_object(Bucket=s3.bucket, Key=bucket_key)["Body"].read()
    s3.client().put_object(Bucket=s3.bucket, Key=bucket_key, Body=bytes(len(body)))
    with pytest.raises(ThawPendingError, match="thawing"):
        glacier_store.load(old.id)

    keep_one = RetentionPolicy(keep_last=1)
    plan = plan_retention(glacier_store, keep_one, tier="warm")
    assert old.id not in {a.checkpoint_id for a in plan.actions}
    assert [k.reasons for k in plan.kept if k.checkpoint_id == old.id] == [(REASON_THAWING,)]
    apply_retention(glacier_store, tier="warm", policy=keep_one)
    apply_retention(glacier_store, tier="cold", policy=RetentionPolicy(keep_last=0))
    current = glacier_store.catalog.get(old.id)
    assert current.replica("warm").state == ReplicaState.PRESENT  # type: ignore[union-attr]
    assert current.replica("cold").state == ReplicaState.PRESENT  # type: ignore[union-attr]

    complete_thaw(glacier_store, old.id, poll_s=0.01, timeout_s=30)
    assert _equal(glacier_store.load(old.id), _state(1))
    # Done: the warm copy is an ordinary candidate again.
    plan = plan_retention(glacier_store, keep_one, tier="warm")
    assert old.id in {a.checkpoint_id for a in plan.actions}


def test_poll_timeout_and_bad_inputs(glacier_store: CheckpointStore, s3: MotoS3) -> None:
    ck = _cold_only(glacier_store, "cold", 5)
    for bad in (0, -1.0, float("nan"), float("inf")):
        with pytest.raises(InvalidNameError):
            complete_thaw(glacier_store, ck.id, poll_s=bad)
    with pytest.raises(InvalidNameError):
        complete_thaw(glacier_store, ck.id, timeout_s=-1)
    with pytest.raises(InvalidNameError):
        glacier_store.catalog.record_thaw(ck.id, "cold", retrieval="Fast", objects=1,
                                          expected_ready_at=datetime.now(UTC))
    # Thawed, then archived again behind our back (restored copies expire): the poll asks
    # again and, out of time, gives up with the thaw error.
    with pytest.raises(ThawPendingError):
        glacier_store.load(ck.id)
    tier = _cold_tier(glacier_store)
    key = _chunk_keys(tier, ck)[0]
    assert tier.restore_state(key) == RestoreState.RESTORED
    bucket_key = f"{tier.prefix}/{key}"
    client = s3.client()
    body = client.get_object(Bucket=s3.bucket, Key=bucket_key)["Body"].read()
    client.put_object(Bucket=s3.bucket, Key=bucket_key, Body=body, StorageClass="GLACIER")
    assert tier.restore_state(key) == RestoreState.ARCHIVED
    first = glacier_store.catalog.get_thaw(ck.id, "cold")
    with pytest.raises(ThawPendingError):
        complete_thaw(glacier_store, ck.id, poll_s=0.01, timeout_s=0)
    again = glacier_store.catalog.get_thaw(ck.id, "cold")
    assert first is not None and again is not None and again.requested_at > first.requested_at
    assert tier.restore_state(key) == RestoreState.RESTORED


def test_retrieval_tier_comes_from_the_settings(tmp_path: Path, s3: MotoS3) -> None:
    prefix = uuid.uuid4().hex[:12]
    with CheckpointStore.open(
        tmp_path / "bulk", warm=s3.url(f"{prefix}/warm"), cold=s3.url(f"{prefix}/cold"),
        cold_storage_class="GLACIER", cold_restore_tier="Bulk",
        storage_options=s3.storage_options,
    ) as store:
        ck = _cold_only(store, "bulk", 1)
        with pytest.raises(ThawPendingError, match=r"expected ready in ~12 h"):
            store.load(ck.id)
        thaw = store.catalog.get_thaw(ck.id, "cold")
        assert thaw is not None and thaw.retrieval == "Bulk"
