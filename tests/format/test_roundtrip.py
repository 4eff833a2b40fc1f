"""Round trips: every dtype x every codec, odd shapes and views, a real training state."""

from __future__ import annotations

import math
import uuid
from collections import OrderedDict
from pathlib import Path
from typing import Any

import pytest
import torch

from ckptstore.format import (
    CODEC_PRESETS,
    DEFAULT_CHUNK_BYTES,
    iter_tensors,
    read_checkpoint,
    write_checkpoint,
)
from ckptstore.format.dtypes import dtype_by_name, supported_dtype_names

DTYPES = supported_dtype_names()


def random_bits(shape: tuple[int, ...], dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """A tensor of ``dtype`` whose bytes are random (bool: random 0/1)."""
    gen = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.rand(shape, generator=gen) > 0.5
    numel = math.prod(shape)
    raw = torch.randint(0, 256, (numel * dtype.itemsize,), dtype=torch.uint8, generator=gen)
    return raw.view(dtype).reshape(shape)


def test_every_float8_and_bits_dtype_is_supported() -> None:
    expected = {n for n in dir(torch) if n.startswith(("float8_", "float4_"))}
    expected = {n for n in expected if isinstance(getattr(torch, n), torch.dtype)}
    assert expected <= set(DTYPES)
    for name in ("bfloat16", "complex32", "uint16", "uint32", "uint64", "complex128"):
        assert name in DTYPES


@pytest.mark.parametrize("codec", CODEC_PRESETS)
def test_every_dtype_round_trips_bit_exact(save: Any, same_bits: Any, codec: str) -> None:
    state: dict[str, Any] = {}
    for i, name in enumerate(DTYPES):
        dtype = getattr(torch, name)
        state[name] = {
            "big": random_bits((37, 5), dtype, seed=i),
            "scalar": random_bits((), dtype, seed=100 + i),
            "empty": random_bits((0, 3), dtype),
            "transposed": random_bits((4, 6), dtype, seed=200 + i).t(),
        }
    # Small chunks so most tensors straddle chunk boundaries.
    directory, manifest = save(state, codec=codec, chunk_bytes=64)
    # One array per dtype, plus one for its small tensors where they are packed apart.
    assert {a.torch_dtype for a in manifest.arrays.values()} == set(DTYPES)
    out = read_checkpoint(directory, manifest)
    for name in DTYPES:
        for leaf, tensor in state[name].items():
            got = out[name][leaf]
            assert got.device.type == "cpu"
            assert same_bits(got, tensor), (name, leaf)
    for key, tensor in iter_tensors(directory, manifest):
        name, leaf = key.split("/")
        assert same_bits(tensor, state[name][leaf]), key


def test_storage_dtype_is_native_or_same_width_uint() -> None:
    for name in DTYPES:
        info = dtype_by_name(name)
        assert info is not None
        if name in ("bfloat16", "complex32") or name.startswith(("float8", "float4")):
            assert not info.native
            assert info.zarr_dtype == f"uint{8 * info.itemsize}"
        else:
            assert info.native and info.zarr_dtype == name


def test_special_float_payloads_survive(save: Any, same_bits: Any) -> None:
    nan_payload = torch.tensor([0x7FC00001, 0xFFC12345, 0x80000000, 0x7F800000], dtype=torch.uint32)
    state = {
        "f32": nan_payload.view(torch.float32),
        "f64": torch.tensor([-0.0, float("inf"), float("-inf"), float("nan")], dtype=torch.float64),
        "bf16": torch.tensor([0x7FC1, 0x8000, 0xFF81], dtype=torch.uint16).view(torch.bfloat16),
    }
    for codec in CODEC_PRESETS:
        directory, manifest = save(state, codec=codec)
        out = read_checkpoint(directory, manifest)
        for key, tensor in state.items():
            assert same_bits(out[key], tensor), (codec, key)


def test_views_store_only_their_own_elements(save: Any) -> None:
    base = torch.arange(1_000_000, dtype=torch.float32)
    state = {
        "slice": base[10:20],
        "strided": base[::1000],
        "row": base.view(1000, 1000)[3],
        "col": base.view(1000, 1000)[:, 7],
    }
    directory, manifest = save(state, codec="none")
    assert manifest.logical_bytes == (10 + 1000 + 1000 + 1000) * 4
    out = read_checkpoint(directory, manifest)
    for key, tensor in state.items():
        assert torch.equal(out[key], tensor)
        assert out[key].is_contiguous()


def test_conj_and_neg_views_are_stored_as_values(save: Any) -> None:
    z = torch.complex(torch.randn(5), torch.randn(5))
    state = {"conj": z.conj(), "neg": z.conj().imag}
    directory, manifest = save(state, codec="none")
    out = read_checkpoint(directory, manifest)
    assert torch.equal(out["conj"], z.conj().resolve_conj())
    assert torch.equal(out["neg"], z.conj().imag.resolve_neg())


def test_requires_grad_is_not_preserved(save: Any) -> None:
    param = torch.nn.Parameter(torch.randn(3))
    directory, manifest = save({"p": param})
    out = read_checkpoint(directory, manifest)
    assert type(out["p"]) is torch.Tensor and not out["p"].requires_grad
    assert torch.equal(out["p"], param.detach())


def test_empty_state_and_bare_tensor(save: Any) -> None:
    directory, manifest = save({})
    assert read_checkpoint(directory, manifest) == {}
    assert manifest.arrays == {}
    tensor = torch.randn(3, 2)
    directory, manifest = save(tensor)
    assert manifest.tensor_keys() == [""]
    assert torch.equal(read_checkpoint(directory, manifest), tensor)


def test_only_empty_tensors_make_an_empty_array(save: Any) -> None:
    state = {"a": torch.empty(0), "b": torch.empty(0, 4, dtype=torch.int8)}
    directory, manifest = save(state)
    assert manifest.arrays["float32"].length == 0
    assert manifest.arrays["float32"].chunks == ()
    out = read_checkpoint(directory, manifest)
    assert out["a"].shape == (0,) and out["b"].shape == (0, 4) and out["b"].dtype == torch.int8


def _train(
    model: torch.nn.Module, opt: torch.optim.Optimizer, steps: int, seed: int
) -> list[float]:
    gen = torch.Generator().manual_seed(seed)
    losses = []
    for _ in range(steps):
        x = torch.randn(16, 8, generator=gen)
        y = torch.randn(16, 2, generator=gen)
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def _mlp() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))


