"""Pure geometry and index logic of the DCP layout (no I/O, no process group)."""

from __future__ import annotations

import copy
import math
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import (
    SavePlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)

from ckptstore.errors import CkptError, IntegrityError, UnsafeObjectError
from ckptstore.format.dcp.layout import (
    ArrayInfo,
    DcpIndex,
    Piece,
    TensorItem,
    array_path,
    chunk_file,
    chunks_of_piece,
    escape_fqn,
    grid_pitch,
    refine_chunk_shape,
)
from ckptstore.format.dcp.plan import assign_slots


@pytest.mark.parametrize(
    ("fqn", "name"),
    [
        ("model.layers.0.weight", "model.layers.0.weight"),
        ("a/b", "a%2Fb"),
        ("50%", "50%25"),
        ("__x", "%5F_x"),
        ("..", "%2E%2E"),
        ("", "%"),
        ("é", "%C3%A9"),
    ],
)
def test_escape_fqn(fqn: str, name: str) -> None:
    assert escape_fqn(fqn) == name


def test_long_names_are_bounded_and_distinct() -> None:
    a, b = "x" * 300 + "a", "x" * 300 + "b"
    assert escape_fqn(a) != escape_fqn(b)
    assert len(escape_fqn(a)) < 200
    assert array_path("w", 3) == "dcp/w@3"
    assert chunk_file("dcp/w", "1.0") == "dcp/w/c.1.0"
    assert chunk_file("dcp/s", "") == "dcp/s/c"


def test_grid_pitch_accepts_torch_chunk_shards_and_rejects_nested_ones() -> None:
    # torch.chunk(10, 4) -> 3, 3, 3, 1 (DTensor Shard semantics)
    boxes = [((0, 0), (3, 5)), ((3, 0), (3, 5)), ((6, 0), (3, 5)), ((9, 0), (1, 5))]
    assert grid_pitch((10, 5), boxes) == (3, 5)
    # Shard(1) over 2 ranks
    assert grid_pitch((4, 7), [((0, 0), (4, 4)), ((0, 4), (4, 3))]) == (4, 4)
    # nested sharding of dim 0: 10 -> 5 + 5 -> (3, 2) + (3, 2)
    nested = [((0,), (3,)), ((3,), (2,)), ((5,), (3,)), ((8,), (2,))]
    assert grid_pitch((10,), nested) is None
    assert grid_pitch((3,), []) is None


def test_refine_keeps_chunks_inside_shards() -> None:
    # GPT-2's token embedding sharded over 2 ranks: 25129 rows = 13 x 1933
    chunk = refine_chunk_shape((25129, 768), 4, 8 * 2**20)
    assert chunk == (1933, 768)
    assert 25129 % chunk[0] == 0
    assert refine_chunk_shape((10, 10), 4, 8 * 2**20) == (10, 10)
    # a prime first dimension cannot be split: the next dimension is
    chunk = refine_chunk_shape((7, 1 << 20), 4, 2**20)
    assert 7 % chunk[0] == 0 and (1 << 20) % chunk[1] == 0
    assert math.prod(chunk) * 4 <= 2 * 2**20


def test_chunks_of_piece() -> None:
    coords = list(chunks_of_piece((0, 0), (2, 3), (4, 0), (3, 6)))
    assert coords == [(2, 0), (2, 1), (3, 0), (3, 1)]
    assert list(chunks_of_piece((), (), (), ())) == [()]
    assert list(chunks_of_piece((0,), (4,), (0,), (0,))) == []


def _item(fqn: str, offsets: tuple[int, ...], sizes: tuple[int, ...], shape: tuple[int, ...],
          dtype: torch.dtype = torch.float32) -> WriteItem:
    return WriteItem(
        index=MetadataIndex(fqn, offsets),
        type=WriteItemType.SHARD,
        tensor_data=TensorWriteData(
            chunk=ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes)),
            properties=TensorProperties(dtype=dtype),
            size=torch.Size(shape),
        ),
    )


def test_assign_slots_grid_pack_and_irregular() -> None:
    # "odd" is split 200000 + 300000: no regular grid, so one array per shard.
    plans = [
        SavePlan([_item("big", (0, 0), (600, 512), (1200, 512)), _item("tiny", (0,), (5,), (10,)),
                  _item("odd", (0,), (200000,), (500000,))]),
        SavePlan([_item("big", (600, 0), (600, 512), (1200, 512)), _item("tiny", (5,), (5,), (10,)),
                  _item("odd", (200000,), (300000,), (500000,))]),
    ]
    slots, arrays = assign_slots(plans, chunk_bytes=2**20, pack_below=2**19)
    big0 = slots[0][("big", (0, 0))]
    big1 = slots[1][("big", (600, 0))]
    assert big0.array == big1.array and big0.array.shape == (1200, 512)
    assert big0.write_meta and not big1.write_meta
    assert 600 % big0.array.chunk_shape[0] == 0
    assert ("tiny", (0,)) not in slots[0]  # packed
    odd = [s for rank in slots for key, s in rank.items() if key[0] == "odd"]
    assert {s.array.path for s in odd} == {"dcp/odd@0", "dcp/odd@1"}
    assert all(s.write_meta for s in odd)
    assert set(arrays) == {"dcp/big", "dcp/odd@0", "dcp/odd@1"}


