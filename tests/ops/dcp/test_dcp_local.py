"""The DCP storage writer and reader in one process (no process group): format, integrity,
failure, async staging, safety, and the store-level entry points."""

from __future__ import annotations

import json
import math
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import FileSystemWriter

from ckptstore import CheckpointStore
from ckptstore.errors import (
    ConfigError,
    IncompleteCheckpointError,
    IntegrityError,
    InvalidNameError,
    UnsafeObjectError,
)
from ckptstore.format import read_manifest
from ckptstore.ops.dcp import (
    ZarrStorageReader,
    ZarrStorageWriter,
    dcp_reader,
    dcp_writer,
    is_dcp_manifest,
    load_dcp,
    save_distributed,
    verify_dcp,
)
from ckptstore.ops.dcp.stage import pool_for
from ckptstore.records import CheckpointState

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")


@pytest.fixture
def store(tmp_path: Path) -> Iterator[CheckpointStore]:
    with CheckpointStore.open(tmp_path / "store", chunk_bytes=64 * 1024) as s:
        yield s


def _state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    return {
        "model": {
            "big": torch.randn(300, 200, generator=g),  # 240 kB: its own array, 4 chunks
            "half": torch.randn(64, 33, generator=g).to(torch.bfloat16),
            "scalar": torch.tensor(2.5),
            "empty": torch.empty(0, 3),
            "ids": torch.arange(10, dtype=torch.int64),
            "mask": torch.tensor([True, False, True]),
            "f8": torch.randn(16, generator=g).to(torch.float8_e4m3fn),
            "strided": torch.randn(40, 30, generator=g)[:, ::3],
        },
        "meta": {"step": 7, "lr": [0.1, 0.01], "name": "run"},
    }


def _bits(t: torch.Tensor) -> torch.Tensor:
    width = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    return t.contiguous().view(width)


def _equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(_bits(a), _bits(b))


def _save(store: CheckpointStore, run: str, step: int, state: dict[str, Any], **kw: Any) -> Any:
    writer = dcp_writer(store, run, step, pack_below=8 * 1024, **kw)
    with writer, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, storage_writer=writer, no_dist=True)
    return writer.checkpoint


def _open(store: CheckpointStore, ckpt_id: str) -> tuple[Path, Any]:
    ck = store.get(ckpt_id)
    directory = store.checkpoint_dir(ck.run, ck.id)
    return directory, read_manifest(directory, expected_digest=ck.manifest_digest)


@pytest.mark.parametrize("codec", ["none", "lz4"])
def test_round_trip_full_and_into(store: CheckpointStore, codec: str) -> None:
    state = _state()
    ck = _save(store, "r", 1, state, codec=codec, metrics={"loss": 0.5})
    assert ck.state == CheckpointState.COMMITTED and ck.codec == codec
    assert ck.metrics == {"loss": 0.5}
    directory, manifest = _open(store, ck.id)
    assert is_dcp_manifest(manifest)
    assert verify_dcp(directory, manifest) == []

    full = load_dcp(directory, manifest)
    for key, value in state["model"].items():
        assert _equal(full["model"][key], value), key
    assert full["meta"] == state["meta"]

    into = {
        "model": {k: torch.zeros_like(v) for k, v in state["model"].items()},
        "meta": {"step": 0, "lr": [], "name": ""},
    }
    into["model"]["strided"] = torch.zeros(40, 30)[:, ::3]  # a non-contiguous target
    load_dcp(directory, manifest, into=into)
    for key, value in state["model"].items():
        assert _equal(into["model"][key], value), key
    assert into["meta"] == state["meta"]

    part = load_dcp(directory, manifest, keys=["model/big", "meta.step"])
    assert set(part) == {"model", "meta"} and set(part["model"]) == {"big"}
    with pytest.raises(InvalidNameError, match="match nothing"):
        load_dcp(directory, manifest, keys=["nope/*"])
    with pytest.raises(InvalidNameError, match="cannot be combined"):
        load_dcp(directory, manifest, keys=["model/*"], into=into)


