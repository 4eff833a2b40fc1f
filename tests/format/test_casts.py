"""Tensors stored as casts (docs/FORMAT.md, version 3): mixed precision's bf16/fp16 copies of
fp32 tensors get no bytes of their own, and every read path gives their exact bits back."""

from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from ckptstore import CheckpointStore
from ckptstore.errors import IntegrityError
from ckptstore.format import iter_tensors, iteration_order, read_manifest, read_tensors
from ckptstore.format.casts import find_casts, rounds_to
from ckptstore.format.manifest.parse import parse_manifest
from ckptstore.format.reader import RangeReader
from ckptstore.ops.upkeep.diff import diff_checkpoints


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16) if t.element_size() == 2 else t


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(_bits(a), _bits(b))


def _mixed(seed: int = 0) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(seed)
    master = {f"h.{i}.weight": torch.randn(512, 512, generator=gen) * 0.02 for i in range(3)}
    master["ln.bias"] = torch.randn(768, generator=gen)
    return {
        "model": {k: v.to(torch.bfloat16) for k, v in master.items()},
        "master": master,
        "optim": {"exp_avg": {k: torch.randn(v.shape, generator=gen)
                              for k, v in master.items()}},
        "other_bf16": torch.randn(512, 512, generator=gen).to(torch.bfloat16),
        "half": master["h.0.weight"].to(torch.float16),
        "step": 7,
    }


# ---------------------------------------------------------------- finding the casts
def test_each_narrow_tensor_is_paired_with_the_wide_tensor_it_rounds() -> None:
    state = _mixed()
    flat = {f"model/{k}": v for k, v in state["model"].items()}
    flat |= {f"master/{k}": v for k, v in state["master"].items()}
    flat |= {"other": state["other_bf16"], "half": state["half"]}
    found = find_casts(flat)
    # Three 512x512 masters of the same shape: each bf16 weight finds its own by key.
    assert found == {**{f"model/{k}": f"master/{k}" for k in state["master"]},
                     "half": "master/h.0.weight"}
    assert find_casts(flat, usable=lambda key: key != "master/h.1.weight") == {
        k: v for k, v in found.items() if k != "model/h.1.weight"}


def test_a_narrow_tensor_that_is_not_exactly_the_rounding_is_stored_itself() -> None:
    wide = torch.randn(64, 64)
    narrow = wide.to(torch.bfloat16)
    assert rounds_to(wide, narrow)
    off_by_one = narrow.clone()
    off_by_one.view(torch.int16)[3, 3] += 1
    assert not rounds_to(wide, off_by_one)
    # -0.0 and 0.0 are equal floats but not equal bits.
    zeros = torch.zeros(64, 64)
    assert not rounds_to(-zeros, zeros.to(torch.bfloat16))
    # A NaN is never stored as a cast, whatever its payload.
    nan = wide.clone()
    nan[0, 0] = float("nan")
    assert not rounds_to(nan, nan.to(torch.bfloat16))
    assert find_casts({"w": nan, "b": nan.to(torch.bfloat16)}) == {}
    # Too small to be worth a check; another shape; fp64 is not a source.
    tiny = torch.randn(8)
    assert find_casts({"w": tiny, "b": tiny.to(torch.bfloat16)}) == {}
    assert find_casts({"w": wide, "b": wide.t().contiguous().to(torch.bfloat16)}) == {}
    dbl = wide.double()
    assert find_casts({"w": dbl, "b": dbl.to(torch.bfloat16)}) == {}


# ---------------------------------------------------------------- saving and reading
@pytest.fixture
def saved(tmp_path: Path) -> tuple[CheckpointStore, Any, dict[str, Any], Path]:
    store = CheckpointStore.open(tmp_path / "store")
    state = _mixed()
    ck = store.save("r", 1, state)
    yield store, ck, state, store.checkpoint_dir(ck.run, ck.id)
    store.close()


def test_a_mixed_precision_state_stores_its_bf16_weights_as_casts(saved: Any) -> None:
    _store, ck, state, directory = saved
    manifest = read_manifest(directory)
    assert manifest.format_version == 3
    casts = {k: t for k, t in manifest.tensors.items() if t.cast}
    assert set(casts) == {f"model/{k}" for k in state["master"]} | {"half"}
    for key, t in casts.items():
        if key.startswith("model/"):
            wide = manifest.tensors["master/" + key.removeprefix("model/")]
            assert (t.array, t.offset, t.numel) == (wide.array, wide.offset, wide.numel)
    assert not any(name.startswith("tensors/model") for name in manifest.arrays)
    # The payload counts the casts; the bytes stored do not.
    narrow = sum(v.numel() * 2 for v in state["model"].values()) + state["half"].numel() * 2
    total = narrow + sum(v.numel() * v.element_size() for v in (
        *state["master"].values(), *state["optim"]["exp_avg"].values(), state["other_bf16"]))
    assert manifest.logical_bytes == total
    assert ck.stored_bytes < total - narrow + 64 * 1024


