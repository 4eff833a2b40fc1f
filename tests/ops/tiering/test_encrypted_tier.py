"""Encrypted tiers (``[tiers] encrypt_to``): archive and demote write sealed copies only.

Real components throughout: local tier directories and a moto S3 server, real X25519 keys,
the real archive / restore / verify / retention / gc code. What is checked is what a user
relies on: the tier never holds a plaintext chunk, a round trip is bit-exact, every bad key
or damaged copy is a DecryptionError that leaves the hot tier as it was.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from ckptstore import CheckpointStore, ReplicaState
from ckptstore.errors import ConfigError, DecryptionError, ThawPendingError
from ckptstore.ops.sharing.crypt import generate_encryption_keypair
from ckptstore.ops.sharing.signing import generate_keypair
from ckptstore.ops.tiering.archive import archive_checkpoints, demote_checkpoints
from ckptstore.ops.tiering.replicas import delete_replica, store_tiers
from ckptstore.ops.tiering.restore import restore_checkpoint
from ckptstore.ops.tiering.thaw_poll import complete_thaw
from ckptstore.records import SEALED_DIR, ThawState
from ckptstore.storage.s3 import RestoreState, S3Tier
from ckptstore.testing.s3 import MotoS3

# A run of float32 values no random tensor contains: its bytes are searched for on the tier.
_MARK = torch.arange(4096, dtype=torch.float32) * 0.5 + 12345.0
_MARK_BYTES = _MARK[100:132].numpy().tobytes()


def _state(seed: int) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(seed)
    return {
        "model": {"w": torch.randn(3000, generator=gen), "mark": _MARK.clone(),
                  "b": torch.arange(64, dtype=torch.int64)},
        "half": torch.randn(500, generator=gen).to(torch.bfloat16),
        "step": seed,
    }


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    return bool(a == b)


@pytest.fixture
def keys(tmp_path: Path) -> dict[str, Path]:
    """Two encryption pairs (ops, other) and a signing pair."""
    out = tmp_path / "keys"
    ops_key, ops_pub = generate_encryption_keypair(out, "ops")
    other_key, other_pub = generate_encryption_keypair(out, "other")
    sign_key, sign_pub = generate_keypair(out, "signer")
    return {"key": ops_key, "pub": ops_pub, "other_key": other_key, "other_pub": other_pub,
            "sign_key": sign_key, "sign_pub": sign_pub}


@pytest.fixture(autouse=True)
def _no_ambient_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CKPT_DECRYPT_KEY", raising=False)
    monkeypatch.delenv("CKPT_ENCRYPT_TO", raising=False)


@pytest.fixture
def local_store(tmp_path: Path, keys: dict[str, Path]) -> Iterator[CheckpointStore]:
    """Hot, warm and cold tiers in local directories; warm and cold encrypted."""
    store = CheckpointStore.open(tmp_path / "store", warm=str(tmp_path / "warm"),
                                 cold=str(tmp_path / "cold"), chunk_bytes=4096,
                                 encrypt_to=[str(keys["pub"])])
    try:
        yield store
    finally:
        store.close()


def _open_on_s3(tmp_path: Path, s3: MotoS3, keys: dict[str, Path],
                **tiers: Any) -> Iterator[CheckpointStore]:
    """A store whose ``tiers`` are on moto S3, encrypted to ops and other; closed after."""
    store = CheckpointStore.open(tmp_path / "store", storage_options=s3.storage_options,
                                 chunk_bytes=4096,
                                 encrypt_to=[str(keys["pub"]), str(keys["other_pub"])], **tiers)
    try:
        yield store
    finally:
        store.close()


@pytest.fixture
def s3_store(tmp_path: Path, s3: MotoS3, keys: dict[str, Path]) -> Iterator[CheckpointStore]:
    prefix = uuid.uuid4().hex[:12]
    yield from _open_on_s3(tmp_path, s3, keys, warm=s3.url(f"{prefix}/warm"),
                           cold=s3.url(f"{prefix}/cold"), cold_storage_class="STANDARD_IA")


def _tier_objects(store: CheckpointStore, tier: str) -> dict[str, bytes]:
    t = store_tiers(store)[tier]
    return {k: t.get_bytes(k) for k in t.list_prefix("")}


def _drop_hot(store: CheckpointStore, ref: str) -> None:
    ck = store.get(ref)
    delete_replica(store, ck, "hot")
    assert not store.checkpoint_dir(ck.run, ck.id).exists()


def _hot_snapshot(store: CheckpointStore) -> list[str]:
    return sorted(str(p.relative_to(store.hot)) for p in store.hot.rglob("*")
                  if not p.name.startswith(".ckptstore"))


def test_archive_writes_ciphertext_only_and_restores_bit_exact(
        local_store: CheckpointStore, keys: dict[str, Path]) -> None:
    store = local_store
    first = store.save("run-a", 1, _state(1))
    second = store.save("run-a", 2, _state(2))  # dedup'd against the first (a delta)
    report = archive_checkpoints(store, tier="warm")
    assert sorted(report.archived) == sorted([first.id, second.id]) and report.ok
    objects = _tier_objects(store, "warm")
    assert objects and all(k.startswith(f"{SEALED_DIR}/") for k in objects)
    # The tier holds no plaintext: no chunk bytes, no run name, no checkpoint id.
    for key, data in objects.items():
        assert _MARK_BYTES not in data, key
        assert b"run-a" not in data and first.id.encode() not in data, key
    # The hot copy's chunk does hold the pattern (so the search above can fail).
    hot_bytes = b"".join(p.read_bytes() for p in store.checkpoint_dir("run-a", first.id)
                         .rglob("*") if p.is_file())
    assert _MARK_BYTES in hot_bytes
    for ck in (first, second):
        warm = store.get(ck.id).replica("warm")
        assert warm is not None and warm.state == ReplicaState.PRESENT
        assert warm.sealed is not None and warm.verified_at is not None
        assert warm.uri.endswith(f"{SEALED_DIR}/{warm.sealed}")
        events = [e for e in store.catalog.events(ck.id) if e.kind == "archived"]
        assert events and events[0].detail["encrypted"] is True
        assert events[0].detail["recipients"] == 1
    # Drop the hot copies (the newer first: it read the older's chunks), restore, compare.
    for ck in (second, first):
        _drop_hot(store, ck.id)
    for seed, ck in ((2, second), (1, first)):
        restore_checkpoint(store, ck.id, key=keys["key"])
        hot = store.get(ck.id).replica("hot")
        assert hot is not None and hot.state == ReplicaState.PRESENT
        assert _equal(store.load(ck.id), _state(seed))


def test_s3_round_trip_and_demote_copies_ciphertext(
        s3_store: CheckpointStore, keys: dict[str, Path],
        monkeypatch: pytest.MonkeyPatch) -> None:
    store = s3_store
    ck = store.save("run-s", 5, _state(5))
    archive_checkpoints(store, tier="warm")
    warm = store.get(ck.id).replica("warm")
    assert warm is not None and warm.sealed and warm.uri.startswith("s3://")
    for data in _tier_objects(store, "warm").values():
        assert _MARK_BYTES not in data
    demoted = demote_checkpoints(store, older_than_days=0)
    assert demoted.archived == [ck.id] and demoted.removed == [ck.id]
    now = store.get(ck.id)
    cold = now.replica("cold")
    assert cold is not None and cold.sealed == warm.sealed  # the same ciphertext, moved
    assert now.replica("warm").state == ReplicaState.DELETED  # type: ignore[union-attr]
    assert not _tier_objects(store, "warm")
    for data in _tier_objects(store, "cold").values():
        assert _MARK_BYTES not in data
    _drop_hot(store, ck.id)
    # Either recipient opens it; the key comes from the environment here (a load restores).
    monkeypatch.setenv("CKPT_DECRYPT_KEY", str(keys["other_key"]))
    assert _equal(store.load(ck.id), _state(5))


@pytest.mark.parametrize("key_name", [None, "other"])
def test_no_key_or_wrong_key_is_refused_and_hot_is_unchanged(
        tmp_path: Path, keys: dict[str, Path], key_name: str | None) -> None:
    # Encrypted to ops only: "other" is a key it was not encrypted to.
    store = CheckpointStore.open(tmp_path / "store", warm=str(tmp_path / "warm"),
                                 chunk_bytes=4096, encrypt_to=[str(keys["pub"])])
    with store:
        ck = store.save("run-k", 1, _state(1))
        archive_checkpoints(store, tier="warm")
        _drop_hot(store, ck.id)
        before = _hot_snapshot(store)
        key = keys["other_key"] if key_name else None
        with pytest.raises(DecryptionError, match=r"--key|not encrypted to") as err:
            restore_checkpoint(store, ck.id, key=key)
        assert ("not encrypted to" in str(err.value)) == (key_name is not None)
        assert _hot_snapshot(store) == before
        hot = store.get(ck.id).replica("hot")
        assert hot is not None and hot.state == ReplicaState.DELETED
        warm = store.get(ck.id).replica("warm")
        assert warm is not None and warm.state == ReplicaState.PRESENT  # not marked damaged
        restore_checkpoint(store, ck.id, key=keys["key"])
        assert _equal(store.load(ck.id), _state(1))


@pytest.mark.parametrize("damage", ["flip", "truncate", "drop", "swap"])
def test_tampered_or_truncated_copy_is_refused(
        local_store: CheckpointStore, keys: dict[str, Path], damage: str) -> None:
    store = local_store
    ck = store.save("run-t", 1, _state(1))
    archive_checkpoints(store, tier="warm")
    warm = store.get(ck.id).replica("warm")
    assert warm is not None and warm.sealed
    copy_dir = Path(warm.uri)
    victim = copy_dir / "o" / "3"
    data = victim.read_bytes()
    victim.chmod(0o644)
    if damage == "flip":
        victim.write_bytes(data[:10] + bytes([data[10] ^ 1]) + data[11:])
    elif damage == "truncate":
        victim.write_bytes(data[: len(data) // 2])
    elif damage == "drop":
        victim.unlink()
    else:
        other = copy_dir / "o" / "4"
        other.chmod(0o644)
        swapped = other.read_bytes()
        other.write_bytes(data)
        victim.write_bytes(swapped)
    _drop_hot(store, ck.id)
    before = _hot_snapshot(store)
    with pytest.raises(DecryptionError):
        restore_checkpoint(store, ck.id, key=keys["key"])
    assert _hot_snapshot(store) == before
    assert not list(store.hot.glob(".sealed-work-*"))  # the private staging is gone


def test_delete_prune_and_gc_remove_sealed_copies(
        tmp_path: Path, keys: dict[str, Path]) -> None:
    from ckptstore.ops.tiering.retention.apply import apply_retention
    from ckptstore.retention import RetentionPolicy

    # No cold tier: retention would otherwise keep warm copies awaiting demotion.
    store = CheckpointStore.open(tmp_path / "store", warm=str(tmp_path / "warm"),
                                 chunk_bytes=4096, encrypt_to=[str(keys["pub"])])
    cks = [store.save("run-p", step, _state(step)) for step in (1, 2, 3, 4)]
    archive_checkpoints(store, tier="warm")
    warm_root = store_tiers(store)["warm"]
    copies = {ck.id: store.get(ck.id).replica("warm").sealed for ck in cks}  # type: ignore[union-attr]
    assert all(copies.values())
    # delete one sealed copy by hand
    delete_replica(store, store.get(cks[0].id), "warm")
    assert not warm_root.list_prefix(f"{SEALED_DIR}/{copies[cks[0].id]}/")
    assert store.get(cks[0].id).replica("warm").state == ReplicaState.DELETED  # type: ignore[union-attr]
    # retention on the warm tier keeps the newest two of the other three
    report = apply_retention(store, tier="warm", policy=RetentionPolicy(keep_last=2))
    assert report.ok
    assert not warm_root.list_prefix(f"{SEALED_DIR}/{copies[cks[1].id]}/")
    assert warm_root.list_prefix(f"{SEALED_DIR}/{copies[cks[2].id]}/")
    # gc removes what a killed archive left: a COPYING row naming a half-written copy
    from ckptstore.ops.tiering.sealed_tier import sealed_uri

    fresh = store.save("run-p", 5, _state(5))
    orphan_id = uuid.uuid4().hex
    orphan = f"{SEALED_DIR}/{orphan_id}/"
    warm_root.put_bytes(orphan + "o/0", b"x" * 40)
    store.catalog.set_replica(fresh.id, "warm", uri=sealed_uri(warm_root, orphan_id),
                              state=ReplicaState.COPYING)
    # and a sealed copy no row names (another store's push) is left alone
    foreign = f"{SEALED_DIR}/{uuid.uuid4().hex}/"
    warm_root.put_bytes(foreign + "o/0", b"y" * 40)
    gc = store.gc()
    assert not warm_root.list_prefix(orphan)
    assert gc.sealed_removed == [f"warm:{orphan.rstrip('/')}"]
    assert store.get(fresh.id).replica("warm").state == ReplicaState.DELETED  # type: ignore[union-attr]
    assert warm_root.list_prefix(foreign)
    assert warm_root.list_prefix(f"{SEALED_DIR}/{copies[cks[2].id]}/")
    store.close()


def test_verify_with_and_without_key_and_repair_by_resealing(
        local_store: CheckpointStore, keys: dict[str, Path],
        monkeypatch: pytest.MonkeyPatch) -> None:
    from ckptstore.ops.upkeep.verify import verify_replicas

    store = local_store
    ck = store.save("run-v", 1, _state(1))
    archive_checkpoints(store, tier="warm")
    report = verify_replicas(store, ref=ck.id, tier="warm")
    assert report.clean and report.ok  # without a key: envelope and sizes
    monkeypatch.setenv("CKPT_DECRYPT_KEY", str(keys["key"]))
    assert verify_replicas(store, ref=ck.id, tier="warm").clean
    # damage one object: the full check finds it, and the copy is resealed from hot
    warm = store.get(ck.id).replica("warm")
    assert warm is not None and warm.sealed
    victim = Path(warm.uri) / "o" / "2"
    victim.chmod(0o644)
    data = victim.read_bytes()
    victim.write_bytes(data[:-1] + bytes([data[-1] ^ 0xFF]))
    monkeypatch.delenv("CKPT_DECRYPT_KEY")
    assert verify_replicas(store, ref=ck.id, tier="warm", repair=False).clean  # sizes hold
    monkeypatch.setenv("CKPT_DECRYPT_KEY", str(keys["key"]))
    found = verify_replicas(store, ref=ck.id, tier="warm")
    assert found.damaged and found.repaired
    now = store.get(ck.id).replica("warm")
    assert now is not None and now.state == ReplicaState.PRESENT and now.sealed
    assert now.sealed != warm.sealed  # a new sealed copy
    assert not Path(warm.uri).exists()
    assert verify_replicas(store, ref=ck.id, tier="warm").clean
    # a truncated object is found without a key too
    victim = Path(now.uri) / "o" / "1"
    victim.chmod(0o644)
    victim.write_bytes(victim.read_bytes()[:-5])
    monkeypatch.delenv("CKPT_DECRYPT_KEY")
    assert not verify_replicas(store, ref=ck.id, tier="warm", repair=False).clean


def test_show_says_encrypted(local_store: CheckpointStore) -> None:
    store = local_store
    ck = store.save("run-w", 1, _state(1))
    archive_checkpoints(store, tier="warm")
    shown = store.show(ck.id)
    copies = {c["tier"]: c for c in shown["copies"]}
    assert copies["warm"]["encrypted"] is True and copies["warm"]["recipients"] == 1
    assert copies["warm"]["self_contained"] is True
    assert "encrypted" not in copies["hot"] and "recipients" not in copies["hot"]


def test_doctor_understands_sealed_copies(local_store: CheckpointStore) -> None:
    from ckptstore.ops.upkeep.doctor import doctor

    store = local_store
    ck = store.save("run-d", 1, _state(1))
    archive_checkpoints(store, tier="warm")
    clean = doctor(store)
    assert not clean.findings, clean.findings  # a sealed copy is neither orphan nor missing
    warm = store.get(ck.id).replica("warm")
    assert warm is not None and warm.sealed
    # a truncated object: damaged
    victim = Path(warm.uri) / "o" / "1"
    victim.chmod(0o644)
    victim.write_bytes(victim.read_bytes()[:-3])
    found = doctor(store)
    assert [f.kind for f in found.findings] == ["damaged-replica"], found.findings
    # every object gone: missing (lost), and --fix records it
    for path in Path(warm.uri).rglob("*"):
        if path.is_file():
            path.unlink()
    found = doctor(store, fix=True)
    assert [f.kind for f in found.findings] == ["missing-replica"], found.findings
    assert "lost" in found.findings[0].detail
    assert store.get(ck.id).replica("warm").state == ReplicaState.DAMAGED  # type: ignore[union-attr]


def test_plain_copies_made_before_encrypt_to_are_sealed_on_demote(
        tmp_path: Path, s3: MotoS3, keys: dict[str, Path]) -> None:
    """A warm copy archived in the clear (before encrypt_to was set), a delta reading its
    base's chunks on S3 among them, is sealed when demoted; restores are bit-exact."""
    prefix = uuid.uuid4().hex[:12]
    tiers = {"warm": s3.url(f"{prefix}/warm"), "cold": s3.url(f"{prefix}/cold"),
             "cold_storage_class": "STANDARD_IA", "storage_options": s3.storage_options,
             "chunk_bytes": 4096}
    with CheckpointStore.open(tmp_path / "store", **tiers) as plain:
        base = plain.save("run-m", 1, _state(1))
        delta = plain.save("run-m", 2, _state(2))
        archive_checkpoints(plain, tier="warm")
        assert not plain.get(delta.id).replica("warm").sealed  # type: ignore[union-attr]
    with CheckpointStore.open(tmp_path / "store", encrypt_to=[str(keys["pub"])],
                              archive_codec="zstd-3", **tiers) as store:
        for ck in (delta, base):
            _drop_hot(store, ck.id)
        report = demote_checkpoints(store, older_than_days=0)
        assert sorted(report.archived) == sorted([base.id, delta.id]) and report.ok
        for ck in (base, delta):
            cold = store.get(ck.id).replica("cold")
            assert cold is not None and cold.sealed
        for data in _tier_objects(store, "cold").values():
            assert _MARK_BYTES not in data
        assert not _tier_objects(store, "warm")
        for seed, ck in ((2, delta), (1, base)):
            restore_checkpoint(store, ck.id, key=keys["key"])
            assert _equal(store.load(ck.id), _state(seed))