def test_the_index_is_a_typed_field_with_the_same_bytes(store: CheckpointStore) -> None:
    from ckptstore.format import Manifest
    from ckptstore.format.manifest import DcpIndex

    ck = _save(store, "r", 1, _state())
    directory, manifest = _open(store, ck.id)
    data = (directory / "manifest.json").read_bytes()
    assert isinstance(manifest.dcp, DcpIndex) and manifest.files
    assert "dcp" not in manifest.extra and "files" not in manifest.extra
    # The JSON keeps the index and the file list under extra, and re-serialises exactly.
    assert set(json.loads(data)["extra"]) == {"dcp", "files"}
    assert Manifest.from_json(data).to_json() == data == manifest.to_json()


def test_tensors_are_listed_in_the_common_index(store: CheckpointStore) -> None:
    """One manifest shape: a DCP checkpoint's tensors are in the manifest's ``tensors`` list
    with the fields every entry has (key, torch_dtype, shape, numel), plus their pieces."""
    from ckptstore.format import Manifest

    state = _state()
    ck = _save(store, "r", 1, state)
    directory, _manifest = _open(store, ck.id)
    data = (directory / "manifest.json").read_bytes()
    doc = json.loads(data)
    assert "tensors" not in doc["extra"]["dcp"]
    entries = {e["key"]: e for e in doc["tensors"]}
    assert set(entries) == {f"model.{k}" for k in state["model"]}
    for key, value in state["model"].items():
        entry = entries[f"model.{key}"]
        assert entry["shape"] == list(value.shape) and entry["numel"] == value.numel()
        assert entry["torch_dtype"] == str(value.dtype).removeprefix("torch.")
        assert sum(math.prod(p["sizes"]) for p in entry["pieces"]) == value.numel()
    # The entries are checked like the rest of the index.
    doc["tensors"][0]["numel"] += 1
    with pytest.raises(IntegrityError, match="numel does not match"):
        Manifest.from_json(json.dumps(doc).encode())
    doc["tensors"][0]["numel"] -= 1
    doc["tensors"].append(dict(doc["tensors"][0]))
    with pytest.raises(IntegrityError, match="repeated key"):
        Manifest.from_json(json.dumps(doc).encode())


def test_zarr_metadata_check_knows_the_dcp_layout(store: CheckpointStore) -> None:
    """The format's metadata check (ckpt doctor, bundle import) expects the DCP documents:
    a clean DCP checkpoint has no finding, a planted codec is caught, and the rewrite
    restores the writer's exact documents (the layout attribute included)."""
    import zarr

    from ckptstore.format import verify_checkpoint
    from ckptstore.format.zarrcheck import check_zarr_metadata, rewrite_zarr_metadata
    from ckptstore.ops.upkeep.doctor import doctor

    state = _state()
    ck = _save(store, "r", 1, state)
    directory, manifest = _open(store, ck.id)
    assert check_zarr_metadata(directory, manifest) == []
    assert doctor(store).findings == []
    path = directory / "dcp" / "model.big" / "zarr.json"
    meta = json.loads(path.read_text())
    meta["codecs"] = [{"name": "numcodecs.pickle", "configuration": {}}]
    path.write_text(json.dumps(meta))
    problems = check_zarr_metadata(directory, manifest)
    assert len(problems) == 1 and "numcodecs.pickle" in problems[0], problems
    rewrite_zarr_metadata(directory, manifest)
    assert check_zarr_metadata(directory, manifest) == []
    assert verify_checkpoint(directory, manifest, deep=True) == []  # sizes as recorded
    group = zarr.open_group(str(directory), mode="r")
    assert group.attrs["ckptstore"]["layout"] == "dcp"
    assert np.array_equal(group["dcp"]["model.big"][:], state["model"]["big"].numpy())


