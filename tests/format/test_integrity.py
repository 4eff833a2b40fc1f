"""Damaged checkpoints are detected and named; hostile manifests are rejected quickly."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from ckptstore.errors import (
    CheckpointNotFoundError,
    IncompleteCheckpointError,
    IntegrityError,
    InvalidNameError,
)
from ckptstore.format import read_checkpoint, read_manifest, verify_checkpoint
from ckptstore.format.manifest import Manifest, manifest_digest


def _state() -> dict[str, Any]:
    torch.manual_seed(0)
    return {"model": {"w": torch.randn(1000), "v": torch.randn(500)}, "step": 3}


def _first_chunk(directory: Path) -> Path:
    return directory / "float32" / "c" / "0"


@pytest.mark.parametrize("codec", ["none", "lz4"])
@pytest.mark.parametrize("damage", ["flip", "truncate", "delete", "trailer", "swap"])
def test_damaged_chunk_raises_naming_tensor_and_chunk(save: Any, codec: str, damage: str) -> None:
    directory, manifest = save(_state(), codec=codec, chunk_bytes=1024)
    chunk = _first_chunk(directory)
    data = bytearray(chunk.read_bytes())
    if damage == "flip":
        data[len(data) // 2] ^= 0x10
        chunk.write_bytes(bytes(data))
    elif damage == "truncate":
        chunk.write_bytes(bytes(data[:-10]))
    elif damage == "delete":
        chunk.unlink()
    elif damage == "trailer":
        data[-1] ^= 0x01
        chunk.write_bytes(bytes(data))
    else:  # another intact chunk file put in its place: crc is self-consistent, manifest is not
        other = directory / "float32" / "c" / "1"
        if other.stat().st_size != chunk.stat().st_size:
            pytest.skip("compressed chunks differ in size; covered by truncate")
        chunk.write_bytes(other.read_bytes())
    with pytest.raises(IntegrityError) as info:
        read_checkpoint(directory, manifest)
    message = str(info.value)
    assert "model/w" in message and "float32" in message and str(chunk) in message
    assert manifest.id in message
    problems = verify_checkpoint(directory, manifest)
    assert len(problems) == 1 and "model/w" in problems[0] and "float32/c/0" in problems[0]
    if damage in ("truncate", "delete"):
        assert verify_checkpoint(directory, manifest, deep=False)


def test_intact_checkpoint_verifies_clean(save: Any) -> None:
    directory, manifest = save(_state(), chunk_bytes=1024)
    assert verify_checkpoint(directory, manifest) == []
    assert verify_checkpoint(directory, manifest, deep=False) == []


def test_damage_outside_selected_keys_is_not_read(save: Any) -> None:
    directory, manifest = save(_state(), codec="none", chunk_bytes=1024)
    _first_chunk(directory).unlink()  # holds model/w only
    out = read_checkpoint(directory, manifest, keys=["model/v"])
    assert set(out["model"]) == {"v"}


def test_missing_marker_is_incomplete(save: Any) -> None:
    directory, _ = save(_state())
    (directory / "COMMITTED").unlink()
    with pytest.raises(IncompleteCheckpointError):
        read_manifest(directory)


def test_missing_directory_is_not_found(tmp_path: Path) -> None:
    with pytest.raises(CheckpointNotFoundError):
        read_manifest(tmp_path / "nope")


def test_modified_or_missing_manifest_is_an_integrity_error(save: Any) -> None:
    directory, _manifest = save(_state())
    path = directory / "manifest.json"
    data = path.read_bytes()
    path.write_bytes(data.replace(b'"step":0', b'"step":1'))
    with pytest.raises(IntegrityError, match="digest"):
        read_manifest(directory)
    path.unlink()
    with pytest.raises(IntegrityError, match="missing"):
        read_manifest(directory)


def test_marker_must_hold_a_digest_and_match_expected(save: Any) -> None:
    directory, manifest = save(_state())
    assert read_manifest(directory, expected_digest=manifest.digest).digest == manifest.digest
    with pytest.raises(IntegrityError, match="expected"):
        read_manifest(directory, expected_digest="0" * 64)
    (directory / "COMMITTED").write_text("garbage")
    with pytest.raises(IntegrityError):
        read_manifest(directory)


# -- hostile manifests ---------------------------------------------------------------------


def _plant(directory: Path, doc: Any) -> None:
    data = json.dumps(doc).encode() if not isinstance(doc, bytes) else doc
    (directory / "manifest.json").write_bytes(data)
    (directory / "COMMITTED").write_text(manifest_digest(data) + "\n")


def _doc(manifest: Manifest) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads(manifest.to_json())
    return doc


def _deep_tree(depth: int) -> Any:
    node: Any = 1
    for _ in range(depth):
        node = {"t": "list", "v": [node]}
    return node


HOSTILE = {
    "negative shape": lambda d: d["tensors"][0].update(shape=[-1, -1000], numel=1000),
    "overflowing shape": lambda d: d["tensors"][0].update(shape=[2**40, 2**40], numel=2**80),
    "offset outside": lambda d: d["tensors"][0].update(offset=10**9),
    "unknown dtype": lambda d: d["arrays"]["float32"].update(torch_dtype="float128"),
    "tensor dtype": lambda d: d["tensors"][0].update(torch_dtype="int64"),
    "codec": lambda d: d.update(codec="pickle"),
    "array codec": lambda d: d["arrays"]["float32"].update(codec="gzip"),
    "array name slash": lambda d: d["arrays"].update({"../x": d["arrays"].pop("float32")}),
    "array name dots": lambda d: d["arrays"].update({"..": d["arrays"].pop("float32")}),
    "src not uuid": lambda d: d["arrays"]["float32"]["chunks"][0].update(src="../../etc"),
    "deep tree": lambda d: d.update(tree=_deep_tree(100)),
    "unknown tree tag": lambda d: d.update(tree={"t": "pickle", "v": "x"}),
    "dangling tensor ref": lambda d: d.update(tree={"t": "tensor", "key": "nope"}),
    "huge chunk": lambda d: d["arrays"]["float32"].update(chunk_len=2**40),
    "chunk count": lambda d: d["arrays"]["float32"]["chunks"].pop(),
    "bool as int": lambda d: d.update(step=True),
    "format version": lambda d: d.update(format_version=99),
    "extra field": lambda d: d.update(evil=1),
    "missing field": lambda d: d.pop("tree"),
    "id": lambda d: d.update(id="not-a-uuid"),
    "nbytes": lambda d: d["arrays"]["float32"]["chunks"][0].update(nbytes=10**15),
    "crc": lambda d: d["arrays"]["float32"]["chunks"][0].update(crc32c=-1),
    "blake3": lambda d: d["arrays"]["float32"]["chunks"][0].update(blake3="zz"),
    "duplicate tensor": lambda d: d["tensors"].append(d["tensors"][0]),
    "chunk range": lambda d: d["tensors"][0].update(chunk_stop=99),
    "delta without src": lambda d: d.update(kind="delta", base_id=d["id"]),
}


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_hostile_manifest_is_rejected(save: Any, name: str) -> None:
    directory, manifest = save(_state(), chunk_bytes=1024)
    doc = _doc(manifest)
    HOSTILE[name](doc)
    _plant(directory, doc)
    with pytest.raises(IntegrityError):
        read_manifest(directory)


@pytest.mark.parametrize(
    "data",
    [b"[" * 200_000 + b"]" * 200_000, b'{"a":1,"a":2}', b"\xff\xfe", b"NaN", b"{" * 10],
    ids=["deep json", "duplicate keys", "not utf8", "nan", "truncated"],
)
def test_malformed_json_is_an_integrity_error(save: Any, data: bytes) -> None:
    directory, _ = save(_state())
    _plant(directory, data)
    with pytest.raises(IntegrityError):
        read_manifest(directory)


def test_too_many_tensors_is_rejected(save: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    import ckptstore.format.manifest.parse as manifest_module

    directory, manifest = save({f"t{i}": torch.zeros(1) for i in range(11)})
    monkeypatch.setattr(manifest_module, "MAX_TENSORS", 10)
    _plant(directory, _doc(manifest))
    with pytest.raises(IntegrityError, match="tensors"):
        read_manifest(directory)


def test_oversized_manifest_is_rejected_before_reading(
    save: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    import ckptstore.format.committed as committed_module

    directory, _ = save(_state())
    path = directory / "manifest.json"
    path.unlink()
    with open(path, "wb") as fh:
        fh.truncate(257 * 1024 * 1024)  # sparse: costs no disk

    real_fdopen = os.fdopen

    def no_manifest_read(fd: int, *args: Any, **kwargs: Any) -> Any:
        if os.readlink(f"/proc/self/fd/{fd}") == str(path):
            raise AssertionError("the manifest was read before its size was checked")
        return real_fdopen(fd, *args, **kwargs)

    with monkeypatch.context() as patch:
        patch.setattr(committed_module.os, "fdopen", no_manifest_read)
        with pytest.raises(IntegrityError, match="limit"):
            read_manifest(directory)
    os.unlink(path)


def test_unknown_key_pattern_is_refused(save: Any) -> None:
    directory, manifest = save(_state())
    with pytest.raises(InvalidNameError, match="nothing") as info:
        read_checkpoint(directory, manifest, keys=["model/*", "optim*"])
    assert "optim*" in str(info.value) and "model/w" in str(info.value)
