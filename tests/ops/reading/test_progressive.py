"""Progressive restore: groups in priority order from the memory, hot and S3 tiers."""

from __future__ import annotations

import shutil
import uuid
from collections import OrderedDict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from ckptstore.errors import InvalidNameError, StorageError
from ckptstore.ops.reading.progressive import load_progressive, plan_groups
from ckptstore.ops.tiering.archive import archive_checkpoints
from ckptstore.ops.tiering.replicas import delete_replica
from ckptstore.ops.writing.memory import attach_memory_tier, stage_after_commit
from ckptstore.records import ReplicaState
from ckptstore.store import CheckpointStore
from ckptstore.testing.s3 import MotoS3


def _state(seed: int = 0) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(seed)
    tied = torch.randn(64, 32, generator=gen)
    return {
        "model": OrderedDict(
            [(f"blocks.{i}.w", torch.randn(128, 256, generator=gen)) for i in range(6)]
            + [("embed", tied), ("head", tied)]
        ),
        "optimizer": {
            "state": {0: {"exp_avg": torch.randn(4096, generator=gen), "step": torch.tensor(3.0)}},
            "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.999), "params": [0]}],
        },
        "rng": np.arange(7, dtype=np.uint32),
        "half": torch.randn(300, generator=gen).to(torch.bfloat16),
        "weird*[key]?": torch.ones(3, dtype=torch.int64),
        "step": 42,
    }


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and a.dtype == b.dtype and np.array_equal(a, b)
    if isinstance(a, dict):
        return (type(a) is type(b) and list(a) == list(b)
                and all(_equal(a[k], b[k]) for k in a))
    if isinstance(a, list | tuple):
        return (type(a) is type(b) and len(a) == len(b)
                and all(_equal(x, y) for x, y in zip(a, b, strict=True)))
    return bool(a == b)


def test_groups_split_by_first_match_with_the_rest_last(store: CheckpointStore) -> None:
    ck = store.save("run-a", 1, _state())
    groups = plan_groups(store.manifest(ck.id), ["model/blocks.1*", ["optimizer", "model/*"]])
    assert groups[0].paths == ("model/blocks.1.w",)
    second = set(groups[1].paths)
    assert "model/blocks.1.w" not in second and "model/head" in second
    assert "optimizer/state/0/exp_avg" in second
    assert set(groups[2].paths) == {"rng", "half", "weird*[key]?"}
    assert groups[2].patterns == ()
    # Exact subtrees where possible: few patterns, special characters escaped.
    assert "optimizer" in groups[1].select
    assert "weird[*][[]key][?]" in groups[2].select


def test_groups_arrive_in_order_and_make_the_whole_state(store: CheckpointStore) -> None:
    state = _state()
    ck = store.save("run-a", 1, state)
    with load_progressive(store, ck.ref, ["model/blocks.*", "optimizer/*"]) as pl:
        assert pl.source == "hot" and len(pl.groups) == 3
        assert pl.time_to_manifest_s > 0
        first = pl.wait(0, timeout=60)
        assert list(first["model"]) == [f"blocks.{i}.w" for i in range(6)]
        assert _equal(first["model"]["blocks.3.w"], state["model"]["blocks.3.w"])
        seen = [index for index, _part in pl]
        assert seen == [0, 1, 2]
        times = [pl.seconds_to(i) for i in range(3)]
        assert all(t is not None for t in times) and times == sorted(times)  # type: ignore[type-var]
        full = pl.result(timeout=60)
    assert _equal(full, store.load(ck.id))
    assert full["model"]["embed"] is full["model"]["head"]  # tied stays tied
    # A completed group's tensors are the final state's objects.
    assert first["model"]["blocks.0.w"] is full["model"]["blocks.0.w"]


def test_into_fills_live_tensors_in_place(store: CheckpointStore) -> None:
    state = _state()
    ck = store.save("run-a", 1, state)
    live = _state(seed=9)
    target = live["model"]["blocks.2.w"]
    full = load_progressive(store, ck.ref, ["model"], into=live).result(timeout=60)
    assert full["model"]["blocks.2.w"] is target
    assert torch.equal(target, state["model"]["blocks.2.w"])
    assert _equal(full, store.load(ck.id))