def test_every_read_path_gives_the_saved_bits(saved: Any) -> None:
    store, ck, state, directory = saved
    manifest = read_manifest(directory)
    whole = store.load(ck.ref)
    for key, value in state["model"].items():
        assert _same(whole["model"][key], value), key
    assert _same(whole["half"], state["half"])
    assert _same(whole["other_bf16"], state["other_bf16"])
    # A cast alone: its wide elements are read into scratch space.
    part = store.load(ck.ref, keys=["model/h.2.weight", "half"])
    assert _same(part["model"]["h.2.weight"], state["model"]["h.2.weight"])
    assert _same(part["half"], state["half"])
    assert set(part) == {"model", "half"} and set(part["model"]) == {"h.2.weight"}
    # Into a live state: its tensors filled in place, a non-contiguous one copied back.
    live = copy.deepcopy(state)
    for t in live["model"].values():
        t.zero_()
    live["model"]["h.0.weight"] = torch.zeros(512, 512, dtype=torch.bfloat16).t().t()
    strided = torch.zeros(512, 1024, dtype=torch.bfloat16)[:, ::2]
    live["model"]["h.1.weight"] = strided
    got = store.load(ck.ref, into=live)
    assert got["model"]["h.1.weight"] is strided
    for key, value in state["model"].items():
        assert _same(live["model"][key].contiguous(), value), key
    # Flat reads, ranges and one tensor at a time.
    flat = read_tensors(directory, manifest, ["model/ln.bias", "master/ln.bias"])
    assert _same(flat["model/ln.bias"], state["model"]["ln.bias"])
    buf = torch.empty(100, dtype=torch.bfloat16)
    RangeReader(directory, manifest).read(
        [("model/h.0.weight", 1000, 1100, buf.view(torch.uint8).numpy())])
    assert _same(buf, state["model"]["h.0.weight"].reshape(-1)[1000:1100])
    seen = dict(iter_tensors(directory, manifest))
    # Each cast right after the tensor whose elements it rounds (rounded from it, not read
    # again), in the order the converters are told.
    order = list(seen)
    assert order == iteration_order(manifest)
    for key, entry in manifest.tensors.items():
        if entry.cast:
            wide = order[order.index(key) - 1]
            while manifest.tensors[wide].cast:  # one wide tensor may have several casts
                wide = order[order.index(wide) - 1]
            assert (manifest.tensors[wide].array, manifest.tensors[wide].offset) == (
                entry.array, entry.offset), key
    assert _same(seen["half"], state["half"])
    for key, value in state["model"].items():
        assert _same(seen[f"model/{key}"], value), key
    # A cast whose elements no other tensor of the manifest holds (another writer's
    # manifest may say so) is read on its own, after the rest.
    gone = manifest.tensors["master/h.0.weight"]
    orphans = {k for k, t in manifest.tensors.items()
               if t.cast and (t.array, t.offset) == (gone.array, gone.offset)}
    assert "model/h.0.weight" in orphans
    orphaned = dataclasses.replace(manifest, tensors={
        k: t for k, t in manifest.tensors.items() if k != "master/h.0.weight"})
    alone = dict(iter_tensors(directory, orphaned))
    assert set(list(alone)[-len(orphans):]) == orphans
    assert _same(alone["model/h.0.weight"], state["model"]["h.0.weight"])


def test_a_save_against_a_base_and_a_verify_treat_casts_like_any_tensor(saved: Any) -> None:
    store, ck, state, _ = saved
    nxt = copy.deepcopy(state)
    nxt["master"]["h.1.weight"] += 0.5
    nxt["model"]["h.1.weight"] = nxt["master"]["h.1.weight"].to(torch.bfloat16)
    ck2 = store.save("r", 2, nxt)
    out = store.load(ck2.ref)
    for key, value in nxt["model"].items():
        assert _same(out["model"][key], value), key
    assert store.verify(ck2.ref, deep=True) == []
    diff = diff_checkpoints(store, ck.ref, ck2.ref)
    changed = {t.key for t in diff.tensors if t.status != "same"}
    assert changed == {"master/h.1.weight", "model/h.1.weight"}


# ---------------------------------------------------------------- hostile manifests
def _doc(directory: Path) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads((directory / "manifest.json").read_bytes())
    return doc


def _cast_entry(doc: dict[str, Any]) -> dict[str, Any]:
    entry: dict[str, Any] = next(t for t in doc["tensors"] if t.get("cast"))
    return entry


@pytest.mark.parametrize(("change", "message"), [
    (lambda d: d.update(format_version=2), "a cast needs format_version 3"),
    (lambda d: _cast_entry(d).update(cast=False), "cast must be true"),
    (lambda d: _cast_entry(d).update(cast=1), "cast must be true"),
    (lambda d: _cast_entry(d).update(torch_dtype="float32"), "cannot be a cast of array"),
    (lambda d: _cast_entry(d).update(torch_dtype="int16"), "cannot be a cast of array"),
    (lambda d: _cast_entry(d).update(offset=10**9), "lies outside array"),
    (lambda d: _cast_entry(d).update(array="other_bf16"), "unknown array"),
])
def test_a_malformed_cast_is_refused(saved: Any, change: Any, message: str) -> None:
    _, _, _, directory = saved
    doc = _doc(directory)
    change(doc)
    with pytest.raises(IntegrityError, match=message):
        parse_manifest(json.dumps(doc).encode())


def test_a_cast_of_a_narrow_array_is_refused(saved: Any) -> None:
    _, _, _, directory = saved
    doc = _doc(directory)
    entry = _cast_entry(doc)
    bf16 = next(name for name, a in doc["arrays"].items() if a["torch_dtype"] == "bfloat16")
    entry.update(array=bf16, torch_dtype="float16", offset=0, numel=1, shape=[1],
                 chunk_start=0, chunk_stop=1)
    with pytest.raises(IntegrityError, match="cannot be a cast of array"):
        parse_manifest(json.dumps(doc).encode())
