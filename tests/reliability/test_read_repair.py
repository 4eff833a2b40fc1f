"""Read repair: a damaged hot copy never fails a read that another verified copy can serve.

The damage is made on disk (a flipped bit, a truncated or a missing chunk file) in the hot
copy of a checkpoint that also has verified copies on warm and cold (moto S3). Every entry
point that reads a checkpoint (``store.load`` with and without ``keys``/``into``,
progressive loads, DCP-layout loads, ``restore --to``, export and codec conversion, the
``ckpt convert`` command) must return exactly the saved values, mark the damaged copy
DAMAGED with a ``damaged`` event, and leave a hot copy that verifies. With no other copy the
reader's error still names checkpoint, tensor and chunk.
"""

from __future__ import annotations

import json
import shutil
import uuid
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from ckptstore import CheckpointStore, ReplicaState
from ckptstore.errors import IntegrityError
from ckptstore.format import read_checkpoint, read_manifest
from ckptstore.ops.tiering.archive import archive_checkpoints
from ckptstore.ops.tiering.replicas import delete_replica
from ckptstore.ops.tiering.restore import restore_checkpoint
from ckptstore.ops.upkeep.convert import convert_checkpoint, export_checkpoint
from ckptstore.ops.upkeep.verify import verify_replicas
from ckptstore.records import Checkpoint