def test_layout_is_plain_zarr(store: CheckpointStore) -> None:
    import zarr

    state = _state()
    ck = _save(store, "r", 1, state)
    directory, manifest = _open(store, ck.id)
    group = zarr.open_group(str(directory), mode="r")
    big = group["dcp"]["model.big"]
    assert big.shape == (300, 200) and big.chunks[1] == 200
    assert np.array_equal(big[:], state["model"]["big"].numpy())
    packs = group["dcp_packs"]
    assert "r0.bfloat16" in packs and packs["r0.bfloat16"].attrs["torch_dtype"] == "bfloat16"
    # Every file of the checkpoint is listed (with sizes) for tier copies and verify.
    listed = {entry.path for entry in manifest.files}
    on_disk = {
        str(p.relative_to(directory)) for p in directory.rglob("*") if p.is_file()
    } - {"zarr.json", "manifest.json", "COMMITTED"}
    assert listed == on_disk


def test_damage_is_detected_never_zeros(store: CheckpointStore) -> None:
    ck = _save(store, "r", 1, _state())
    directory, manifest = _open(store, ck.id)
    chunk = directory / "dcp" / "model.big" / "c.1.0"
    data = bytearray(chunk.read_bytes())
    data[100] ^= 0x40
    chunk.write_bytes(bytes(data))
    problems = verify_dcp(directory, manifest)
    assert len(problems) == 1 and "c.1.0" in problems[0]
    with pytest.raises(IntegrityError, match=r"model\.big.*crc32c"):
        load_dcp(directory, manifest)
    chunk.unlink()
    assert verify_dcp(directory, manifest, deep=False) == ["dcp/model.big/c.1.0: missing"]
    with pytest.raises(IntegrityError, match="is missing"):
        load_dcp(directory, manifest, into={"model": {"big": torch.zeros(300, 200)}})


def test_rank_failure_commits_nothing_and_previous_loads(store: CheckpointStore) -> None:
    good = _save(store, "r", 1, _state())

    class Failing(DefaultSavePlanner):
        calls = 0

        def resolve_data(self, write_item: Any) -> Any:
            Failing.calls += 1
            if Failing.calls > 2:
                raise RuntimeError("disk on fire")
            return super().resolve_data(write_item)

    writer = ZarrStorageWriter(store, "r", 2)
    with (  # noqa: PT012
        pytest.raises(BaseException, match="disk on fire"), writer, warnings.catch_warnings()
    ):
        warnings.simplefilter("ignore")
        dcp.save(_state(), storage_writer=writer, planner=Failing(), no_dist=True)
    failed = store.catalog.get_any(writer.ckpt_id or "")
    assert failed.state == CheckpointState.FAILED
    assert not store.checkpoint_dir("r", failed.id).exists()
    with pytest.raises(IncompleteCheckpointError):
        _ = writer.checkpoint
    assert store.latest("r").id == good.id
    directory, manifest = _open(store, good.id)
    assert load_dcp(directory, manifest)["meta"]["step"] == 7


def test_writer_rejects_what_it_cannot_do(store: CheckpointStore) -> None:
    with pytest.raises(InvalidNameError):
        ZarrStorageWriter(store, "bad name!", 1)
    with pytest.raises(InvalidNameError, match="codec"):
        ZarrStorageWriter(store, "r", 1, codec="gzip")
    writer = ZarrStorageWriter(store, "r", 1)
    with pytest.raises(ConfigError, match="checkpoint_id"):
        writer.reset("/some/path")
    with pytest.raises(ConfigError, match="use_collectives"):
        writer.set_up_storage_writer(True, rank=0, use_collectives=False)
    with pytest.raises(BaseException, match="cannot store"), warnings.catch_warnings():  # noqa: PT012
        warnings.simplefilter("ignore")
        dcp.save({"q": torch.quantize_per_tensor(torch.ones(4), 0.1, 0, torch.qint8)},
                 storage_writer=ZarrStorageWriter(store, "r", 1), no_dist=True)
    assert store.list(run="r") == []


class _Opaque:
    """A picklable object that weights_only loading refuses."""

    def __init__(self) -> None:
        self.x = 1