def test_patterns_that_match_nothing(store: CheckpointStore) -> None:
    ck = store.save("run-a", 1, _state())
    with pytest.raises(InvalidNameError, match="match no tensor"):
        load_progressive(store, ck.ref, ["modle/*"])
    with pytest.raises(InvalidNameError, match="pattern or a list"):
        load_progressive(store, ck.ref, [[]])
    pl = load_progressive(store, ck.ref, ["modle/*", "model"], strict=False)
    assert len(pl.groups) == 2 and _equal(pl.result(timeout=60), store.load(ck.id))
    with pytest.raises(IndexError):
        pl.wait(5)


def test_memory_copy_is_preferred(store: CheckpointStore, tmp_path: Path) -> None:
    root = Path("/dev/shm") if Path("/dev/shm").is_dir() else tmp_path
    shm = root / f"ckptstore-test-{uuid.uuid4().hex[:10]}"
    try:
        attach_memory_tier(store, 64 * 2**20, root=shm)
        state = _state()
        ck = store.save("run-a", 1, state)
        stage_after_commit(store, ck, state)
        pl = load_progressive(store, ck.ref, ["optimizer"])
        assert pl.source == "memory"
        assert _equal(pl.result(timeout=60), state)
    finally:
        shutil.rmtree(shm, ignore_errors=True)


@pytest.fixture(scope="module")
def s3() -> Iterator[MotoS3]:
    with MotoS3() as server:
        yield server


@pytest.fixture
def tiered(tmp_path: Path, s3: MotoS3) -> Iterator[CheckpointStore]:
    prefix = uuid.uuid4().hex[:12]
    opened = CheckpointStore.open(tmp_path / "store", warm=s3.url(f"{prefix}/warm"),
                                  storage_options=s3.storage_options, chunk_bytes=2**16)
    try:
        yield opened
    finally:
        opened.close()


def _archived_only(store: CheckpointStore, state: Any) -> Any:
    ck = store.save("run-s3", 5, state)
    archive_checkpoints(store, ref=ck.id, tier="warm")
    delete_replica(store, ck, "hot")
    ck = store.get(ck.id)
    assert ck.replica("hot").state == ReplicaState.DELETED  # type: ignore[union-attr]
    assert not store.checkpoint_dir(ck.run, ck.id).exists()
    return ck


def _assert_restored_progressively(store: CheckpointStore, cid: str, **detail: Any) -> None:
    """The hot copy is PRESENT and verified, the last ``restored`` event says
    ``progressive`` (and ``detail``), and the hot copy verifies."""
    hot = store.get(cid).replica("hot")
    assert hot is not None and hot.state == ReplicaState.PRESENT and hot.verified_at
    events = [e for e in store.events(cid) if e.kind == "restored"]
    assert events and events[-1].detail.get("progressive") is True
    for name, value in detail.items():
        assert events[-1].detail.get(name) == value, (name, events[-1].detail)
    assert store.verify(cid) == []


@pytest.mark.s3
def test_streams_from_s3_by_priority_and_records_the_hot_copy(
    tiered: CheckpointStore,
) -> None:
    store = tiered
    state = _state()
    ck = _archived_only(store, state)
    with load_progressive(store, ck.ref, ["model/blocks.0*", "optimizer"]) as pl:
        assert pl.source == "warm"
        part = pl.wait(0, timeout=60)
        assert _equal(part["model"]["blocks.0.w"], state["model"]["blocks.0.w"])
        full = pl.result(timeout=60)
    assert _equal(full, state)
    _assert_restored_progressively(store, ck.id)
    assert store.catalog.lease_holder(ck.id, "restore:hot") is None
    # Now it is hot: the next progressive load reads it locally.
    assert load_progressive(store, ck.ref, ["model"]).source == "hot"


