"""Units: chunk geometry, key escaping and matching, manifest JSON and API."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
import torch

from ckptstore.format import FORMAT_VERSION, Manifest, chunk_files
from ckptstore.format.keys import escape_component, key_matches
from ckptstore.format.layout import balanced_chunk_len, chunk_span, plan_layout


@pytest.mark.parametrize(
    ("length", "itemsize", "chunk_bytes"),
    [
        (1, 4, 16),
        (10, 4, 16),
        (1000, 4, 1024),
        (2**20 + 3, 4, 8 << 20),
        (12345, 2, 4096),
        (999_999, 8, 1 << 20),
        (7, 16, 16),
    ],
)
def test_balanced_chunks_waste_less_than_one_element_per_chunk(
    length: int, itemsize: int, chunk_bytes: int
) -> None:
    chunk_len = balanced_chunk_len(length, itemsize, chunk_bytes)
    n_chunks = math.ceil(length / chunk_len)
    assert n_chunks == math.ceil(length * itemsize / chunk_bytes)
    assert n_chunks * chunk_len - length < n_chunks
    assert chunk_len * itemsize <= chunk_bytes + itemsize


def test_empty_array_has_chunk_len_one_and_no_chunks() -> None:
    assert balanced_chunk_len(0, 4, 1024) == 1
    assert chunk_span(0, 0, 1) == (0, 0)


def test_chunk_members_cover_each_chunk_exactly() -> None:
    tensors = {f"t{i}": torch.zeros(n) for i, n in enumerate([5, 0, 17, 1, 0, 40, 3])}
    plan = plan_layout(tensors, chunk_bytes=32)["float32"]
    covered = 0
    for index in range(plan.n_chunks):
        members = list(plan.chunk_members(index))
        assert all(m.numel for m, _, _ in members)
        covered += sum(stop - first for _, first, stop in members)
    assert covered == plan.length == 66


def test_key_escaping() -> None:
    assert escape_component("a/b%c") == "a%2Fb%25c"
    assert escape_component(3) == "3"
    assert escape_component(None) == "None"
    assert escape_component(10**5000).startswith("0x")


@pytest.mark.parametrize(
    ("key", "patterns", "hit"),
    [
        ("model/enc.w", ["model/*"], True),
        ("model/enc.w", ["model"], True),
        ("model/enc.w", ["mod"], False),
        ("model/enc.w", ["*enc*"], True),
        ("optimizer/state/0/exp_avg", ["optimizer/state/?"], True),
        ("a%2Fb", ["a/*"], False),
        ("Model/x", ["model/*"], False),
    ],
)
def test_key_matching(key: str, patterns: list[str], hit: bool) -> None:
    assert key_matches(key, patterns) is hit


def test_manifest_json_is_canonical_and_digest_stable(save: Any) -> None:
    directory, manifest = save(
        {"b": torch.ones(2), "a": {"z": 1, "y": float("nan")}},
        extra={"loss": float("nan"), "k": [1, 2]},
    )
    data = manifest.to_json()
    assert data == (directory / "manifest.json").read_bytes()
    assert Manifest.from_json(data).to_json() == data
    assert manifest.digest == (directory / "COMMITTED").read_text().strip()
    doc = json.loads(data)
    assert list(doc) == sorted(doc)
    assert doc["format_version"] == FORMAT_VERSION
    assert [t["key"] for t in doc["tensors"]] == ["b"]
    assert math.isnan(manifest.extra["loss"])
    assert manifest.tensor_keys() == ["b"]
    assert manifest.referenced_checkpoints() == set()
    t = manifest.tensors["b"]
    assert (t.array, t.offset, t.numel, t.shape, t.torch_dtype) == (
        "float32",
        0,
        2,
        (2,),
        "float32",
    )


def test_chunk_files_lists_owned_files_marker_last(save: Any) -> None:
    directory, manifest = save({"w": torch.ones(1000), "i": torch.arange(3)}, chunk_bytes=1024)
    files = chunk_files(manifest)
    on_disk = sorted(str(p.relative_to(directory)) for p in directory.rglob("*") if p.is_file())
    assert sorted(files) == on_disk
    assert files[-3:] == ["zarr.json", "manifest.json", "COMMITTED"]


def test_extra_must_be_json(save: Any) -> None:
    from ckptstore.errors import UnsafeObjectError

    with pytest.raises(UnsafeObjectError):
        save({}, extra={"f": object()})
