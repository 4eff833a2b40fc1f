"""Flatten rules: key naming, supported values, refusals, tied tensors."""

from __future__ import annotations

import math
import struct
from collections import OrderedDict, defaultdict, namedtuple
from enum import IntEnum
from typing import Any

import numpy as np
import pytest
import torch

from ckptstore.errors import InvalidNameError, UnsafeObjectError
from ckptstore.format import flatten_state, read_checkpoint, unflatten_state


def test_key_naming() -> None:
    t = torch.zeros(1)
    state = {
        "model": {"encoder.layer.0.weight": t},
        "optimizer": {"state": {0: {"exp_avg": torch.ones(1)}}},
        "a/b": torch.ones(2),
        "50%": torch.ones(3),
        "list": [torch.ones(4), (torch.ones(5),)],
    }
    keys = list(flatten_state(state).tensors)
    assert keys == [
        "model/encoder.layer.0.weight",
        "optimizer/state/0/exp_avg",
        "a%2Fb",
        "50%25",
        "list/0",
        "list/1/0",
    ]


def test_colliding_keys_are_refused() -> None:
    with pytest.raises(InvalidNameError, match="same key"):
        flatten_state({1: torch.zeros(1), "1": torch.ones(1)})


def _float_bits(x: float) -> bytes:
    return struct.pack(">d", x)


def test_non_tensor_values_round_trip_in_memory_and_on_disk(save: Any) -> None:
    nan = struct.unpack(">d", bytes.fromhex("7ff8000000000123"))[0]
    state = OrderedDict(
        [
            ("none", None),
            ("bools", [True, False]),
            ("ints", [0, -1, 2**63 - 1, -(2**63), 2**64 - 1, 2**64, -(2**200), 10**5000]),
            ("floats", [1.5, -0.0, 0.0, float("inf"), float("-inf"), nan, 1e-310]),
            ("str", "héllo / 50%"),
            ("bytes", b"\x00\xffabc"),
            ("size", torch.Size([2, 3])),
            ("dtype", torch.bfloat16),
            ("device", torch.device("cuda:1")),
            ("tuple", (1, "a", None)),
            ("keys", {7: "int", 2.5: "float", True: "bool", None: "none", "s": "str"}),
            ("np_scalars", [np.float32(1.25), np.int64(-3), np.bool_(True), np.complex64(1j)]),
            ("empty", {"d": {}, "l": [], "t": ()}),
        ]
    )
    directory, manifest = save(state)
    for loaded in (
        unflatten_state(flatten_state(state).tree, {}),
        read_checkpoint(directory, manifest),
    ):
        assert type(loaded) is OrderedDict
        assert list(loaded) == list(state)
        assert loaded["ints"] == state["ints"]
        assert [_float_bits(x) for x in loaded["floats"]] == [
            _float_bits(x) for x in state["floats"]
        ]
        assert loaded["str"] == state["str"] and loaded["bytes"] == state["bytes"]
        assert type(loaded["size"]) is torch.Size and loaded["size"] == state["size"]
        assert loaded["dtype"] is torch.bfloat16
        assert loaded["device"] == torch.device("cuda:1")
        assert loaded["tuple"] == (1, "a", None) and type(loaded["tuple"]) is tuple
        keys = list(loaded["keys"])
        assert keys == [7, 2.5, True, None, "s"]
        assert [type(k) for k in keys] == [int, float, bool, type(None), str]
        for got, want in zip(loaded["np_scalars"], state["np_scalars"], strict=True):
            assert type(got) is type(want) and got == want
        assert loaded["empty"] == {"d": {}, "l": [], "t": ()}
        assert math.isnan(loaded["floats"][5])


def test_ndarrays_are_stored_as_tensors_and_return_as_ndarrays(save: Any) -> None:
    big_endian = np.arange(6, dtype=">i4").reshape(2, 3)
    readonly = np.ones(4)
    readonly.setflags(write=False)
    state = {
        "a": np.arange(12, dtype=np.float32).reshape(3, 4)[:, ::2],
        "be": big_endian,
        "ro": readonly,
        "b": np.array(True),
        "u16": np.arange(3, dtype=np.uint16),
    }
    directory, manifest = save(state)
    out = read_checkpoint(directory, manifest)
    for key, arr in state.items():
        assert isinstance(out[key], np.ndarray)
        assert np.array_equal(out[key], arr) and out[key].shape == arr.shape
        assert out[key].dtype == arr.dtype.newbyteorder("=")