@pytest.mark.s3
def test_a_failed_stream_leaves_no_hot_copy(tiered: CheckpointStore, s3: MotoS3) -> None:
    store = tiered
    ck = _archived_only(store, _state())
    warm = store.tiers["warm"]
    chunk = next(k for k in warm.list_prefix(warm.prefix_for(ck.run, ck.id)) if "/c/" in k)
    warm.delete(chunk)  # a lost object
    pl = load_progressive(store, ck.ref, ["model"])
    with pytest.raises(StorageError):
        pl.result(timeout=60)
    assert store.get(ck.id).replica("hot").state == ReplicaState.DELETED  # type: ignore[union-attr]
    assert not store.checkpoint_dir(ck.run, ck.id).exists()
    assert store.catalog.lease_holder(ck.id, "restore:hot") is None


@pytest.mark.s3
def test_a_delta_streams_its_own_chunks_when_its_base_is_hot(tiered: CheckpointStore) -> None:
    store = tiered
    base_state = _state(1)
    base = store.save("run-d", 1, base_state)
    state = _state(1)
    state["model"]["blocks.0.w"] = state["model"]["blocks.0.w"] + 1  # one tensor changes
    ck = store.save("run-d", 2, state)
    manifest = store.manifest(ck.id)
    if base.id not in manifest.referenced_checkpoints():
        pytest.skip("this store does not save deltas against the previous checkpoint")
    archive_checkpoints(store, ref=ck.id, tier="warm")
    delete_replica(store, store.get(ck.id), "hot")
    with load_progressive(store, ck.ref, ["model/blocks.0*"]) as pl:
        assert pl.source == "warm"
        assert _equal(pl.result(timeout=60), state)
    assert store.get(ck.id).replica("hot").state == ReplicaState.PRESENT  # type: ignore[union-attr]
    assert store.verify(ck.id) == []
    # Nothing of the base was downloaded into the delta's directory.
    owned = {p.relative_to(store.checkpoint_dir("run-d", ck.id)).as_posix()
             for p in store.checkpoint_dir("run-d", ck.id).rglob("*") if p.is_file()}
    assert all(manifest.arrays[rel.split("/")[0]].chunks[int(rel.rsplit("/", 1)[1])].src is None
               for rel in owned if "/c/" in rel)


def test_store_and_manager_entry_points(store: CheckpointStore) -> None:
    from ckptstore.hooks.manager import CheckpointManager

    state = _state()
    ck = store.save("run-m", 3, state)
    with store.load_progressive(ck.ref, ["model"]) as pl:
        assert _equal(pl.result(timeout=60), state)
    mgr = CheckpointManager(store, "run-m", handle_sigterm=False, async_save=False)
    seen: list[tuple[int, list[str]]] = []
    restored = mgr.restore_latest(priority=["model"],
                                  on_group=lambda i, part: seen.append((i, sorted(part))))
    assert seen == [(0, ["model"]), (1, ["half", "optimizer", "rng", "weird*[key]?"])]
    assert _equal(restored, state) and mgr.resumed_from is not None
    progressive = mgr.restore_latest_progressive(["optimizer"])
    assert progressive is not None
    assert _equal(progressive.result(timeout=60), state)
    mgr.close()


# ---------------------------------------------------------------------- encrypted tiers
@pytest.fixture
def keys(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, Path]:
    from ckptstore.ops.sharing.crypt import generate_encryption_keypair

    monkeypatch.delenv("CKPT_DECRYPT_KEY", raising=False)
    monkeypatch.delenv("CKPT_ENCRYPT_TO", raising=False)
    key, pub = generate_encryption_keypair(tmp_path / "keys", "ops")
    other_key, _ = generate_encryption_keypair(tmp_path / "keys", "other")
    return {"key": key, "pub": pub, "other_key": other_key}