@pytest.mark.parametrize("codec", ["none", "lz4"])
def test_model_and_adamw_resume_identically(save: Any, codec: str) -> None:
    torch.manual_seed(0)
    model = _mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _train(model, opt, 3, seed=1)
    state = {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": 3}
    directory, manifest = save(state, codec=codec)
    assert "optimizer/state/0/exp_avg" in manifest.tensors
    assert "model/0.weight" in manifest.tensors

    loaded = read_checkpoint(directory, manifest)
    assert type(loaded["model"]) is OrderedDict
    assert list(loaded["optimizer"]["state"]) == [0, 1, 2, 3]  # int keys kept
    fresh = _mlp()
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    fresh.load_state_dict(loaded["model"])
    fresh_opt.load_state_dict(loaded["optimizer"])
    assert _train(model, opt, 3, seed=2) == _train(fresh, fresh_opt, 3, seed=2)


def test_object_count_is_bounded(tmp_path: Path) -> None:
    # 600 tensors, 150 MB: files must not grow with the tensor count.
    sizes = [250_000 if i % 3 == 0 else 1_000 for i in range(600)]
    scale = 150_000_000 // 4 / sum(sizes)
    state = {f"t{i}": torch.zeros(max(1, int(n * scale))) for i, n in enumerate(sizes)}
    directory = tmp_path / "c"
    manifest = write_checkpoint(
        directory, state, ckpt_id=str(uuid.uuid4()), run="r", step=0, codec="none"
    )
    files = [p for p in directory.rglob("*") if p.is_file()]
    assert len(manifest.tensors) == 600
    assert len(files) <= math.ceil(manifest.logical_bytes / DEFAULT_CHUNK_BYTES) + 16
    # Balanced chunks: the padded tail wastes less than one element per chunk.
    array = manifest.arrays["float32"]
    assert len(array.chunks) * array.chunk_len - array.length < len(array.chunks)