def test_assign_slots_refuses_duplicates_and_unknown_dtypes() -> None:
    dup = [SavePlan([_item("w", (0,), (10,), (10,))]), SavePlan([_item("w", (0,), (10,), (10,))])]
    with pytest.raises(CkptError, match="deduplicates"):
        assign_slots(dup, chunk_bytes=2**20, pack_below=1)
    bad = [SavePlan([_item("q", (0,), (4,), (4,), dtype=torch.qint8)])]
    with pytest.raises(UnsafeObjectError, match="'q'"):
        assign_slots(bad, chunk_bytes=2**20, pack_below=1)


def _index() -> DcpIndex:
    grid = ArrayInfo("dcp/w", "float32", (4, 3), (2, 3), {"0.0": (28, 1), "1.0": (28, 2)})
    pack = ArrayInfo("dcp_packs/r0.bfloat16", "bfloat16", (6,), (6,), {"0": (16, 3)})
    blobs = ArrayInfo("dcp_packs/r0.bytes", "uint8", (9,), (9,), {"0": (13, 4)})
    w = TensorItem("w", "float32", (4, 3), False, (
        Piece((0, 0), (2, 3), "dcp/w", (0, 0), None), Piece((2, 0), (2, 3), "dcp/w", (0, 0), None),
    ))
    b = TensorItem("b", "bfloat16", (6,), True, (Piece((0,), (6,), pack.path, None, 0),))
    from ckptstore.format.dcp.layout import BlobItem

    return DcpIndex(
        world_size=2, codec="none",
        arrays={a.path: a for a in (grid, pack, blobs)},
        tensors={"w": w, "b": b},
        blobs={"step": BlobItem("step", blobs.path, 0, 9)},
        planner_data={"w": ("model", "w"), "b": ("b",), "step": ("meta", 0)},
        dcp_version="1.0.0",
    )


def test_index_round_trips() -> None:
    index = _index()
    # Version 2 (format 2 manifests): the tensors travel in the manifest's tensors list.
    doc = index.to_json()
    assert "tensors" not in doc
    entries = index.tensor_entries()
    assert [e["key"] for e in entries] == ["w", "b"] and entries[0]["numel"] == 12
    again = DcpIndex.from_json(doc, entries)
    assert again.to_json() == doc and again.tensor_entries() == entries
    # Version 1 (format 1 manifests) kept them inside the index; still read.
    assert DcpIndex.from_json(index.to_json(1)).to_json(1) == index.to_json(1)
    with pytest.raises(IntegrityError, match="not supported"):
        DcpIndex.from_json(index.to_json(1), entries)
    with pytest.raises(IntegrityError, match="not supported"):
        DcpIndex.from_json(doc)
    assert index.logical_bytes == 4 * 3 * 4 + 6 * 2 + 9
    assert index.stored_bytes == 28 + 28 + 16 + 13
    assert {f for f, _, _ in index.files()} == {
        "dcp/w/c.0.0", "dcp/w/c.1.0", "dcp_packs/r0.bfloat16/c.0", "dcp_packs/r0.bytes/c.0",
    }


def _broken(change: Any) -> dict[str, Any]:
    doc = copy.deepcopy(_index().to_json(1))
    change(doc)
    return doc


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda d: d["arrays"]["dcp/w"]["chunks"].pop("1.0"), "missing"),
        (lambda d: d["tensors"]["w"]["pieces"].pop(), "do not cover"),
        (lambda d: d["arrays"].update({"../etc": d["arrays"].pop("dcp/w")}), "not allowed"),
        (lambda d: d["arrays"]["dcp/w"]["chunks"].update({"9.0": [28, 1]}), "outside"),
        (lambda d: d["arrays"]["dcp/w"]["chunks"].update({"0.0": [10**9, 1]}), "size"),
        (lambda d: d["tensors"]["b"]["pieces"][0].update({"at": 3}), "outside its pack"),
        (lambda d: d["tensors"]["w"].update({"dtype": "float16"}), "dtype differs"),
        (lambda d: d["blobs"]["step"].update({"nbytes": 99}), "outside its pack"),
        (lambda d: d.update({"codec": "gzip"}), "codec"),
        (lambda d: d["planner_data"].update({"w": [1.5]}), "planner_data"),
        (lambda d: d["tensors"].update({"step": d["tensors"]["w"]}), "both"),
    ],
)
def test_index_validation_rejects_damage(change: Any, message: str) -> None:
    with pytest.raises(IntegrityError, match=message):
        DcpIndex.from_json(_broken(change))
