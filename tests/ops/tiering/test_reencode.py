"""Archive with re-encode: lz4 hot copies become self-contained zstd-3 warm copies.

Against a real moto S3 server (warm, cold) and a local hot tier. Every copy is checked to
load bit-exactly from the re-encoded copy alone.
"""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from ckptstore import CheckpointStore, ReplicaState
from ckptstore.errors import ConfigError, ConflictError, IntegrityError
from ckptstore.format import Manifest, read_manifest
from ckptstore.format.codecs import BLOSC_HEADER
from ckptstore.ops.sharing.bundle import export_bundle, import_bundle
from ckptstore.ops.sharing.signing import (
    SignatureDoc,
    generate_keypair,
    sign_checkpoint,
    verify_signature,
)
from ckptstore.ops.tiering.archive import archive_checkpoints, demote_checkpoints
from ckptstore.ops.tiering.reencode import ORIGINAL_MANIFEST_NAME, check_same_content
from ckptstore.ops.tiering.replicas import delete_replica, manifest_on, store_tiers
from ckptstore.ops.tiering.restore import restore_checkpoint
from ckptstore.ops.upkeep.verify import verify_replicas
from ckptstore.records import Checkpoint, expected_digest
from ckptstore.storage import COMMIT_NAME, MANIFEST_NAME, Tier
from ckptstore.testing.invariants import check_invariants
from ckptstore.testing.s3 import MotoS3

pytestmark = pytest.mark.s3

# Blosc 1 compressor format in bits 5-7 of the header flags: blosclz 0, lz4/lz4hc 1,
# snappy 2, zlib 3, zstd 4.
_LZ4, _ZSTD = 1, 4


@pytest.fixture
def small(tmp_path: Path, s3: MotoS3) -> Iterator[CheckpointStore]:
    """A tiered store with 4 KiB chunks (several chunks per array), lz4 on hot."""
    prefix = uuid.uuid4().hex[:12]
    opened = CheckpointStore.open(
        tmp_path / "store", warm=s3.url(f"{prefix}/warm"), cold=s3.url(f"{prefix}/cold"),
        cold_storage_class="STANDARD_IA", storage_options=s3.storage_options,
        chunk_bytes=4096, codec="lz4",
    )
    try:
        yield opened
    finally:
        opened.close()


@pytest.fixture
def local(tmp_path: Path) -> Iterator[CheckpointStore]:
    """A store with a local-path warm tier (checked by check_invariants too), lz4 on hot."""
    opened = CheckpointStore.open(tmp_path / "store", warm=str(tmp_path / "warm"),
                                  chunk_bytes=4096, codec="lz4")
    try:
        yield opened
    finally:
        opened.close()