@pytest.fixture
def sealed(tmp_path: Path, s3: MotoS3, keys: dict[str, Path]) -> Iterator[CheckpointStore]:
    """Warm on moto S3 and cold in a local directory, both encrypted (encrypt_to)."""
    prefix = uuid.uuid4().hex[:12]
    opened = CheckpointStore.open(tmp_path / "store", warm=s3.url(f"{prefix}/warm"),
                                  cold=str(tmp_path / "cold"),
                                  storage_options=s3.storage_options, chunk_bytes=2**16,
                                  encrypt_to=[str(keys["pub"])])
    try:
        yield opened
    finally:
        opened.close()


def _no_plaintext_left(store: CheckpointStore, ck: Any) -> None:
    """No private staging directory, no hot copy, no lease: as before the load."""
    assert not list(store.hot.glob(".sealed-work-*"))
    assert store.get(ck.id).replica("hot").state == ReplicaState.DELETED  # type: ignore[union-attr]
    assert not store.checkpoint_dir(ck.run, ck.id).exists()
    assert store.catalog.lease_holder(ck.id, "restore:hot") is None


def _sealed_object(store: CheckpointStore, ck: Any, key: Path, tensor: str) -> tuple[str, int]:
    """The tier key of the object holding the first chunk of ``tensor``, and its number."""
    from ckptstore.ops.tiering.sealed_tier import member_files, open_sealed, sealed_prefix

    warm = store.tiers["warm"]
    opened = open_sealed(store, ck, warm, key)
    manifest = store.manifest(ck.id)
    entry = manifest.tensors[tensor]
    # Tensors of one dtype share chunks: this one must hold no other tensor.
    assert manifest.tensors_in_chunk(entry.array, entry.chunk_start) == [tensor]
    rel = manifest.arrays[entry.array].chunk_path(entry.chunk_start)
    index = member_files(opened, "test")[rel]
    copy_id = ck.replica("warm").sealed
    return f"{warm.prefix}/{sealed_prefix(copy_id)}o/{index}", index


