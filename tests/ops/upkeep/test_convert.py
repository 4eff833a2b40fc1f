"""Conversion to and from plain PyTorch formats: pt, safetensors, hf folders, DCP.

Everything runs on real components: a store on tmp_path (SQLite catalog + hot tier), real
``torch.save``/``torch.distributed.checkpoint``/``safetensors`` files. The memory bound of the
streaming export is measured in a subprocess.
"""

from __future__ import annotations

import json
import os
import pathlib
import pickle
import subprocess
import sys
import textwrap
from collections import OrderedDict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file

from ckptstore import CheckpointStore
from ckptstore.convert.dcp_read import read_dcp
from ckptstore.convert.directory import convert_directory
from ckptstore.convert.readers import detect_format, load_pt, read_source
from ckptstore.convert.safetensors import (
    SafetensorsFileWriter,
    TensorSpec,
    hf_shard_names,
    plan_shards,
)
from ckptstore.convert.writers import staged_output
from ckptstore.errors import (
    ConflictError,
    IntegrityError,
    InvalidNameError,
    UnsafeObjectError,
)
from ckptstore.ops.upkeep.convert import (
    convert_checkpoint,
    export_checkpoint,
    import_checkpoint,
)

pytestmark = pytest.mark.filterwarnings(
    "ignore:torch.distributed is disabled:UserWarning",
)


# --------------------------------------------------------------------------- helpers
def assert_same(a: Any, b: Any, path: str = "") -> None:
    """Structure, container types, key types and tensor bits all equal."""
    assert type(a) is type(b), f"{path}: {type(a)} != {type(b)}"
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape, f"{path}: {a.dtype}{a.shape}"
        assert torch.equal(
            a.contiguous().reshape(-1).view(torch.uint8),
            b.contiguous().reshape(-1).view(torch.uint8),
        ), f"{path}: values differ"
    elif isinstance(a, dict):
        assert list(a) == list(b), f"{path}: keys {list(a)} != {list(b)}"
        for key in a:
            assert_same(a[key], b[key], f"{path}/{key}")
    elif isinstance(a, list | tuple):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{path}/{i}")
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"


def model_weights() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "enc.weight": torch.randn(64, 32, generator=g),
        "enc.bias": torch.randn(32, generator=g).to(torch.bfloat16),
        "emb.weight": torch.randn(10, 4, generator=g).half(),
        "mask": torch.tensor([True, False, True]),
        "ids": torch.arange(-5, 5, dtype=torch.int8),
        "u8": torch.arange(7, dtype=torch.uint8),
        "i16": torch.arange(3, dtype=torch.int16),
        "i32": torch.arange(4, dtype=torch.int32),
        "count": torch.tensor(7, dtype=torch.int64),
        "f64": torch.randn(3, generator=g, dtype=torch.float64),
        "c64": torch.randn(2, generator=g, dtype=torch.complex64),
        "f8": torch.randn(4, generator=g).to(torch.float8_e4m3fn),
        "u16": torch.arange(5, dtype=torch.int32).to(torch.uint16),
        "scalar": torch.tensor(3.5),
        "empty": torch.empty(0, 3),
    }


def training_state(*, extended: bool = False) -> dict[str, Any]:
    """Model + optimizer (int keys) + scheduler + plain values; ``extended`` adds dtypes
    that safetensors cannot hold."""
    weights = model_weights()
    if extended:
        weights["c128"] = torch.randn(2, dtype=torch.complex128)
    g = torch.Generator().manual_seed(1)
    return {
        "model": weights,
        "optimizer": {
            "state": {
                0: {"step": torch.tensor(10.0), "exp_avg": torch.randn(64, 32, generator=g)},
                1: {"step": torch.tensor(10.0), "exp_avg": torch.randn(32, generator=g)},
            },
            "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.999), "params": [0, 1], "x": None}],
        },
        "scheduler": OrderedDict([("last_epoch", 4), ("base_lrs", [0.001])]),
        "epoch": 3,
        "note": "hello",
        "size": torch.Size([2, 3]),
    }


@pytest.fixture
def store(tmp_path: Path) -> Iterator[CheckpointStore]:
    s = CheckpointStore.open(tmp_path / "store")
    try:
        yield s
    finally:
        s.close()