def test_read_repair_of_a_damaged_hot_copy_from_a_sealed_one(
        local_store: CheckpointStore, keys: dict[str, Path],
        monkeypatch: pytest.MonkeyPatch) -> None:
    store = local_store
    ck = store.save("run-r", 1, _state(1))
    archive_checkpoints(store, tier="warm")
    chunk = next(p for p in sorted(store.checkpoint_dir("run-r", ck.id).rglob("c/*"))
                 if p.is_file() and p.stat().st_size > 64)
    chunk.chmod(0o644)
    data = chunk.read_bytes()
    chunk.write_bytes(data[:20] + bytes([data[20] ^ 0xFF]) + data[21:])
    monkeypatch.setenv("CKPT_DECRYPT_KEY", str(keys["key"]))
    assert _equal(store.load(ck.id), _state(1))
    hot = store.get(ck.id).replica("hot")
    assert hot is not None and hot.state == ReplicaState.PRESENT
    kinds = [(e.kind, e.detail.get("from")) for e in store.catalog.events(ck.id)]
    assert any(k == "damaged" for k, _ in kinds)
    assert ("restored", "warm") in kinds


def test_a_plain_push_does_not_read_a_sealed_copy(local_store: CheckpointStore) -> None:
    from ckptstore.errors import CheckpointNotFoundError
    from ckptstore.ops.sharing.push import source_tier

    store = local_store
    ck = store.save("run-u", 1, _state(1))
    archive_checkpoints(store, tier="warm")
    assert source_tier(store, store.get(ck.id)).name == "hot"
    _drop_hot(store, ck.id)
    with pytest.raises(CheckpointNotFoundError, match="--key"):
        source_tier(store, store.get(ck.id))