def test_non_tensor_items_never_unpickle_arbitrary_objects(store: CheckpointStore) -> None:
    ck = _save(store, "r", 1, {"w": torch.ones(3), "obj": _Opaque()})
    directory, manifest = _open(store, ck.id)
    with pytest.raises(UnsafeObjectError, match="'obj'"):
        load_dcp(directory, manifest)
    with pytest.raises(UnsafeObjectError, match="'obj'"):
        load_dcp(directory, manifest, into={"w": torch.zeros(3), "obj": None})
    # The bytes are DCP's own torch.save output, untouched: DCP's planner loads them.
    target: dict[str, Any] = {"w": torch.zeros(3), "obj": None}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(target, storage_reader=ZarrStorageReader(directory), no_dist=True)
    assert isinstance(target["obj"], _Opaque) and torch.equal(target["w"], torch.ones(3))


def test_async_save_stages_into_reused_bounded_buffers(tmp_path: Path) -> None:
    state = {"w": torch.randn(256, 256), "b": torch.randn(256), "n": 3}
    nbytes = sum(t.nbytes for t in state.values() if isinstance(t, torch.Tensor))
    with CheckpointStore.open(tmp_path / "s", staging_budget_bytes=3 * nbytes) as store:
        expected = state["w"].clone()
        ids = []
        for step in range(3):
            writer = dcp_writer(store, "a", step)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                future = dcp.async_save(state, storage_writer=writer, no_dist=True)
            state["w"].add_(1.0)  # the staged copy is not affected
            future.result(timeout=60)
            ids.append(writer.checkpoint.id)
            directory, manifest = _open(store, ids[-1])
            assert _equal(load_dcp(directory, manifest)["w"], expected)
            expected += 1.0
        pool = pool_for(store)
        assert pool.allocations == 2  # buffers of the first save were reused
        assert pool.in_use_bytes == 0
    small = CheckpointStore.open(tmp_path / "s2", staging_budget_bytes=nbytes // 2)
    with small, pytest.raises(ConfigError, match="staging_budget_bytes"):
        dcp.async_save(state, storage_writer=dcp_writer(small, "a", 0), no_dist=True)


def test_save_distributed_without_process_group(store: CheckpointStore) -> None:
    plain = save_distributed(store, "p", 1, {"w": torch.ones(2)})
    assert not is_dcp_manifest(store.manifest(plain.id))
    assert torch.equal(store.load(plain.id)["w"], torch.ones(2))

    class App:
        def __init__(self) -> None:
            self.w = torch.arange(4.0)

        def state_dict(self) -> dict[str, Any]:
            return {"w": self.w}

        def load_state_dict(self, sd: dict[str, Any]) -> None:
            self.w = sd["w"]

    sharded = save_distributed(store, "p", 2, {"app": App()})  # a Stateful goes through DCP
    directory, manifest = _open(store, sharded.id)
    assert is_dcp_manifest(manifest)
    assert torch.equal(load_dcp(directory, manifest)["app"]["w"], torch.arange(4.0))
    reader = dcp_reader(store, sharded.id)
    app = App()
    app.w = torch.zeros(4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load({"app": app}, storage_reader=reader, no_dist=True)
    assert torch.equal(app.w, torch.arange(4.0))


def test_dcp_folders_import_and_regular_checkpoints_export(store: CheckpointStore,
                                                           tmp_path: Path) -> None:
    """The conversion engineer's DCP import/export (ops/upkeep/convert.py), checked from here."""
    from ckptstore.ops.upkeep.convert import export_checkpoint, import_checkpoint

    state = {"model": {"w": torch.randn(8, 4)}, "step": 3}
    folder = tmp_path / "dcp-in"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, storage_writer=FileSystemWriter(str(folder)), no_dist=True)
    ck = import_checkpoint(store, folder, run="imp", step=3, fmt="dcp")
    loaded = store.load(ck.id)
    assert torch.equal(loaded["model"]["w"], state["model"]["w"]) and loaded["step"] == 3
    out = export_checkpoint(store, ck.id, "dcp", tmp_path / "dcp-out")
    target = {"model": {"w": torch.zeros(8, 4)}, "step": 0}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(target, checkpoint_id=str(out), no_dist=True)
    assert torch.equal(target["model"]["w"], state["model"]["w"])


def test_store_entry_points(store: CheckpointStore) -> None:
    state = _state()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        writer = store.dcp_writer("s", 1)  # type: ignore[attr-defined]
        dcp.save(state, storage_writer=writer, no_dist=True)
    ck = store.latest("s")
    full = store.load(ck.ref)
    assert _equal(full["model"]["big"], state["model"]["big"])
    assert store.verify(ck.ref) == []
    into = {"model": {"big": torch.zeros(300, 200)}}
    store.load(ck.ref, into=into)
    assert _equal(into["model"]["big"], state["model"]["big"])
    saved = store.save("s", 2, {"w": torch.ones(3)}, distributed=True)  # type: ignore[call-arg]
    assert torch.equal(store.load(saved.ref)["w"], torch.ones(3))


def test_index_sizes_stay_small(store: CheckpointStore) -> None:
    """Small tensors are packed: a state of many tiny tensors costs a few files."""
    state = {f"p{i}": torch.full((7,), float(i)) for i in range(200)}
    ck = _save(store, "many", 1, state)
    directory, manifest = _open(store, ck.id)
    files = [p for p in directory.rglob("*") if p.is_file()]
    assert len(files) < 12
    full = load_dcp(directory, manifest)
    assert all(torch.equal(full[f"p{i}"], state[f"p{i}"]) for i in range(200))


def test_archive_restore_round_trip_copies_the_dcp_layout(tmp_path: Path) -> None:
    from ckptstore.ops.tiering.archive import archive_checkpoints
    from ckptstore.ops.tiering.replicas import delete_replica
    from ckptstore.ops.tiering.restore import restore_checkpoint

    with CheckpointStore.open(tmp_path / "s", warm=str(tmp_path / "nas"),
                              chunk_bytes=64 * 1024) as store:
        state = _state()
        ck = _save(store, "t", 1, state)
        report = archive_checkpoints(store)
        assert report.ok, report.summary()
        delete_replica(store, ck, "hot")
        assert not store.checkpoint_dir("t", ck.id).exists()
        restore_checkpoint(store, ck.id)
        directory, manifest = _open(store, ck.id)
        assert verify_dcp(directory, manifest) == []
        full = load_dcp(directory, manifest)
        assert _equal(full["model"]["big"], state["model"]["big"])
        # The format's own verify sees the DCP files too (shallow and deep).
        from ckptstore.format import verify_checkpoint

        assert verify_checkpoint(directory, manifest, deep=True) == []
        (directory / "dcp" / "model.big" / "c.0.0").unlink()
        assert any("c.0.0" in p for p in verify_checkpoint(directory, manifest, deep=False))


def test_export_of_a_dcp_saved_checkpoint(store: CheckpointStore, tmp_path: Path) -> None:
    from ckptstore.ops.upkeep.convert import export_checkpoint

    state = _state()
    ck = _save(store, "x", 1, state)
    out = export_checkpoint(store, ck.id, "dcp", tmp_path / "out-dcp")
    target = {"model": {k: torch.zeros_like(v) for k, v in state["model"].items()},
              "meta": {"step": 0, "lr": [], "name": ""}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(target, checkpoint_id=str(out), no_dist=True)
    assert all(_equal(target["model"][k], v) for k, v in state["model"].items())
    pt = export_checkpoint(store, ck.id, "pt", tmp_path / "out.pt")
    loaded = torch.load(pt, weights_only=True)
    assert _equal(loaded["model"]["big"], state["model"]["big"])
    with pytest.raises(InvalidNameError, match="pt or dcp"):
        export_checkpoint(store, ck.id, "safetensors", tmp_path / "out.safetensors")


def test_the_dcp_writer_records_the_run_context(tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    from context_support import assert_full_context, training_repo

    repo = training_repo(tmp_path / "repo", monkeypatch)
    with CheckpointStore.open(tmp_path / "store") as store:
        ck = _save(store, "dcp-ctx", 1, {"w": torch.ones(4)}, config={"lr": 3e-4},
                   data_version="shard-9")
        doc = store.catalog.context_of(ck).document
    assert_full_context(doc, repo)
    assert doc["config"] == {"lr": 3e-4} and doc["data_version"] == "shard-9"