@pytest.mark.parametrize(
    ("state", "path"),
    [
        ({"optimizer": {"state": {0: {"foo": lambda: 1}}}}, "optimizer/state/0/foo"),
        ({"a": [1, {2, 3}]}, "a/1"),
        ({"obj": object()}, "obj"),
        ({"enum": IntEnum("E", "A").A}, "enum"),
        ({"dd": defaultdict(list)}, "dd"),
        ({"nt": namedtuple("P", "x y")(1, 2)}, "nt"),
        ({"sparse": torch.zeros(3).to_sparse()}, "sparse"),
        ({"meta": torch.empty(3, device="meta")}, "meta"),
        ({"objarr": np.array([object()])}, "objarr"),
        ({"key": {(1, 2): 3}}, "key"),
        ({"m": {"x": np.str_("s")}}, "m/x"),
    ],
)
def test_unsafe_objects_are_refused_with_their_path(state: Any, path: str) -> None:
    with pytest.raises(UnsafeObjectError, match=path):
        flatten_state(state)


def test_quantized_and_subclass_tensors_are_refused() -> None:
    q = torch.quantize_per_tensor(torch.randn(3), 0.1, 0, torch.qint8)
    with pytest.raises(UnsafeObjectError, match="quantized"):
        flatten_state({"q": q})

    class Sub(torch.Tensor):
        pass

    with pytest.raises(UnsafeObjectError, match="subclass"):
        flatten_state({"s": torch.zeros(2).as_subclass(Sub)})


def test_a_subclass_hook_stores_its_plain_tensor_in_the_same_walk() -> None:
    class Sub(torch.Tensor):
        pass

    shard = torch.arange(4.0)
    seen: list[str] = []

    def plain(t: torch.Tensor, key: str) -> torch.Tensor:
        seen.append(key)
        return shard if isinstance(t, Sub) else t

    flat = flatten_state({"a": {"s": torch.zeros(4).as_subclass(Sub)}, "b": torch.ones(2)},
                         subclass=plain)
    assert seen == ["a/s"]  # called for the subclass only, with its key
    assert flat.tensors["a/s"] is shard and type(flat.tensors["a/s"]) is torch.Tensor

    class Other(torch.Tensor):
        pass

    # What the hook returns unchanged is refused as without it.
    with pytest.raises(UnsafeObjectError, match="subclass"):
        flatten_state({"o": torch.zeros(1).as_subclass(Other)}, subclass=lambda t, k: t)


def test_self_containing_state_is_refused() -> None:
    loop: list[Any] = []
    loop.append(loop)
    with pytest.raises(UnsafeObjectError, match="nested deeper"):
        flatten_state(loop)


def test_tied_tensors_are_stored_once_and_restored_as_one_object(save: Any) -> None:
    emb = torch.nn.Embedding(10, 4)
    head = torch.nn.Linear(4, 10, bias=False)
    head.weight = emb.weight
    model = torch.nn.ModuleDict({"emb": emb, "head": head})
    sd = model.state_dict()
    assert sd["emb.weight"] is not sd["head.weight"]  # distinct objects sharing memory
    t = torch.randn(3)
    state = {"model": sd, "same": [t, t], "other_view": t[:2]}
    flat = flatten_state(state)
    assert list(flat.tensors) == ["model/emb.weight", "same/0", "other_view"]
    directory, manifest = save(state)
    assert manifest.logical_bytes == (40 + 3 + 2) * 4
    out = read_checkpoint(directory, manifest)
    assert out["model"]["emb.weight"] is out["model"]["head.weight"]
    assert out["same"][0] is out["same"][1]
    assert torch.equal(out["model"]["head.weight"], emb.weight.detach())
    assert torch.equal(out["other_view"], t[:2])
