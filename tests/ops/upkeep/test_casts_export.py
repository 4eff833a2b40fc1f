"""Checkpoints holding casts (bf16 weights stored as their fp32 masters rounded, format version
3) leave the store exact: exported to every plain format, converted to another codec, and
carried in a bundle to another store."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from ckptstore import CheckpointStore
from ckptstore.format import flatten_state, read_manifest
from ckptstore.ops.sharing.bundle import export_bundle, import_bundle
from ckptstore.ops.upkeep.convert import convert_checkpoint, export_checkpoint


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    a, b = a.contiguous(), b.contiguous()
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.view(torch.int16), b.view(torch.int16)) if a.element_size() == 2 \
        else torch.equal(a, b)


def _mixed() -> dict[str, Any]:
    gen = torch.Generator().manual_seed(5)
    master = {f"h.{i}.weight": torch.randn(256, 512, generator=gen) * 0.02 for i in range(2)}
    master["ln.bias"] = torch.randn(512, generator=gen)
    return {"model": {k: v.to(torch.bfloat16) for k, v in master.items()}, "master": master,
            "step": 3}


@pytest.fixture
def mixed_store(tmp_path: Path) -> Any:
    store = CheckpointStore.open(tmp_path / "store")
    state = _mixed()
    ck = store.save("r", 1, state)
    manifest = read_manifest(store.checkpoint_dir(ck.run, ck.id))
    assert sum(t.cast for t in manifest.tensors.values()) == 3  # the premise
    yield store, ck, state
    store.close()


def test_every_export_format_holds_the_saved_bits(mixed_store: Any, tmp_path: Path) -> None:
    store, ck, state = mixed_store
    flat = dict(flatten_state(state).tensors)
    export_checkpoint(store, ck.ref, "safetensors", tmp_path / "a.safetensors")
    tensors = load_file(str(tmp_path / "a.safetensors"))
    assert set(tensors) == set(flat)
    assert all(_same(tensors[k], v) for k, v in flat.items())
    export_checkpoint(store, ck.ref, "pt", tmp_path / "a.pt")
    pt = torch.load(tmp_path / "a.pt", weights_only=True)
    assert all(_same(pt["model"][k], v) for k, v in state["model"].items())
    export_checkpoint(store, ck.ref, "hf", tmp_path / "hf", keys=["model/*"])
    shards = [load_file(str(p)) for p in sorted((tmp_path / "hf").glob("*.safetensors"))]
    merged = {k: v for shard in shards for k, v in shard.items()}
    assert len(merged) == 3
    assert all(any(_same(t, v) for t in merged.values()) for v in state["model"].values())


def test_a_converted_copy_and_a_bundle_load_bit_exact(mixed_store: Any, tmp_path: Path) -> None:
    store, ck, state = mixed_store
    ck2 = store.save("r", 2, state)  # deduplicated against v1: a bundle re-encodes it
    converted = convert_checkpoint(store, ck.ref, codec="zstd-3")
    out = store.load(converted.ref)
    assert all(_same(out["model"][k], v) for k, v in state["model"].items())
    export_bundle(store, ck2.ref, tmp_path / "b.tar")
    with CheckpointStore.open(tmp_path / "other") as other:
        imported = import_bundle(other, tmp_path / "b.tar")
        manifest = read_manifest(other.checkpoint_dir(imported.run, imported.id))
        assert manifest.format_version == 3
        assert {k for k, t in manifest.tensors.items() if t.cast} == {
            f"model/{k}" for k in state["model"]}
        loaded = other.load(imported.ref)
        assert all(_same(loaded["model"][k], v) for k, v in state["model"].items())
        assert other.verify(imported.ref, deep=True) == []