# ---------------------------------------------------------------------- config refusals
def test_signing_key_as_recipient_is_refused(tmp_path: Path, keys: dict[str, Path]) -> None:
    with pytest.raises(ConfigError, match=r"signer\.pub.*Ed25519 signing key.*keygen --encryption"):
        CheckpointStore.open(tmp_path / "s", warm=str(tmp_path / "w"),
                             encrypt_to=[str(keys["sign_pub"])])


@pytest.mark.parametrize("which", ["private", "missing"])
def test_private_or_missing_recipient_is_refused(tmp_path: Path, keys: dict[str, Path],
                                                 which: str) -> None:
    path = keys["key"] if which == "private" else tmp_path / "nope.pub"
    with pytest.raises(ConfigError, match=str(path.name)):
        CheckpointStore.open(tmp_path / "s", warm=str(tmp_path / "w"), encrypt_to=[str(path)])


@pytest.mark.parametrize("storage_class", ["GLACIER", "DEEP_ARCHIVE", None])
def test_archival_cold_class_is_accepted(tmp_path: Path, keys: dict[str, Path],
                                         storage_class: str | None) -> None:
    """Sealed copies in an archival class are thawed (test_thaw_*): no refusal, the
    default class (GLACIER) included."""
    from ckptstore.config import load_settings

    extra = {} if storage_class is None else {"cold_storage_class": storage_class}
    settings = load_settings(root=tmp_path, cold="s3://b/cold", encrypt_to=[str(keys["pub"])],
                             **extra)
    assert settings.encrypt_to == (str(keys["pub"]),)
    assert settings.cold_storage_class == (storage_class or "GLACIER")