@pytest.mark.s3
def test_streams_from_an_encrypted_warm_tier_bit_exact(
        sealed: CheckpointStore, keys: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    import stat

    store = sealed
    state = _state()
    ck = _archived_only(store, state)
    assert ck.replica("warm").sealed  # type: ignore[union-attr]
    with load_progressive(store, ck.ref, ["model/blocks.0*", "optimizer"],
                          key=keys["key"]) as pl:
        assert pl.source == "warm"  # streamed, not restored first
        # Plaintext is staged only in private directories of the hot tier.
        staged = list(store.hot.glob(".sealed-work-*"))
        assert all(stat.S_IMODE(p.stat().st_mode) == 0o700 for p in staged)
        part = pl.wait(0, timeout=60)
        assert _equal(part["model"]["blocks.0.w"], state["model"]["blocks.0.w"])
        full = pl.result(timeout=60)
    assert _equal(full, state)
    _assert_restored_progressively(store, ck.id, encrypted=True)
    assert store.catalog.lease_holder(ck.id, "restore:hot") is None
    assert not list(store.hot.glob(".sealed-work-*"))
    assert _equal(store.load(ck.id), state)
    # The key from the environment works the same (a second checkpoint).
    other = _state(3)
    ck2 = store.save("run-s3", 6, other)
    archive_checkpoints(store, ref=ck2.id, tier="warm")
    delete_replica(store, store.get(ck2.id), "hot")
    monkeypatch.setenv("CKPT_DECRYPT_KEY", str(keys["key"]))
    with store.load_progressive(ck2.ref, ["model"]) as pl:
        assert pl.source == "warm"
        assert _equal(pl.result(timeout=60), other)


@pytest.mark.s3
@pytest.mark.parametrize("which", [None, "other_key"])
def test_encrypted_tier_without_the_right_key_is_refused(
        sealed: CheckpointStore, keys: dict[str, Path], which: str | None) -> None:
    from ckptstore.errors import DecryptionError

    store = sealed
    ck = _archived_only(store, _state())
    key = keys[which] if which else None
    # No key: as before (the restore that a sealed copy needs asks for one); a key it was
    # not encrypted to: the same error the restore gives.
    with pytest.raises(DecryptionError, match="--key" if which is None else "not encrypted to"):
        load_progressive(store, ck.ref, ["model"], key=key)
    _no_plaintext_left(store, ck)
    assert store.get(ck.id).replica("warm").state == ReplicaState.PRESENT  # type: ignore[union-attr]


@pytest.mark.s3
@pytest.mark.parametrize("how", ["ciphertext", "plaintext"])
def test_a_tampered_object_of_an_encrypted_tier_is_an_error_not_a_tensor(
        sealed: CheckpointStore, keys: dict[str, Path], s3: MotoS3, how: str) -> None:
    """A flipped ciphertext bit fails its tag; a chunk altered and sealed again with the
    copy's own data key (what a holder of that key could do) decrypts, and fails the
    manifest's blake3. Either way the group that reads it fails, nothing lands in hot."""
    from ckptstore.errors import DecryptionError, IntegrityError
    from ckptstore.format.crypt import encrypt, object_aad
    from ckptstore.ops.tiering.sealed_tier import open_sealed

    store = sealed
    state = _state()
    ck = _archived_only(store, state)
    bucket_key, index = _sealed_object(store, ck, keys["key"], "half")
    client = s3.client()
    data = client.get_object(Bucket=s3.bucket, Key=bucket_key)["Body"].read()
    if how == "ciphertext":
        forged = data[:10] + bytes([data[10] ^ 1]) + data[11:]
    else:
        opened = open_sealed(store, ck, store.tiers["warm"], keys["key"])
        member = opened.members[index]
        plain = bytearray(opened.member(index))
        plain[0] ^= 1
        forged = encrypt(opened.data_key, member.nonce, bytes(plain),
                         object_aad(opened.envelope.copy_id, "object", member.path))
    client.put_object(Bucket=s3.bucket, Key=bucket_key, Body=forged)
    pl = load_progressive(store, ck.ref, ["model", "optimizer"], key=keys["key"])
    assert pl.source == "warm"
    assert len(pl.groups) == 3 and "half" in pl.groups[2].keys  # the rest, last
    # The groups before the damaged one arrive whole and right.
    assert _equal(pl.wait(0, timeout=60)["model"], state["model"])
    assert _equal(pl.wait(1, timeout=60)["optimizer"]["state"], state["optimizer"]["state"])
    error = DecryptionError if how == "ciphertext" else IntegrityError
    with pytest.raises(error, match="o/" if how == "ciphertext" else "fails verification"):
        pl.wait(2, timeout=60)
    with pytest.raises(error):
        pl.result(timeout=60)
    pl.close()
    _no_plaintext_left(store, ck)
    assert store.get(ck.id).replica("warm").state == ReplicaState.PRESENT  # type: ignore[union-attr]


@pytest.mark.s3
def test_a_tampered_encrypted_stream_falls_back_to_the_next_copy(
        sealed: CheckpointStore, keys: dict[str, Path], s3: MotoS3) -> None:
    store = sealed
    state = _state()
    ck = store.save("run-f", 1, state)
    archive_checkpoints(store, ref=ck.id, tier="warm")
    archive_checkpoints(store, ref=ck.id, tier="cold")  # a second sealed copy
    delete_replica(store, store.get(ck.id), "hot")
    ck = store.get(ck.id)
    bucket_key, _ = _sealed_object(store, ck, keys["key"], "half")
    client = s3.client()
    data = client.get_object(Bucket=s3.bucket, Key=bucket_key)["Body"].read()
    client.put_object(Bucket=s3.bucket, Key=bucket_key, Body=data[:-1])  # truncated
    with load_progressive(store, ck.ref, ["model", "optimizer"], key=keys["key"]) as pl:
        assert pl.source == "warm"
        assert _equal(pl.result(timeout=60), state)
        assert pl.source == "hot"  # the rest came from the copy restored from cold
    hot = store.get(ck.id).replica("hot")
    assert hot is not None and hot.state == ReplicaState.PRESENT
    assert [e.detail["from"] for e in store.events(ck.id) if e.kind == "restored"] == ["cold"]
    assert not list(store.hot.glob(".sealed-work-*"))