class Evil:
    """Unpickling this creates the marker file: it must never happen."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (pathlib.Path.touch, (self.marker,))


# --------------------------------------------------------------------------- pure pieces
def test_safetensors_writer_accepts_any_order(tmp_path: Path) -> None:
    tensors = {k: v for k, v in model_weights().items() if k != "c64"}
    tensors["c64"] = torch.randn(3, dtype=torch.complex64)
    specs = [TensorSpec(k, t.dtype, tuple(t.shape)) for k, t in tensors.items()]
    path = tmp_path / "x.safetensors"
    with SafetensorsFileWriter(path, specs, {"format": "pt"}) as writer:
        for key in reversed(list(tensors)):
            writer.write(key, tensors[key])
    loaded = load_file(path)
    assert set(loaded) == set(tensors)
    for key, tensor in tensors.items():
        assert_same(loaded[key], tensor, key)


def test_safetensors_writer_rejects_incomplete_and_wrong_shapes(tmp_path: Path) -> None:
    specs = [TensorSpec("a", torch.float32, (2,)), TensorSpec("b", torch.float32, (3,))]
    writer = SafetensorsFileWriter(tmp_path / "x.safetensors", specs)
    with pytest.raises(IntegrityError, match="manifest says"):
        writer.write("a", torch.zeros(3))
    writer.write("a", torch.zeros(2))
    with pytest.raises(IntegrityError, match="never produced"):
        writer.close()


def test_plan_shards_never_splits_and_respects_the_limit() -> None:
    specs = [TensorSpec(f"t{i}", torch.float32, (n,)) for i, n in enumerate([10, 10, 50, 5, 5])]
    shards = plan_shards(specs, shard_bytes=80)
    assert [[s.name for s in shard] for shard in shards] == [
        ["t0", "t1"], ["t2"], ["t3", "t4"]
    ]
    assert hf_shard_names(3)[1] == "model-00002-of-00003.safetensors"
    assert hf_shard_names(1) == ["model.safetensors"]


def test_detect_format(tmp_path: Path) -> None:
    (tmp_path / "a.bin").write_bytes(b"x")
    (tmp_path / "b.safetensors").write_bytes(b"x")
    (tmp_path / "dcp").mkdir()
    (tmp_path / "dcp" / ".metadata").write_bytes(b"x")
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "model.safetensors").write_bytes(b"x")
    assert detect_format(tmp_path / "a.bin") == "pt"
    assert detect_format(tmp_path / "b.safetensors") == "safetensors"
    assert detect_format(tmp_path / "dcp") == "dcp"
    assert detect_format(tmp_path / "hf") == "hf"
    (tmp_path / "c.txt").write_text("x")
    with pytest.raises(InvalidNameError, match="cannot tell the format"):
        detect_format(tmp_path / "c.txt")


def test_staged_output_refuses_overwrite_and_leaves_nothing_on_failure(tmp_path: Path) -> None:
    out = tmp_path / "out.pt"
    out.write_bytes(b"old")
    with pytest.raises(ConflictError, match="already exists"), staged_output(out, overwrite=False):
        pass

    def crash_mid_write() -> None:
        with staged_output(out, overwrite=True) as tmp:
            tmp.write_bytes(b"half")
            raise RuntimeError("crash mid-write")

    with pytest.raises(RuntimeError, match="crash"):
        crash_mid_write()
    assert out.read_bytes() == b"old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.pt"]
    with staged_output(out, overwrite=True) as tmp:
        tmp.write_bytes(b"new")
    assert out.read_bytes() == b"new"


def test_malicious_pt_is_refused_even_when_torch_is_told_to_unpickle(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    marker = tmp_path / "pwned"
    path = tmp_path / "evil.pt"
    torch.save({"w": torch.ones(2), "payload": Evil(marker)}, path)
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    with pytest.raises(UnsafeObjectError, match="arbitrary unpickling"):
        load_pt(path)
    assert not marker.exists()


def test_tampered_safetensors_skeleton_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "x.safetensors"
    bad_tree = {"t": "dict", "k": ["w"], "v": [{"t": "tensor", "key": "missing"}]}
    specs = [TensorSpec("w", torch.float32, (2,))]
    with SafetensorsFileWriter(path, specs, {"ckptstore": json.dumps({"tree": bad_tree})}) as w:
        w.write("w", torch.ones(2))
    with pytest.raises(IntegrityError, match="skeleton is malformed"):
        read_source(path)


def test_malicious_dcp_metadata_is_refused(tmp_path: Path) -> None:
    folder = tmp_path / "dcp"
    dcp.save({"w": torch.ones(2)}, storage_writer=dcp.FileSystemWriter(str(folder)), no_dist=True)
    marker = tmp_path / "pwned"
    (folder / ".metadata").write_bytes(pickle.dumps(Evil(marker)))
    with pytest.raises(UnsafeObjectError, match="not a DCP metadata type"):
        read_dcp(folder)
    assert not marker.exists()


def test_malicious_dcp_item_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    folder = tmp_path / "dcp"
    marker = tmp_path / "pwned"
    state = {"w": torch.ones(2), "payload": Evil(marker)}
    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(folder)), no_dist=True)
    assert not marker.exists()
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    with pytest.raises(UnsafeObjectError, match="payload"):
        read_dcp(folder)
    assert not marker.exists()


def test_read_dcp_rebuilds_the_nesting(tmp_path: Path) -> None:
    state = training_state()
    folder = tmp_path / "dcp"
    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(folder)), no_dist=True)
    loaded = read_dcp(folder)
    # DCP records dict keys as strings: the optimizer's int keys come back as "0", "1".
    expected = dict(state)
    expected["optimizer"] = {
        "state": {str(k): v for k, v in state["optimizer"]["state"].items()},
        "param_groups": state["optimizer"]["param_groups"],
    }
    expected["scheduler"] = dict(state["scheduler"])
    loaded["scheduler"] = dict(loaded["scheduler"])
    assert_same(loaded, expected)


# --------------------------------------------------------------------------- store round trips
def test_pt_round_trip_through_the_store(store: CheckpointStore, tmp_path: Path) -> None:
    state = training_state(extended=True)
    src = tmp_path / "in.pt"
    torch.save(state, src)
    ck = import_checkpoint(store, src, run="imp", step=5, metrics={"loss": 1.5}, tags=("x",))
    assert (ck.step, ck.metrics, ck.tags) == (5, {"loss": 1.5}, ("x",))
    assert_same(store.load(ck.ref), state)
    out = export_checkpoint(store, ck.ref, "pt", tmp_path / "out.pt")
    assert_same(torch.load(out, weights_only=True), state)
    kinds = [e.kind for e in store.events(ck.ref)]
    assert "imported" in kinds and "converted" in kinds
    converted = next(e for e in store.events(ck.ref) if e.kind == "converted")
    assert converted.detail["fmt"] == "pt" and converted.detail["path"].endswith("out.pt")


def test_import_refuses_malicious_pt_and_saves_nothing(
    store: CheckpointStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    marker = tmp_path / "pwned"
    path = tmp_path / "evil.bin"
    torch.save({"w": torch.ones(2), "payload": Evil(marker)}, path)
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    with pytest.raises(UnsafeObjectError):
        import_checkpoint(store, path, run="evil", step=1)
    assert not marker.exists()
    assert "evil" not in [r.name for r in store.runs()]


def test_export_refuses_to_overwrite(store: CheckpointStore, tmp_path: Path) -> None:
    ck = store.save("r", 1, {"w": torch.ones(3)})
    out = tmp_path / "w.safetensors"
    out.write_bytes(b"keep me")
    with pytest.raises(ConflictError, match="overwrite"):
        export_checkpoint(store, ck.ref, "safetensors", out)
    assert out.read_bytes() == b"keep me"
    export_checkpoint(store, ck.ref, "safetensors", out, overwrite=True)
    assert_same(load_file(out), {"w": torch.ones(3)})


def test_safetensors_export_loads_with_safetensors_and_round_trips(
    store: CheckpointStore, tmp_path: Path
) -> None:
    state = training_state()
    ck = store.save("st", 1, state)
    seen: list[int] = []
    out = export_checkpoint(store, ck.ref, "safetensors", tmp_path / "s.safetensors",
                            progress=seen.append)
    loaded = load_file(out)
    assert_same(loaded["model/enc.weight"], state["model"]["enc.weight"])
    assert_same(loaded["optimizer/state/0/exp_avg"], state["optimizer"]["state"][0]["exp_avg"])
    assert len(loaded) == len(store.manifest(ck.ref).tensors)
    assert sum(seen) == sum(t.nbytes for t in loaded.values())
    # The skeleton in __metadata__ brings back the exact state, non-tensor values included.
    back = import_checkpoint(store, out, run="st2", step=1)
    assert_same(store.load(back.ref), state)
    # keys select without renaming.
    part = export_checkpoint(store, ck.ref, "safetensors", tmp_path / "m.safetensors",
                             keys=["model/*"])
    assert set(load_file(part)) == {f"model/{k}" for k in state["model"]}
    with pytest.raises(InvalidNameError, match="match nothing"):
        export_checkpoint(store, ck.ref, "safetensors", tmp_path / "n.safetensors",
                          keys=["nope/*"])


def test_hf_export_sharded_with_index_and_config(store: CheckpointStore, tmp_path: Path) -> None:
    state = training_state()
    store.run("hf", config={"model_type": "toy", "hidden_size": 32})
    ck = store.save("hf", 1, state)
    out = export_checkpoint(store, ck.ref, "hf", tmp_path / "hf", shard_bytes=4096)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) >= 2 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    assert sorted(p.name for p in out.glob("*.safetensors")) == files
    merged: dict[str, torch.Tensor] = {}
    for name in files:
        merged.update(load_file(out / name))
    assert set(merged) == set(index["weight_map"]) == set(state["model"])
    for key, tensor in state["model"].items():
        assert_same(merged[key], tensor, key)
    assert index["metadata"]["total_size"] == sum(t.nbytes for t in merged.values())
    assert json.loads((out / "config.json").read_text())["hidden_size"] == 32
    # And back: weights under "model", config into the new run.
    back = import_checkpoint(store, out, run="hf-back", step=2)
    assert_same(store.load(back.ref), {"model": state["model"]})  # model order kept
    assert store.catalog.get_run("hf-back").config["model_type"] == "toy"


def test_hf_export_single_file(store: CheckpointStore, tmp_path: Path) -> None:
    ck = store.save("one", 1, {"w": torch.ones(2), "b": torch.zeros(1)})
    out = export_checkpoint(store, ck.ref, "hf", tmp_path / "hf")
    assert sorted(p.name for p in out.iterdir()) == ["model.safetensors"]
    assert_same(load_file(out / "model.safetensors"), {"w": torch.ones(2), "b": torch.zeros(1)})


def test_dcp_export_loads_with_dcp(
    store: CheckpointStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Small data files, so the export spreads over several (as big states do).
    monkeypatch.setattr("ckptstore.convert.dcp_write.DCP_FILE_BYTES", 4096)
    state = training_state()
    state["tied"] = state["model"]["enc.weight"]  # the same tensor twice
    state["pair"] = (1, torch.ones(2))             # a tensor inside a DCP "bytes" item
    ck = store.save("d", 1, state)
    out = export_checkpoint(store, ck.ref, "dcp", tmp_path / "dcp")
    assert len(list(out.glob("*.distcp"))) > 1
    template = store.load(ck.ref)
    zeroed = _zeros_like(template)
    dcp.load(zeroed, storage_reader=dcp.FileSystemReader(str(out)), no_dist=True)
    assert_same(zeroed, template)


def _zeros_like(state: Any) -> Any:
    if isinstance(state, torch.Tensor):
        return torch.zeros_like(state)
    if isinstance(state, dict):
        return type(state)((k, _zeros_like(v)) for k, v in state.items())
    if isinstance(state, list):
        return [_zeros_like(v) for v in state]
    return state


def test_dcp_import(store: CheckpointStore, tmp_path: Path) -> None:
    state = {"model": model_weights(), "step": 7, "extra": {"lr": [0.1, 0.2]}}
    folder = tmp_path / "dcp"
    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(folder)), no_dist=True)
    ck = import_checkpoint(store, folder, run="dimp", step=7)
    assert_same(store.load(ck.ref), state)
    assert next(e for e in store.events(ck.ref) if e.kind == "imported").detail["fmt"] == "dcp"


def test_convert_checkpoint_to_another_codec(store: CheckpointStore) -> None:
    state = training_state()
    src = store.save("c", 4, state, metrics={"loss": 2.0}, codec="lz4")
    new = convert_checkpoint(store, src.ref, codec="none")
    assert (new.run, new.step, new.version, new.codec) == ("c", 4, 2, "none")
    assert new.metrics == {"loss": 2.0}
    assert_same(store.load(new.ref), state)
    assert (src.id, new.id, "converted-from") in store.catalog.edges(new.id)
    # Running it again (a retried flow) returns the same checkpoint, writes nothing.
    assert convert_checkpoint(store, src.ref, codec="none").id == new.id
    assert convert_checkpoint(store, new.ref, codec="none").id == new.id
    assert len(store.list(run="c")) == 2


# --------------------------------------------------------------------------- directories
def test_convert_directory_without_a_store(tmp_path: Path) -> None:
    src = tmp_path / "in"
    src.mkdir()
    state = training_state()
    torch.save(state, src / "a.pt")
    torch.save(model_weights(), src / "b.bin")
    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(src / "c")), no_dist=True)
    (src / "notes.txt").write_text("ignored")

    to_st = convert_directory(src, tmp_path / "st", "safetensors")
    assert [p.name for p in to_st] == ["a.safetensors", "b.safetensors", "c.safetensors"]
    assert_same(read_source(to_st[0]).state, state)      # skeleton restores the nesting
    assert_same(load_file(to_st[1]), model_weights())

    to_pt = convert_directory(tmp_path / "st", tmp_path / "pt", "pytorch")
    assert_same(torch.load(to_pt[0], weights_only=True), state)

    one = convert_directory(src / "c", tmp_path / "from-dcp", "pytorch")
    assert [p.name for p in one] == ["c.pt"]
    assert_same(torch.load(one[0], weights_only=True)["model"], state["model"])

    hf = convert_directory(src, tmp_path / "hf", "hf", shard_bytes=2048)
    assert (hf[0] / "model.safetensors.index.json").is_file()
    with pytest.raises(ConflictError):
        convert_directory(src, tmp_path / "hf", "hf")
    with pytest.raises(InvalidNameError, match="unknown format"):
        convert_directory(src, tmp_path / "x", "onnx")


def test_hf_bin_shards_import_and_directory_conversion(
    store: CheckpointStore, tmp_path: Path
) -> None:
    weights = model_weights()
    names = list(weights)
    folder = tmp_path / "models" / "old-hf"
    folder.mkdir(parents=True)
    half = len(names) // 2
    shards = {"pytorch_model-00001-of-00002.bin": names[:half],
              "pytorch_model-00002-of-00002.bin": names[half:]}
    for fname, part in shards.items():
        torch.save({k: weights[k] for k in part}, folder / fname)
    index = {"metadata": {}, "weight_map": {k: f for f, part in shards.items() for k in part}}
    (folder / "pytorch_model.bin.index.json").write_text(json.dumps(index))
    (folder / "config.json").write_text(json.dumps({"model_type": "toy"}))
    ck = import_checkpoint(store, folder, run="old", step=0)
    assert_same(store.load(ck.ref), {"model": weights})
    # Without a store: the folder is one source; pytorch gives a plain state_dict.
    [out] = convert_directory(tmp_path / "models", tmp_path / "pt", "pytorch")
    assert out.name == "old-hf.pt"
    assert_same(torch.load(out, weights_only=True), weights)
    # An index pointing outside the folder is refused.
    index["weight_map"]["enc.weight"] = "../../etc/passwd"
    (folder / "pytorch_model.bin.index.json").write_text(json.dumps(index))
    with pytest.raises(IntegrityError, match="outside the model folder"):
        import_checkpoint(store, folder, run="old", step=1)


# --------------------------------------------------------------------------- memory bound
_RSS_SCRIPT = textwrap.dedent(
    """
    import json, sys
    from pathlib import Path
    from ckptstore import CheckpointStore
    from ckptstore.ops.upkeep.convert import export_checkpoint

    def status(field):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
        raise SystemExit("no " + field)

    root, out_dir = Path(sys.argv[1]), Path(sys.argv[2])
    store = CheckpointStore.open(root)
    ref = store.latest("big").ref
    store.manifest(ref)
    figures = {}
    for fmt in sys.argv[3:]:
        base = status("VmRSS")
        try:  # reset the high-water mark to the current RSS (Linux >= 4.0)
            Path("/proc/self/clear_refs").write_text("5")
        except OSError:
            raise SystemExit("no-reset")
        export_checkpoint(store, ref, fmt, out_dir / fmt)
        figures[fmt] = status("VmHWM") - base
    print(json.dumps(figures))
    """
)


def test_streaming_export_memory_is_bounded(store: CheckpointStore, tmp_path: Path) -> None:
    """~200 MB state, largest tensor 32 MiB: each streaming export adds < 100 MiB of RSS."""
    largest = 32 * 2**20
    state = {"model": {f"layer{i}": torch.randn(largest // 4 // (1 + i % 4)) for i in range(12)}}
    total = sum(t.nbytes for t in state["model"].values())
    assert 150 * 2**20 < total < 260 * 2**20
    store.save("big", 1, state, codec="none")
    del state
    fmts = ["safetensors", "hf", "dcp"]
    proc = subprocess.run(
        [sys.executable, "-c", _RSS_SCRIPT, str(store.settings.root), str(tmp_path), *fmts],
        capture_output=True, text=True, timeout=240, check=False,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    if proc.returncode != 0 and "no-reset" in proc.stderr:
        pytest.skip("cannot reset VmHWM on this kernel")
    assert proc.returncode == 0, proc.stderr[-2000:]
    extra = json.loads(proc.stdout.strip().splitlines()[-1])
    for fmt in fmts:
        out = tmp_path / fmt
        written = sum(p.stat().st_size for p in [out, *out.rglob("*")] if p.is_file())
        assert written > total
        assert extra[fmt] < 100 * 2**20, f"{fmt}: {extra[fmt] >> 20} MiB extra for {total >> 20}"
