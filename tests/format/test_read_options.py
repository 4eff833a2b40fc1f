"""Selective loads (keys=), in-place loads (into=), streaming (iter_tensors)."""

from __future__ import annotations

import os
from collections import OrderedDict
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from ckptstore.format import iter_tensors, read_checkpoint


def _state() -> dict[str, Any]:
    torch.manual_seed(0)
    return {
        "model": OrderedDict(
            [("enc.w", torch.randn(2000)), ("enc.b", torch.randn(10)), ("dec.w", torch.randn(2000))]
        ),
        "optimizer": {
            "state": {0: {"exp_avg": torch.randn(2000), "step": torch.tensor(5.0)}},
            "param_groups": [{"lr": 0.1, "params": [0]}, {"lr": 0.2, "params": []}],
        },
        "ints": torch.arange(50),
        "epoch": 7,
    }


@pytest.fixture
def opened(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Chunk files opened through os.open while the test runs."""
    seen: list[str] = []
    real = os.open

    def spy(path: Any, *args: Any, **kwargs: Any) -> int:
        if "/c/" in str(path):
            seen.append(str(path))
        return real(path, *args, **kwargs)

    monkeypatch.setattr(os, "open", spy)
    return seen


def test_keys_read_only_the_chunks_they_need(save: Any, opened: list[str]) -> None:
    state = _state()
    directory, manifest = save(state, codec="none", chunk_bytes=1000)
    opened.clear()
    out = read_checkpoint(directory, manifest, keys=["model/enc.*"])
    assert list(out) == ["model"] and list(out["model"]) == ["enc.w", "enc.b"]
    assert type(out["model"]) is OrderedDict
    assert torch.equal(out["model"]["enc.w"], state["model"]["enc.w"])
    entries = [manifest.tensors["model/enc.w"], manifest.tensors["model/enc.b"]]
    needed = {f"{e.array}/c/{k}" for e in entries for k in range(e.chunk_start, e.chunk_stop)}
    assert {p.split(str(directory) + "/")[1] for p in opened} == needed
    # (A chunk file may be opened twice: once to hint the read-ahead, once to read it.)
    assert len(set(opened)) < sum(len(a.chunks) for a in manifest.arrays.values()) / 2


def test_key_patterns_select_containers_and_non_tensor_leaves(save: Any) -> None:
    directory, manifest = save(_state())
    out = read_checkpoint(directory, manifest, keys=["optimizer/state"])
    assert list(out) == ["optimizer"] and list(out["optimizer"]) == ["state"]
    assert set(out["optimizer"]["state"][0]) == {"exp_avg", "step"}
    out = read_checkpoint(directory, manifest, keys=["epoch", "optimizer/param_groups/1/lr"])
    assert out == {"epoch": 7, "optimizer": {"param_groups": [{"lr": 0.2}]}}
    out = read_checkpoint(directory, manifest, keys="ints")
    assert torch.equal(out["ints"], torch.arange(50))


def test_into_fills_live_tensors_in_place(save: Any) -> None:
    state = _state()
    directory, manifest = save(state, codec="lz4", chunk_bytes=1000)
    live = _state()
    for t in [*live["model"].values(), live["optimizer"]["state"][0]["exp_avg"], live["ints"]]:
        t.zero_()
    ptrs = {k: t.data_ptr() for k, t in live["model"].items()}
    out = read_checkpoint(directory, manifest, into=live)
    for key, t in out["model"].items():
        assert t is live["model"][key] and t.data_ptr() == ptrs[key]
        assert torch.equal(t, state["model"][key])
    assert out["ints"] is live["ints"] and torch.equal(live["ints"], torch.arange(50))
    assert out["epoch"] == 7


def test_into_with_parameters_and_odd_targets(save: Any) -> None:
    torch.manual_seed(1)
    model = torch.nn.Linear(30, 20)
    directory, manifest = save({"model": model.state_dict(), "x": torch.randn(4, 6)})
    other = torch.nn.Linear(30, 20)
    params = dict(other.named_parameters())
    ptr = params["weight"].data_ptr()
    target_x = torch.zeros(6, 4).t()  # right shape, non-contiguous: filled by copy
    live = {"model": dict(other.named_parameters()), "x": target_x}
    out = read_checkpoint(directory, manifest, into=live)
    assert out["model"]["weight"] is params["weight"] and params["weight"].data_ptr() == ptr
    assert params["weight"].requires_grad
    assert torch.equal(params["weight"].detach(), model.weight.detach())
    assert out["x"] is target_x and torch.equal(target_x, read_checkpoint(directory, manifest)["x"])


def test_into_mismatch_allocates_new_tensors(save: Any) -> None:
    directory, manifest = save({"a": torch.ones(3), "b": torch.ones(2), "c": torch.ones(2)})
    live = {"a": torch.zeros(4), "b": torch.zeros(2, dtype=torch.float64), "c": "not a tensor"}
    out = read_checkpoint(directory, manifest, into=live)
    assert out["a"] is not live["a"] and torch.equal(out["a"], torch.ones(3))
    assert out["b"].dtype == torch.float32 and torch.equal(live["b"], torch.zeros(2).double())
    assert torch.equal(out["c"], torch.ones(2))


def test_into_fills_ndarrays_in_place(save: Any) -> None:
    directory, manifest = save({"n": np.arange(10.0)})
    target = np.zeros(10)
    out = read_checkpoint(directory, manifest, into={"n": target})
    assert out["n"] is target and np.array_equal(target, np.arange(10.0))


def test_fresh_loads_do_not_share_memory_between_tensors(save: Any) -> None:
    directory, manifest = save(_state())
    out = read_checkpoint(directory, manifest)
    out["model"]["enc.w"].fill_(1)
    assert not torch.all(out["model"]["dec.w"] == 1)


def test_iter_tensors_streams_every_tensor(save: Any, opened: list[str]) -> None:
    state = {f"t{i}": torch.full((i * 7 + 1,), float(i)) for i in range(60)}
    state["big"] = torch.randn(5000)
    state["i"] = torch.arange(3)
    directory, manifest = save(state, codec="none", chunk_bytes=1024)
    opened.clear()
    seen = dict(iter_tensors(directory, manifest))
    assert set(seen) == set(state)
    for key, tensor in state.items():
        assert torch.equal(seen[key], tensor)
    # Chunks shared by small tensors are read once, not once per tensor.
    assert len(opened) == len(set(opened)) == sum(len(a.chunks) for a in manifest.arrays.values())


def test_threads_one_gives_the_same_result(save: Any) -> None:
    state = _state()
    directory, manifest = save(state, chunk_bytes=1000)
    out = read_checkpoint(directory, manifest, threads=1)
    assert torch.equal(
        out["optimizer"]["state"][0]["exp_avg"], state["optimizer"]["state"][0]["exp_avg"]
    )


def test_reading_from_another_directory_path_type(save: Any, tmp_path: Path) -> None:
    directory, manifest = save({"w": torch.ones(3)})
    out = read_checkpoint(str(directory), manifest)  # type: ignore[arg-type]
    assert torch.equal(out["w"], torch.ones(3))


def test_into_with_keys_pairs_by_original_list_positions(save: Any) -> None:
    state = {"groups": [{"w": torch.ones(2)}, {"w": torch.full((2,), 2.0)}]}
    directory, manifest = save(state)
    live = {"groups": [{"w": torch.zeros(2)}, {"w": torch.zeros(2)}]}
    out = read_checkpoint(directory, manifest, keys=["groups/1/*"], into=live)
    assert out == {"groups": [{"w": live["groups"][1]["w"]}]}  # list compacted
    assert torch.equal(live["groups"][1]["w"], torch.full((2,), 2.0))
    assert torch.equal(live["groups"][0]["w"], torch.zeros(2))