pytestmark = [pytest.mark.s3,
              pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")]

CHUNK = 64 * 1024
DAMAGE = ["flip", "truncate", "missing"]


@pytest.fixture
def config(new_root: Any, s3: Any) -> Path:
    """A store with warm and cold tiers on moto S3, by config file (the CLI opens it too)."""
    root = new_root()
    path = root / "ckptstore.toml"
    path.write_text(f"chunk_bytes = {CHUNK}\n" + s3.config_toml(root, uuid.uuid4().hex[:12]))
    return path


@pytest.fixture
def store(config: Path) -> Iterator[CheckpointStore]:
    with CheckpointStore.open(config=config) as opened:
        yield opened


def _state(seed: int = 0) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {
        "model": {"w": torch.randn(256, 256, generator=g),          # 4 chunks of its own
                  "b": torch.randn(300, generator=g).to(torch.bfloat16)},
        "optim": {"m": torch.randn(128, 256, generator=g), "step": 7},
    }


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return (isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
                and torch.equal(a, b))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(
            _equal(a[k], b[k]) for k in a)
    return bool(a == b)


def _saved(store: CheckpointStore, state: Any, *, run: str = "r", step: int = 1,
           tiers: tuple[str, ...] = ("warm", "cold")) -> Checkpoint:
    """Save ``state`` and copy it to ``tiers`` (the hot copy stays)."""
    ck = store.save(run, step, state)
    for tier in tiers:
        archive_checkpoints(store, ref=ck.id, tier=tier)
    return store.get(ck.id)


def _chunk_file(store: CheckpointStore, ck: Checkpoint, key: str, nth: int = 0) -> Path:
    directory = store.checkpoint_dir(ck.run, ck.id)
    manifest = read_manifest(directory, expected_digest=ck.manifest_digest)
    entry = manifest.tensors[key]
    array = manifest.arrays[entry.array]
    return directory / array.chunk_path(entry.chunk_start + nth)


def _damage(path: Path, how: str) -> None:
    """Damage one chunk file in place, as a disk would (a shared inode is damaged for every
    checkpoint that links it)."""
    if how == "missing":
        path.unlink()
        return
    data = bytearray(path.read_bytes())
    if how == "flip":
        data[len(data) // 2] ^= 0x10
        with open(path, "r+b") as fh:  # in place: the inode stays
            fh.write(bytes(data))
    else:
        with open(path, "r+b") as fh:
            fh.truncate(len(data) // 2)


def _events(store: CheckpointStore, ck: Checkpoint, kind: str) -> list[Any]:
    return [e for e in store.events(ck.id) if e.kind == kind]


def _hot(store: CheckpointStore, ck: Checkpoint) -> ReplicaState | None:
    replica = store.get(ck.id).replica("hot")
    return replica.state if replica is not None else None


def _assert_repaired(store: CheckpointStore, ck: Checkpoint, found_by: str,
                     source: str = "warm") -> None:
    """Marked, recorded, restored from ``source``, and the hot copy verifies again."""
    damaged = _events(store, ck, "damaged")
    assert damaged and damaged[-1].detail["tier"] == "hot"
    assert damaged[-1].detail["found_by"] == found_by
    restored = _events(store, ck, "restored")
    assert restored and restored[-1].detail["from"] == source
    assert _hot(store, ck) == ReplicaState.PRESENT
    report = verify_replicas(store, ref=ck.id, tier="hot")
    assert report.clean and report.ok == [f"{ck.id}@hot"], report


# ---------------------------------------------------------------------------- loads
@pytest.mark.parametrize("how", DAMAGE)
def test_load_reads_the_next_copy(store: CheckpointStore, how: str, figures: Any) -> None:
    state = _state()
    ck = _saved(store, state)
    _damage(_chunk_file(store, ck, "model/w", 2), how)
    assert _equal(store.load(ck.ref), state)
    _assert_repaired(store, ck, "load")
    assert _equal(store.load(ck.ref), state)  # the hot copy serves the next load again
    figures.add("damaged_copies", {how: 1})
    figures.add("reads_served", 1)


def test_load_into_a_partly_filled_destination_ends_exact(store: CheckpointStore,
                                                          figures: Any) -> None:
    state = _state(1)
    ck = _saved(store, state, tiers=("warm",))
    # The last chunk of the last array read: every other tensor is filled before the error.
    _damage(_chunk_file(store, ck, "optim/m", 1), "flip")
    into = {"model": {"w": torch.full((256, 256), float("nan")),
                      "b": torch.zeros(300, dtype=torch.bfloat16)},
            "optim": {"m": torch.full((128, 256), -1.0), "step": 0}}
    buffers = [into["model"]["w"], into["model"]["b"], into["optim"]["m"]]
    out = store.load(ck.ref, into=into)
    assert _equal(out, state)
    assert [out["model"]["w"], out["model"]["b"], out["optim"]["m"]] == buffers  # in place
    assert all(a is b for a, b in zip(
        [out["model"]["w"], out["model"]["b"], out["optim"]["m"]], buffers, strict=True))
    _assert_repaired(store, ck, "load")
    figures.add("damaged_copies", {"flip": 1})
    figures.add("reads_served", 1)


def test_keys_filtered_loads(store: CheckpointStore, figures: Any) -> None:
    """A load that never reads the damaged chunk is not disturbed (nothing is marked); one
    that does reads the next copy."""
    state = _state(2)
    ck = _saved(store, state, tiers=("warm",))
    _damage(_chunk_file(store, ck, "model/w"), "truncate")
    part = store.load(ck.ref, keys=["optim/*"])
    assert _equal(part["optim"]["m"], state["optim"]["m"])
    assert _hot(store, ck) == ReplicaState.PRESENT and not _events(store, ck, "damaged")
    part = store.load(ck.ref, keys=["model/*"])
    assert _equal(part["model"], state["model"])
    _assert_repaired(store, ck, "load")
    figures.add("damaged_copies", {"truncate": 1})
    figures.add("reads_served", 2)


def test_progressive_load_reads_the_next_copy(store: CheckpointStore, figures: Any) -> None:
    state = _state(3)
    ck = _saved(store, state, tiers=("warm",))
    _damage(_chunk_file(store, ck, "optim/m"), "flip")  # in the second group
    with store.load_progressive(ck.ref, order=["model/*"]) as pl:
        assert _equal(pl.wait(0)["model"], state["model"])
        assert _equal(pl.result(timeout=120), state)
    _assert_repaired(store, ck, "progressive load")
    figures.add("damaged_copies", {"flip": 1})
    figures.add("reads_served", 1)


def test_progressive_stream_from_a_damaged_warm_copy_reads_cold(
        store: CheckpointStore, s3: Any, figures: Any) -> None:
    """Only warm and cold hold the checkpoint: the stream from warm meets a flipped bit, the
    warm copy is marked DAMAGED and the rest comes from cold."""
    state = _state(11)
    ck = _saved(store, state)
    rel = _chunk_file(store, ck, "optim/m").relative_to(
        store.checkpoint_dir(ck.run, ck.id)).as_posix()
    delete_replica(store, store.get(ck.id), "hot")
    warm = store.tiers["warm"]
    key = warm.key_for(ck.run, ck.id, rel)
    data = bytearray(warm.get_bytes(key))
    data[len(data) // 2] ^= 0x01
    s3.client().put_object(Bucket=s3.bucket, Key=f"{warm.prefix}/{key}", Body=bytes(data))
    with store.load_progressive(ck.ref, order=["model/*"]) as pl:
        assert pl.source == "warm"
        assert _equal(pl.result(timeout=120), state)
        assert pl.source == "hot"
    assert store.get(ck.id).replica("warm").state == ReplicaState.DAMAGED  # type: ignore[union-attr]
    assert _events(store, ck, "damaged")[-1].detail["tier"] == "warm"
    assert _events(store, ck, "restored")[-1].detail["from"] == "cold"
    assert _equal(store.load(ck.ref), state)
    report = verify_replicas(store, ref=ck.id)
    assert report.repaired == [f"{ck.id}@warm"] and report.clean
    figures.add("damaged_copies", {"warm flip": 1})
    figures.add("reads_served", 1)


def test_falls_back_to_cold_when_warm_is_damaged_too(store: CheckpointStore,
                                                     figures: Any) -> None:
    state = _state(4)
    ck = _saved(store, state)
    path = _chunk_file(store, ck, "model/w", 1)
    warm = store.tiers["warm"]
    rel = path.relative_to(store.checkpoint_dir(ck.run, ck.id)).as_posix()
    warm.delete(warm.key_for(ck.run, ck.id, rel))  # the warm copy lost that chunk
    _damage(path, "flip")
    assert _equal(store.load(ck.ref), state)
    _assert_repaired(store, ck, "load", source="cold")
    # The warm copy's loss is the scrub's to find (a remote failure may be the network).
    report = verify_replicas(store, ref=ck.id)
    assert report.repaired == [f"{ck.id}@warm"] and report.clean
    figures.add("damaged_copies", {"flip": 1})
    figures.add("reads_served", 1)


def test_damaged_chunk_shared_with_an_older_checkpoint(store: CheckpointStore,
                                                       figures: Any) -> None:
    """Deduplicated saves share unchanged chunks (one inode, linked into both directories):
    damage there breaks the base and every checkpoint that shares it."""
    base_state = _state(5)
    base = _saved(store, base_state, step=1, tiers=("warm",))
    state = {**base_state, "optim": {"m": base_state["optim"]["m"] + 1, "step": 8}}
    ck = _saved(store, state, step=2, tiers=("warm",))
    manifest = read_manifest(store.checkpoint_dir(ck.run, ck.id),
                             expected_digest=ck.manifest_digest)
    entry = manifest.tensors["model/w"]
    assert manifest.arrays[entry.array].chunks[entry.chunk_start].src == base.id
    _damage(_chunk_file(store, base, "model/w"), "flip")
    assert _equal(store.load(ck.ref), state)
    _assert_repaired(store, ck, "load")
    assert _equal(store.load(base.ref), base_state)
    report = verify_replicas(store, ref=base.id, tier="hot")
    assert report.ok == [f"{base.id}@hot"], report
    figures.add("damaged_copies", {"shared chunk": 1})
    figures.add("reads_served", 2)


def test_damaged_memory_and_hot_copies_read_warm(store: CheckpointStore, tmp_path: Path,
                                                 figures: Any) -> None:
    """The memory copy falls through to the hot copy, whose damage falls through to warm."""
    from ckptstore.ops.writing.memory import MEMORY_TIER, attach_memory_tier

    shm = Path("/dev/shm") if Path("/dev/shm").is_dir() else tmp_path
    root = shm / f"ckptstore-test-{uuid.uuid4().hex[:10]}"
    try:
        tier = attach_memory_tier(store, 64 * 2**20, root=root)
        state = _state(12)
        ck = _saved(store, state, tiers=("warm",))
        assert ck.replica(MEMORY_TIER) is not None
        in_memory = tier.path_for(ck.run, ck.id) / _chunk_file(store, ck, "model/w").relative_to(
            store.checkpoint_dir(ck.run, ck.id))
        _damage(in_memory, "flip")
        _damage(_chunk_file(store, ck, "model/w"), "flip")
        assert _equal(store.load(ck.ref), state)
        assert store.get(ck.id).replica(MEMORY_TIER).state == ReplicaState.DAMAGED  # type: ignore[union-attr]
        _assert_repaired(store, ck, "load")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    figures.add("damaged_copies", {"flip": 2})
    figures.add("reads_served", 1)


def test_dcp_layout_load_reads_the_next_copy(store: CheckpointStore, figures: Any) -> None:
    import torch.distributed.checkpoint as dcp

    from ckptstore.ops.dcp import dcp_writer

    state = {"model": {"w": torch.randn(300, 200), "ids": torch.arange(10)}}
    writer = dcp_writer(store, "d", 1)
    with writer, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, storage_writer=writer, no_dist=True)
    ck = writer.checkpoint
    archive_checkpoints(store, ref=ck.id, tier="warm")
    directory = store.checkpoint_dir(ck.run, ck.id)
    chunk = next(p for p in sorted(directory.rglob("c.*")) if p.stat().st_size > 1024)
    _damage(chunk, "flip")
    out = store.load(ck.ref)
    assert torch.equal(out["model"]["w"], state["model"]["w"])
    assert torch.equal(out["model"]["ids"], state["model"]["ids"])
    _assert_repaired(store, store.get(ck.id), "load")
    figures.add("damaged_copies", {"flip": 1})
    figures.add("reads_served", 1)


# ------------------------------------------------------------- restores and exports
def test_restore_to_a_directory_then_verify_repairs(store: CheckpointStore, tmp_path: Path,
                                                    figures: Any) -> None:
    state = _state(6)
    ck = _saved(store, state, tiers=("warm",))
    _damage(_chunk_file(store, ck, "model/b"), "flip")
    path = restore_checkpoint(store, ck.ref, to=tmp_path / "out")
    manifest = read_manifest(path, expected_digest=ck.manifest_digest)
    assert _equal(read_checkpoint(path, manifest, locate=lambda i: tmp_path / "out" / "r" / i),
                  state)
    assert _hot(store, ck) == ReplicaState.DAMAGED
    damaged = _events(store, ck, "damaged")
    assert damaged and damaged[-1].detail["found_by"] == "restore"
    report = verify_replicas(store, ref=ck.id)
    assert report.repaired == [f"{ck.id}@hot"] and report.clean
    assert _hot(store, ck) == ReplicaState.PRESENT
    assert _equal(store.load(ck.ref), state)
    figures.add("damaged_copies", {"flip": 1})
    figures.add("reads_served", 1)


@pytest.mark.parametrize("fmt", ["safetensors", "pt"])
def test_export_reads_the_next_copy(store: CheckpointStore, tmp_path: Path, fmt: str,
                                    figures: Any) -> None:
    state = _state(7)
    ck = _saved(store, state, tiers=("warm",))
    _damage(_chunk_file(store, ck, "optim/m"), "missing")
    out = export_checkpoint(store, ck.ref, fmt, tmp_path / f"out.{fmt}")
    if fmt == "safetensors":
        from safetensors.torch import load_file

        tensors = load_file(str(out))
        assert torch.equal(tensors["optim/m"], state["optim"]["m"])
        assert torch.equal(tensors["model/w"], state["model"]["w"])
    else:
        assert _equal(torch.load(out, weights_only=True), state)
    _assert_repaired(store, ck, "export" if fmt == "safetensors" else "load")
    figures.add("damaged_copies", {"missing": 1})
    figures.add("reads_served", 1)


def test_codec_conversion_reads_the_next_copy(store: CheckpointStore, figures: Any) -> None:
    state = _state(8)
    ck = _saved(store, state, tiers=("warm",))
    _damage(_chunk_file(store, ck, "model/w", 3), "truncate")
    new = convert_checkpoint(store, ck.ref, codec="zstd-1")
    assert _equal(store.load(new.id), state)
    _assert_repaired(store, ck, "load")
    figures.add("damaged_copies", {"truncate": 1})
    figures.add("reads_served", 1)


def test_ckpt_convert_and_events(store: CheckpointStore, config: Path, tmp_path: Path,
                                 capsys: pytest.CaptureFixture[str], figures: Any) -> None:
    from safetensors.torch import load_file

    from ckptstore.cli.app import main

    state = _state(9)
    ck = _saved(store, state, tiers=("warm",))
    _damage(_chunk_file(store, ck, "model/w", 1), "flip")
    capsys.readouterr()
    out = tmp_path / "w.safetensors"
    code = main(["--config", str(config), "convert", ck.ref, "--format", "safetensors",
                 "--out", str(out), "--json"])
    assert code == 0, capsys.readouterr()
    assert torch.equal(load_file(str(out))["model/w"], state["model"]["w"])
    capsys.readouterr()
    assert main(["--config", str(config), "events", ck.ref, "--json"]) == 0
    kinds = [e["kind"] for e in json.loads(capsys.readouterr().out)]
    assert "damaged" in kinds and "restored" in kinds
    figures.add("damaged_copies", {"flip": 1})
    figures.add("reads_served", 1)


# ---------------------------------------------------------------------- no other copy
@pytest.mark.parametrize("how", ["flip", "missing"])
def test_without_another_copy_the_error_names_the_chunk(store: CheckpointStore,
                                                        how: str) -> None:
    state = _state(10)
    ck = _saved(store, state, tiers=())
    path = _chunk_file(store, ck, "model/w", 1)
    _damage(path, how)
    with pytest.raises(IntegrityError) as info:
        store.load(ck.ref)
    text = str(info.value)
    assert ck.id in text and "model/w" in text and str(path) in text
    assert any("no other verified copy" in note for note in info.value.__notes__)
    # Nothing is marked: loads that do not touch the damaged chunk still work.
    assert _hot(store, ck) == ReplicaState.PRESENT and not _events(store, ck, "damaged")
    assert _equal(store.load(ck.ref, keys=["optim/*"])["optim"], state["optim"])