def _state(seed: int, n: int = 4000) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(seed)
    # Compressible (a few distinct values, like quantized or sparse weights) plus random
    # bits, several dtypes, small tensors packed apart.
    return {
        "model": {
            "w": torch.randint(0, 4, (n,), generator=gen).float(),
            "noise": torch.randn(n // 4, generator=gen),
            "b": torch.arange(64, dtype=torch.int64),
        },
        "half": torch.randn(600, generator=gen).to(torch.bfloat16),
        "step": seed,
    }


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    return bool(a == b)


def _warm(store: CheckpointStore) -> Tier:
    return store_tiers(store)["warm"]


def _keys(store: CheckpointStore, tier: str, ck: Checkpoint) -> list[str]:
    t = store_tiers(store)[tier]
    return t.list_prefix(t.prefix_for(ck.run, ck.id))


def _drop_hot(store: CheckpointStore, *cks: Checkpoint) -> None:
    """Delete the hot copies, newest first (a delta goes before the base it reads)."""
    for ck in sorted(cks, key=lambda c: c.created_at, reverse=True):
        delete_replica(store, store.get(ck.id), "hot")
        assert not store.checkpoint_dir(ck.run, ck.id).exists()


def _warm_manifest(store: CheckpointStore, ck: Checkpoint) -> Manifest:
    return manifest_on(_warm(store), store.get(ck.id), use_cache=False)


def test_reencode_lz4_to_zstd3_then_load_from_warm_only(small: CheckpointStore) -> None:
    store = small
    state = _state(1)
    ck = store.save("run", 1, state)
    hot_chunks = list(store.checkpoint_dir("run", ck.id).rglob("c/*"))
    hot_bytes = sum(p.stat().st_size for p in hot_chunks)
    assert all(BLOSC_HEADER.unpack_from(p.read_bytes())[2] >> 5 == _LZ4 for p in hot_chunks)

    report = archive_checkpoints(store, tier="warm", reencode="zstd-3")
    assert report.ok and report.archived == [ck.id] and report.reencode == "zstd-3"
    sizes = report.reencoded[ck.id]
    assert sizes["source_bytes"] == hot_bytes
    assert 0 < sizes["bytes"] < sizes["source_bytes"], "zstd-3 should beat lz4 here"
    assert "re-encoded to zstd-3" in report.summary()

    now = store.get(ck.id)
    warm = now.replica("warm")
    assert warm is not None and warm.state == ReplicaState.PRESENT and warm.verified_at
    assert warm.manifest_digest is not None and warm.manifest_digest != ck.manifest_digest
    assert now.replica("hot").manifest_digest is None  # type: ignore[union-attr]
    assert expected_digest(now, "warm") == warm.manifest_digest

    manifest = _warm_manifest(store, ck)
    assert manifest.digest == warm.manifest_digest
    assert manifest.codec == "zstd-3" and manifest.kind == "full"
    assert manifest.reencoded_from == ck.manifest_digest
    assert all(a.codec == "zstd-3" and "__zstd3" in name for name, a in manifest.arrays.items())
    tier = _warm(store)
    chunk_keys = [k for k in _keys(store, "warm", ck) if "/c/" in k]
    assert chunk_keys and all("__zstd3/c/" in k for k in chunk_keys)
    for key in chunk_keys:
        flags = BLOSC_HEADER.unpack_from(tier.get_bytes(key))[2]
        assert flags >> 5 == _ZSTD, key
    assert tier.get_bytes(tier.key_for("run", ck.id, COMMIT_NAME)).decode().strip() \
        == warm.manifest_digest
    events = [e for e in store.events(ck.id) if e.kind == "archived"]
    assert events[-1].detail["reencoded"]["codec"] == "zstd-3"

    # A rerun is a no-op; verify passes on the re-encoded copy.
    assert archive_checkpoints(store, tier="warm", reencode="zstd-3").archived == []
    checked = verify_replicas(store, tier="warm")
    assert checked.ok == [f"{ck.id}@warm"] and checked.clean

    # Only the warm copy left: load restores it (as it is) and returns the same values.
    _drop_hot(store, ck)
    assert _equal(store.load(ck.id), state)
    hot = store.get(ck.id).replica("hot")
    assert hot is not None and hot.state == ReplicaState.PRESENT
    assert hot.manifest_digest == warm.manifest_digest
    assert store.verify(ck.id) == []
    assert store.show(ck.id)["manifest"]["codec"] == "zstd-3"


def test_dedup_chain_and_xor_delta_load_from_warm_only(small: CheckpointStore) -> None:
    store = small
    frozen = torch.randn(3000, generator=torch.Generator().manual_seed(9))
    states = [{"frozen": frozen, "head": torch.full((500,), float(i))} for i in range(3)]
    chain = [store.save("dedup", i, s, delta="dedup") for i, s in enumerate(states)]
    # (the catalog's kind is the save plan's; the manifest says what was written)
    assert [store.manifest(c.id).kind for c in chain] == ["full", "delta", "delta"]

    base = torch.randn(4000, generator=torch.Generator().manual_seed(3))
    moved = base.clone()
    moved[::97] += 1.0  # few changed elements per chunk: XOR-encoded chunks
    xor_states = [{"w": base}, {"w": moved}]
    xors = [store.save("xor", i, s, delta="xor") for i, s in enumerate(xor_states)]
    xor_manifest = store.manifest(xors[1].id)
    assert any(c.enc == "xor" for a in xor_manifest.arrays.values() for c in a.chunks)

    report = archive_checkpoints(store, tier="warm", reencode="zstd-3")
    everything = [*chain, *xors]
    assert report.ok and sorted(report.archived) == sorted(c.id for c in everything)
    assert set(report.reencoded) == {c.id for c in everything}
    for ck in everything:
        manifest = _warm_manifest(store, ck)
        assert manifest.kind == "full" and not manifest.referenced_checkpoints()
        assert all(c.enc == "raw" and c.src is None and c.base is None
                   for a in manifest.arrays.values() for c in a.chunks)

    _drop_hot(store, *everything)
    # The newest one streamed straight from warm (progressive load), the others restored.
    streamed = store.load_progressive(chain[-1].id, ["head"]).result()
    assert _equal(streamed, states[-1])
    assert store.get(chain[-1].id).replica("hot").manifest_digest \
        == store.get(chain[-1].id).replica("warm").manifest_digest  # type: ignore[union-attr]
    for ck, state in zip(everything, [*states, *xor_states], strict=True):
        assert _equal(store.load(ck.id), state), ck.ref
    assert verify_replicas(store, tier="warm").clean


def test_plain_dependent_of_a_reencoded_base(small: CheckpointStore) -> None:
    """A dedup delta archived *without* re-encoding after its base was: the base's original
    chunk files land in the base's warm prefix next to its re-encoded ones, no clash."""
    store = small
    frozen = torch.randn(3000, generator=torch.Generator().manual_seed(5))
    base = store.save("mix", 1, {"frozen": frozen, "x": torch.zeros(400)})
    archive_checkpoints(store, tier="warm", reencode="zstd-3")
    dep_state = {"frozen": frozen, "x": torch.ones(400)}
    dep = store.save("mix", 2, dep_state, delta="dedup")
    assert store.manifest(dep.id).referenced_checkpoints() == {base.id}
    report = archive_checkpoints(store, tier="warm")
    assert report.archived == [dep.id] and not report.reencoded
    assert store.get(dep.id).replica("warm").manifest_digest is None  # type: ignore[union-attr]
    base_keys = _keys(store, "warm", base)
    assert any("__zstd3/c/" in k for k in base_keys)
    assert any("/c/" in k and "__" not in k.split("/")[-3] for k in base_keys)

    _drop_hot(store, base, dep)
    assert _equal(store.load(dep.id), dep_state)
    # The dependent reads the base's original chunk files on warm: they must stay.
    with pytest.raises(ConflictError, match="read by other checkpoints"):
        delete_replica(store, store.get(base.id), "warm", force=True)
    delete_replica(store, store.get(base.id), "warm", force=True, keep_referenced=True)
    left = _keys(store, "warm", base)
    assert left and not any("__zstd3" in k for k in left)
    _drop_hot(store, dep)
    assert _equal(store.load(dep.id), dep_state)


def test_damaged_reencoded_chunk_is_repaired(small: CheckpointStore) -> None:
    store = small
    state = _state(2)
    ck = store.save("run", 1, state)
    archive_checkpoints(store, tier="warm", reencode="zstd-3")
    digest = store.get(ck.id).replica("warm").manifest_digest  # type: ignore[union-attr]
    tier = _warm(store)
    key = sorted(k for k in _keys(store, "warm", ck) if "/c/" in k)[0]
    data = bytearray(tier.get_bytes(key))
    data[len(data) // 2] ^= 0xFF
    tier.delete(key)
    tier.put_bytes(key, bytes(data))

    report = verify_replicas(store, tier="warm")
    name = f"{ck.id}@warm"
    assert name in report.damaged and report.repaired == [name] and report.clean
    warm = store.get(ck.id).replica("warm")
    assert warm is not None and warm.state == ReplicaState.PRESENT
    # Re-encoded again from the hot original, not replaced by a raw lz4 copy.
    assert warm.manifest_digest is not None and warm.manifest_digest != ck.manifest_digest
    assert _warm_manifest(store, ck).codec == "zstd-3"
    if warm.manifest_digest == digest:  # deterministic compression: only the bad file changed
        assert tier.get_bytes(key) != bytes(data)
    _drop_hot(store, ck)
    assert _equal(store.load(ck.id), state)


def test_demote_keeps_the_reencoded_copy_then_restore(small: CheckpointStore) -> None:
    store = small
    state = _state(3)
    ck = store.save("run", 1, state)
    archive_checkpoints(store, tier="warm", reencode="zstd-3")
    digest = store.get(ck.id).replica("warm").manifest_digest  # type: ignore[union-attr]
    report = demote_checkpoints(store, older_than_days=0)
    assert report.archived == [ck.id] and report.removed == [ck.id]
    now = store.get(ck.id)
    assert now.replica("cold").manifest_digest == digest  # type: ignore[union-attr]
    assert now.replica("warm").state == ReplicaState.DELETED  # type: ignore[union-attr]
    assert _keys(store, "warm", ck) == []
    assert verify_replicas(store, tier="cold").clean

    _drop_hot(store, ck)
    path = restore_checkpoint(store, ck.id)
    assert path == store.checkpoint_dir("run", ck.id)
    assert store.get(ck.id).replica("hot").manifest_digest == digest  # type: ignore[union-attr]
    assert _equal(store.load(ck.id), state)


def test_crash_mid_reencode_records_nothing_and_rerun_succeeds(small: CheckpointStore) -> None:
    store = small
    state = _state(4)
    ck = store.save("run", 1, state)
    calls = 0

    def boom(_nbytes: int) -> None:
        nonlocal calls
        calls += 1
        if calls == 2:
            raise RuntimeError("killed mid re-encode")

    with pytest.raises(RuntimeError, match="killed"):
        archive_checkpoints(store, tier="warm", reencode="zstd-3", progress=boom, threads=1)
    warm = store.get(ck.id).replica("warm")
    assert warm is None or warm.state != ReplicaState.PRESENT
    assert not _warm(store).exists(_warm(store).key_for("run", ck.id, COMMIT_NAME))

    report = archive_checkpoints(store, tier="warm", reencode="zstd-3")
    assert report.archived == [ck.id] and report.ok
    _drop_hot(store, ck)
    assert _equal(store.load(ck.id), state)


def test_unknown_codec_is_refused_before_anything_is_written(small: CheckpointStore) -> None:
    ck = small.save("run", 1, _state(5))
    with pytest.raises(ConfigError, match="unknown archive codec 'zstd-9'"):
        archive_checkpoints(small, tier="warm", reencode="zstd-9")
    assert small.get(ck.id).replica("warm") is None
    assert _keys(small, "warm", ck) == []


def test_same_codec_is_copied_as_is(small: CheckpointStore) -> None:
    ck = small.save("run", 1, _state(6))
    report = archive_checkpoints(small, tier="warm", reencode="lz4")
    assert report.archived == [ck.id] and not report.reencoded
    assert report.not_reencoded == {ck.id: "already lz4"}
    assert small.get(ck.id).replica("warm").manifest_digest is None  # type: ignore[union-attr]


def test_reencode_from_a_remote_tier(small: CheckpointStore) -> None:
    """warm (plain, a dedup delta and its base) → cold re-encoded: chunks staged one by one."""
    store = small
    frozen = torch.randn(3000, generator=torch.Generator().manual_seed(7))
    states = [{"frozen": frozen, "x": torch.full((400,), float(i))} for i in range(2)]
    cks = [store.save("remote", i, s, delta="dedup") for i, s in enumerate(states)]
    assert store.manifest(cks[1].id).referenced_checkpoints() == {cks[0].id}
    archive_checkpoints(store, tier="warm")
    _drop_hot(store, *cks)
    report = archive_checkpoints(store, src="warm", tier="cold", reencode="zstd-1")
    assert sorted(report.reencoded) == sorted(c.id for c in cks)
    for ck in reversed(cks):
        delete_replica(store, store.get(ck.id), "warm")
    for ck, state in zip(cks, states, strict=True):
        assert store.get(ck.id).tiers == ("cold",)
        assert _equal(store.load(ck.id), state)


def _reencoded_hot(store: CheckpointStore, ck: Checkpoint) -> Checkpoint:
    """Archive ``ck`` re-encoded, drop its hot copy and restore: the hot copy is re-encoded."""
    assert archive_checkpoints(store, tier="warm", reencode="zstd-3").reencoded
    _drop_hot(store, ck)
    restore_checkpoint(store, ck.id)
    now = store.get(ck.id)
    hot = now.replica("hot")
    assert hot is not None and hot.manifest_digest not in (None, ck.manifest_digest)
    return now


def _files(directory: Path) -> dict[str, bytes]:
    return {str(p.relative_to(directory)): p.read_bytes()
            for p in sorted(directory.rglob("*")) if p.is_file()}


def test_signature_transfers_to_a_reencoded_hot_copy(local: CheckpointStore,
                                                     tmp_path: Path) -> None:
    store = local
    private, public = generate_keypair(tmp_path / "keys", "alice")
    state = _state(7)
    ck = store.save("run", 1, state)
    hot_dir = store.checkpoint_dir("run", ck.id)
    original_bytes = (hot_dir / MANIFEST_NAME).read_bytes()
    sign_checkpoint(store, ck.id, private)
    now = _reencoded_hot(store, ck)
    # The original manifest travelled: archive wrote it, restore copied it, byte for byte.
    assert (tmp_path / "warm" / "run" / ck.id / ORIGINAL_MANIFEST_NAME).read_bytes() \
        == original_bytes
    assert (hot_dir / ORIGINAL_MANIFEST_NAME).read_bytes() == original_bytes
    assert read_manifest(hot_dir).digest == now.replica("hot").manifest_digest  # type: ignore[union-attr]

    # The signature (from the `signed` event: the SIGNATURE file went with the old hot
    # copy) verifies on the re-encoded copy, deep, and load with a required signature works.
    verify_signature(store, ck.id, public, deep=True)
    assert _equal(store.load(ck.id, require_signature=public), state)
    # Signing the re-encoded copy signs the original digest (the content's identity).
    doc = SignatureDoc.parse(sign_checkpoint(store, ck.id, private).read_bytes())
    assert doc.manifest_digest == ck.manifest_digest
    verify_signature(store, ck.id, public)
    assert check_invariants(store) == []  # hot and (local) warm are re-encoded copies

    # A tampered original manifest inside the copy is refused everywhere it matters.
    orig = hot_dir / ORIGINAL_MANIFEST_NAME
    orig.write_bytes(original_bytes.replace(b'"step":1,', b'"step":2,', 1))
    assert orig.read_bytes() != original_bytes
    with pytest.raises(IntegrityError, match=ORIGINAL_MANIFEST_NAME):
        verify_signature(store, ck.id, public)
    with pytest.raises(IntegrityError, match=ORIGINAL_MANIFEST_NAME):
        store.load(ck.id, require_signature=public)
    assert any(ORIGINAL_MANIFEST_NAME in p for p in check_invariants(store))
    # A copy without it (made before it travelled) is refused with what to do.
    orig.unlink()
    with pytest.raises(IntegrityError, match="re-run `ckpt archive --reencode"):
        sign_checkpoint(store, ck.id, private)
    # The scrub sees it and repairs the copy from warm (same re-encoded manifest).
    report = verify_replicas(store, tier="hot")
    assert f"{ck.id}@hot" in report.damaged and report.clean
    assert orig.read_bytes() == original_bytes
    verify_signature(store, ck.id, public)

    # (3) on its own: same digests but other chunk content, or a moved tensor, is refused.
    original = Manifest.from_json(original_bytes)
    copy = read_manifest(hot_dir)
    check_same_content(original, copy)
    name, array = next(iter(copy.arrays.items()))
    chunks = (dataclasses.replace(array.chunks[0], blake3="0" * 64), *array.chunks[1:])
    forged = dataclasses.replace(copy, arrays={
        **copy.arrays, name: dataclasses.replace(array, chunks=chunks)})
    with pytest.raises(IntegrityError, match="other content"):
        check_same_content(original, forged)
    key, tensor = next(iter(copy.tensors.items()))
    moved = dataclasses.replace(copy, tensors={
        **copy.tensors, key: dataclasses.replace(tensor, offset=tensor.offset + 1)})
    with pytest.raises(IntegrityError, match="placed differently"):
        check_same_content(original, moved)


def test_bundle_of_a_reencoded_hot_copy_round_trips(local: CheckpointStore,
                                                    tmp_path: Path) -> None:
    store = local
    private, public = generate_keypair(tmp_path / "keys", "alice")
    state = _state(8)
    ck = store.save("run", 1, state, metrics={"loss": 0.5})
    now = _reencoded_hot(store, ck)
    sign_checkpoint(store, ck.id, private)  # a SIGNATURE file beside the re-encoded copy
    bundle = export_bundle(store, ck.id, tmp_path / "out" / "ck.tar")

    with CheckpointStore.open(tmp_path / "other") as other:
        imported = import_bundle(other, bundle, require_signature=public)
        assert imported.id == ck.id and imported.manifest_digest == ck.manifest_digest
        hot = imported.replica("hot")
        assert hot is not None and hot.state == ReplicaState.PRESENT
        assert hot.manifest_digest == now.replica("hot").manifest_digest  # type: ignore[union-attr]
        # Bit-exact: every file of the re-encoded copy, the original manifest and signature.
        src_files = _files(store.checkpoint_dir("run", ck.id))
        assert ORIGINAL_MANIFEST_NAME in src_files and "SIGNATURE" in src_files
        assert _files(other.checkpoint_dir("run", ck.id)) == src_files
        verify_signature(other, ck.id, public, deep=True)
        assert _equal(other.load(ck.id, require_signature=public), state)
        assert check_invariants(other) == []
        assert import_bundle(other, bundle).id == ck.id  # already there: the same row