def test_env_recipients_take_commas_and_pathsep(tmp_path: Path, keys: dict[str, Path],
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    from ckptstore.config import load_settings

    monkeypatch.setenv("CKPT_ENCRYPT_TO", f"{keys['pub']},{keys['other_pub']}")
    assert load_settings(root=tmp_path).encrypt_to == (str(keys["pub"]), str(keys["other_pub"]))
    monkeypatch.setenv("CKPT_ENCRYPT_TO", f"{keys['pub']}{os.pathsep}{keys['sign_pub']}")
    with pytest.raises(ConfigError, match=r"\$CKPT_ENCRYPT_TO.*signer\.pub"):
        load_settings(root=tmp_path)


def test_sealed_warm_copy_demoted_to_glacier_thaws_and_restores(
        tmp_path: Path, s3: MotoS3, keys: dict[str, Path]) -> None:
    """encrypt_to removed and the cold class set to GLACIER afterwards: the sealed warm copy
    is demoted as it is (ciphertext) and thawed from there like any GLACIER copy."""
    prefix = uuid.uuid4().hex[:12]
    common = {"warm": s3.url(f"{prefix}/warm"), "storage_options": s3.storage_options,
              "chunk_bytes": 4096}
    with CheckpointStore.open(tmp_path / "store", encrypt_to=[str(keys["pub"])],
                              **common) as store:
        ck = store.save("run-g", 1, _state(1))
        archive_checkpoints(store, tier="warm")
        copy_id = store.get(ck.id).replica("warm").sealed  # type: ignore[union-attr]
    with CheckpointStore.open(tmp_path / "store", cold=s3.url(f"{prefix}/cold"),
                              cold_storage_class="GLACIER", **common) as store:
        report = demote_checkpoints(store, older_than_days=0, deep=True)
        assert report.archived == [ck.id] and report.ok
        cold = store.get(ck.id).replica("cold")
        assert cold is not None and cold.state == ReplicaState.PRESENT
        assert cold.sealed == copy_id
        states = _restore_states(store, "cold")
        assert states.pop(f"{SEALED_DIR}/{copy_id}/envelope.json") == RestoreState.READABLE
        assert states and set(states.values()) == {RestoreState.ARCHIVED}
        _drop_hot(store, ck.id)
        assert _equal_path(store.thaw(ck.id, poll_s=0.01, timeout_s=30, key=keys["key"]),
                           store.checkpoint_dir("run-g", ck.id))
        assert _equal(store.load(ck.id), _state(1))


# ---------------------------------------------------------------------- archival classes
@pytest.fixture
def glacier_store(tmp_path: Path, s3: MotoS3,
                  keys: dict[str, Path]) -> Iterator[CheckpointStore]:
    """Cold tier on moto S3 in GLACIER, encrypted to ops and other."""
    prefix = uuid.uuid4().hex[:12]
    yield from _open_on_s3(tmp_path, s3, keys, cold=s3.url(f"{prefix}/cold"),
                           cold_storage_class="GLACIER")


def _restore_states(store: CheckpointStore, tier: str) -> dict[str, RestoreState]:
    t = store_tiers(store)[tier]
    assert isinstance(t, S3Tier)
    return {k: t.restore_state(k) for k in t.list_prefix("")}


def _equal_path(a: Path, b: Path) -> bool:
    return a.resolve() == b.resolve()


def test_thaw_of_a_sealed_glacier_copy_restores_bit_exact(
        glacier_store: CheckpointStore, keys: dict[str, Path],
        monkeypatch: pytest.MonkeyPatch) -> None:
    store = glacier_store
    first = store.save("run-z", 1, _state(1))
    second = store.save("run-z", 2, _state(2))  # a delta of the first: sealed self-contained
    report = archive_checkpoints(store, tier="cold", deep=True)
    assert sorted(report.archived) == sorted([first.id, second.id]) and report.ok
    copies = {ck.id: store.get(ck.id).replica("cold").sealed  # type: ignore[union-attr]
              for ck in (first, second)}
    # Every object in GLACIER but the cleartext envelope, which stays readable.
    states = _restore_states(store, "cold")
    assert all(k.startswith(f"{SEALED_DIR}/") for k in states)
    envelopes = {f"{SEALED_DIR}/{c}/envelope.json" for c in copies.values()}
    assert {k for k, v in states.items() if v == RestoreState.READABLE} == envelopes
    assert {v for k, v in states.items() if k not in envelopes} == {RestoreState.ARCHIVED}
    # Before any thaw: verify checks what it can without one (envelope, objects, sizes).
    from ckptstore.ops.upkeep.verify import check_replica

    tier = store_tiers(store)["cold"]
    assert check_replica(store, store.get(second.id), tier, key=keys["key"]) == []
    for ck in (second, first):
        _drop_hot(store, ck.id)

    # A restore asks S3 for the copy's archived objects and says when they will be ready,
    # in the words a plain copy's thaw uses.
    with pytest.raises(ThawPendingError, match=(
            rf"\({second.id}\) is thawing, expected ready in ~5 h: its only copy is in an "
            rf"archival storage class on the cold tier .*`ckpt thaw {second.id} --wait`")):
        restore_checkpoint(store, second.id, key=keys["key"])
    (thaw,) = store.catalog.thaws(checkpoint_ids=[second.id])
    own = [k for k in states if k.startswith(f"{SEALED_DIR}/{copies[second.id]}/")]
    assert thaw.state == ThawState.PENDING and thaw.objects == len(own) - 1  # not the envelope
    # Only that copy was asked for (moto restores at once): the other stays archived.
    after = _restore_states(store, "cold")
    assert {after[k] for k in own} == {RestoreState.READABLE, RestoreState.RESTORED}
    other = [k for k in states if k.startswith(f"{SEALED_DIR}/{copies[first.id]}/")
             and k not in envelopes]
    assert {after[k] for k in other} == {RestoreState.ARCHIVED}
    # Before the expected ready time a restore (and a load) says the same, asking nothing.
    with pytest.raises(ThawPendingError, match="is thawing, expected ready in ~5 h"):
        restore_checkpoint(store, second.id, key=keys["key"])
    monkeypatch.setenv("CKPT_DECRYPT_KEY", str(keys["other_key"]))
    with pytest.raises(ThawPendingError, match="is thawing"):
        store.load(second.id)
    assert store.catalog.get_thaw(second.id, "cold") == thaw
    assert store.get(second.id).replica("hot").state == ReplicaState.DELETED  # type: ignore[union-attr]

    # The poll finds every object readable and restores with the key, checked in full.
    path = complete_thaw(store, second.id, poll_s=0.01, timeout_s=30, key=keys["key"])
    assert _equal_path(path, store.checkpoint_dir("run-z", second.id))
    hot = store.get(second.id).replica("hot")
    assert hot is not None and hot.state == ReplicaState.PRESENT and hot.verified_at
    done = store.catalog.get_thaw(second.id, "cold")
    assert done is not None and done.state == ThawState.DONE
    assert _equal(store.load(second.id), _state(2))
    assert not list(store.hot.glob(".sealed-work-*"))
    # The other one through the store method, the key from the environment (other's).
    store.thaw(first.id, poll_s=0.01, timeout_s=30)
    assert _equal(store.load(first.id), _state(1))
    # Thawed, every object reads: ciphertext only.
    for data in _tier_objects(store, "cold").values():
        assert _MARK_BYTES not in data


@pytest.mark.parametrize("key_name", [None, "other", "sign"])
def test_thaw_of_a_sealed_copy_checks_the_key_before_asking_s3(
        tmp_path: Path, s3: MotoS3, keys: dict[str, Path], key_name: str | None) -> None:
    prefix = uuid.uuid4().hex[:12]
    # Encrypted to ops only: "other" is a key it was not encrypted to.
    with CheckpointStore.open(tmp_path / "store", cold=s3.url(f"{prefix}/cold"),
                              cold_storage_class="DEEP_ARCHIVE",
                              storage_options=s3.storage_options, chunk_bytes=4096,
                              encrypt_to=[str(keys["pub"])]) as store:
        ck = store.save("run-d", 1, _state(1))
        archive_checkpoints(store, tier="cold")
        _drop_hot(store, ck.id)
        key = {None: None, "other": keys["other_key"], "sign": keys["sign_key"]}[key_name]
        error = ConfigError if key_name == "sign" else DecryptionError
        with pytest.raises(error, match=r"--key|not encrypted to|Ed25519"):
            restore_checkpoint(store, ck.id, key=key)
        with pytest.raises(error):
            complete_thaw(store, ck.id, poll_s=0.01, timeout_s=0, key=key)
        # Nothing was asked of S3, nothing recorded, the hot tier untouched.
        assert not store.catalog.thaws(checkpoint_ids=[ck.id])
        states = _restore_states(store, "cold")
        assert RestoreState.ARCHIVED in states.values()
        assert RestoreState.RESTORED not in states.values()
        # The right key: DEEP_ARCHIVE's Standard retrieval (Expedited is not offered).
        with pytest.raises(ThawPendingError, match="expected ready in ~12 h"):
            restore_checkpoint(store, ck.id, key=keys["key"])
        complete_thaw(store, ck.id, poll_s=0.01, timeout_s=30, key=keys["key"])
        assert _equal(store.load(ck.id), _state(1))


def test_a_damaged_object_of_a_thawed_sealed_copy_is_refused(
        glacier_store: CheckpointStore, keys: dict[str, Path], s3: MotoS3) -> None:
    store = glacier_store
    ck = store.save("run-x", 1, _state(1))
    archive_checkpoints(store, tier="cold")
    _drop_hot(store, ck.id)
    copy_id = store.get(ck.id).replica("cold").sealed  # type: ignore[union-attr]
    with pytest.raises(ThawPendingError):
        restore_checkpoint(store, ck.id, key=keys["key"])
    # A flipped bit in a thawed object: written back in GLACIER, thawed again by the poll.
    tier = store_tiers(store)["cold"]
    assert isinstance(tier, S3Tier)
    bucket_key = f"{tier.prefix}/{SEALED_DIR}/{copy_id}/o/3"
    client = s3.client()
    data = client.get_object(Bucket=s3.bucket, Key=bucket_key)["Body"].read()
    client.put_object(Bucket=s3.bucket, Key=bucket_key, StorageClass="GLACIER",
                      Body=data[:10] + bytes([data[10] ^ 1]) + data[11:])
    before = _hot_snapshot(store)
    with pytest.raises(DecryptionError, match="o/3"):
        complete_thaw(store, ck.id, poll_s=0.01, timeout_s=30, key=keys["key"])
    assert _hot_snapshot(store) == before
    assert not list(store.hot.glob(".sealed-work-*"))


def test_a_plain_copy_of_a_checkpoint_saved_across_hosts_is_not_sealed_whole(
        local_store: CheckpointStore) -> None:
    """Such a checkpoint is sealed part by part as each host archives its part
    (tests/ops/tiering/test_encrypted_parts.py); a plain copy of it (archived before
    encrypt_to was set) is not sealed into one object of another layout on demote."""
    import dataclasses

    from ckptstore.ops.tiering.sealed_tier import check_sealable

    ck = local_store.save("run-h", 1, _state(1))
    check_sealable(ck)  # one host: fine
    with pytest.raises(ConfigError, match="sealed part by part"):
        check_sealable(dataclasses.replace(ck, hosts=("node-a", "node-b")))


def test_cli_restore_with_key(local_store: CheckpointStore, keys: dict[str, Path],
                              tmp_path: Path) -> None:
    from ckptstore.cli.app import main

    store = local_store
    ck = store.save("run-c", 1, _state(1))
    archive_checkpoints(store, tier="warm")
    _drop_hot(store, ck.id)
    config = tmp_path / "ckptstore.toml"
    config.write_text(
        f'root = "{store.settings.root}"\n[tiers]\nhot = "{store.hot}"\n'
        f'warm = "{tmp_path / "warm"}"\ncold = "{tmp_path / "cold"}"\n'
        f'encrypt_to = ["{keys["pub"]}"]\n', encoding="utf-8")
    assert main(["--config", str(config), "restore", ck.id]) == 1  # no key: exit 1
    assert store.get(ck.id).replica("hot").state == ReplicaState.DELETED  # type: ignore[union-attr]
    assert main(["--config", str(config), "restore", ck.id, "--key", str(keys["key"])]) == 0
    assert _equal(store.load(ck.id), _state(1))
    # verify: a flipped bit keeps every size, so only the full check (--key) finds it
    warm = store.get(ck.id).replica("warm")
    assert warm is not None and warm.sealed
    victim = Path(warm.uri) / "o" / "2"
    victim.chmod(0o644)
    data = victim.read_bytes()
    victim.write_bytes(data[:5] + bytes([data[5] ^ 1]) + data[6:])
    verify = ["--config", str(config), "verify", ck.id, "--tier", "warm", "--no-repair"]
    assert main(verify) == 0
    # doctor the same way: with --deep and --key it decrypts and finds it; without a key, or
    # with one that is not a recipient's (which says nothing of the copy), it cannot
    doctor = ["--config", str(config), "doctor", "--deep", "--tier", "warm"]
    assert main(doctor) == 0
    assert main([*doctor, "--key", str(keys["other_key"])]) == 0
    assert main([*doctor, "--key", str(tmp_path / "no-such.key")]) == 1
    assert main([*doctor, "--key", str(keys["sign_key"])]) == 1  # a signing key: refused
    assert main([*doctor, "--key", str(keys["key"])]) == 1
    assert main([*verify, "--key", str(keys["key"])]) == 1
