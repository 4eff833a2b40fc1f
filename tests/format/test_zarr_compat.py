"""Plain zarr reads what we write, and our codec bytes are exactly zarr's."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import zarr

from ckptstore.format import CODEC_PRESETS, FORMAT_VERSION, flatten_state
from ckptstore.format.codecs import TRAILER, codec_spec, crc32c_update, encode

# manifest.json and COMMITTED are not zarr nodes; zarr says so when it lists the group.
pytestmark = pytest.mark.filterwarnings("ignore:Object at .* is not recognized")


def _open(directory: Path) -> Any:
    return zarr.open_group(str(directory), mode="r")


@pytest.mark.parametrize("codec", CODEC_PRESETS)
def test_plain_zarr_reads_every_array(save: Any, codec: str) -> None:
    state = {
        "w": torch.randn(300, 7),
        "b": torch.randn(11).to(torch.bfloat16),
        "f8": torch.randn(40).to(torch.float8_e4m3fn),
        "i": torch.arange(1000, dtype=torch.int64),
        "m": torch.rand(33) > 0.5,
        "c": torch.randn(9, dtype=torch.complex64),
        "v": torch.randn(20, 20)[::3, 1:],
        "e": torch.empty(0, dtype=torch.float16),
    }
    directory, manifest = save(state, codec=codec, chunk_bytes=512)
    group = _open(directory)
    attrs = group.attrs.asdict()["ckptstore"]
    assert attrs["id"] == manifest.id and attrs["format_version"] == FORMAT_VERSION
    assert sorted(group.array_keys()) == sorted(manifest.arrays)
    flat = flatten_state(state).tensors
    for name, entry in manifest.arrays.items():
        arr = group[name]
        assert arr.shape == (entry.length,)
        values = arr[:]
        assert values.dtype == np.dtype(entry.zarr_dtype)
        if entry.zarr_dtype != entry.torch_dtype:
            assert arr.attrs["torch_dtype"] == entry.torch_dtype
        for key, t in manifest.tensors.items():
            if t.array != name:
                continue
            want = flat[key].contiguous().reshape(-1).view(getattr(torch, entry.torch_dtype))
            packed = values[t.offset : t.offset + t.numel]
            if entry.zarr_dtype != entry.torch_dtype:
                want = want.view(getattr(torch, entry.zarr_dtype))
            assert np.array_equal(packed, want.numpy()), key


def test_array_metadata_uses_core_codecs_only(save: Any) -> None:
    directory, _manifest = save({"w": torch.randn(10)}, codec="lz4")
    meta = json.loads((directory / "float32" / "zarr.json").read_text())
    assert [c["name"] for c in meta["codecs"]] == ["bytes", "blosc", "crc32c"]
    blosc = meta["codecs"][1]["configuration"]
    assert blosc["cname"] == "lz4" and blosc["shuffle"] == "bitshuffle" and blosc["typesize"] == 4
    assert meta["chunk_key_encoding"]["name"] == "default"


@pytest.mark.parametrize("codec", ["lz4", "zstd-1", "zstd-3"])
def test_zarr_decodes_our_blosc_bytes_and_agrees_on_the_crc(codec: str) -> None:
    from zarr.codecs import BloscCodec, Crc32cCodec
    from zarr.core.array_spec import ArrayConfig, ArraySpec
    from zarr.core.buffer import default_buffer_prototype
    from zarr.core.buffer.cpu import Buffer
    from zarr.core.dtype import parse_dtype

    spec = codec_spec(codec)
    raw = np.random.default_rng(0).standard_normal(4096).astype(np.float32)
    frame = encode(spec, raw, 4)
    crc = crc32c_update(frame)
    chunk_spec = ArraySpec(
        shape=(4096,),
        dtype=parse_dtype("float32", zarr_format=3),
        fill_value=0,
        config=ArrayConfig.from_dict({}),
        prototype=default_buffer_prototype(),
    )
    stored = Buffer.from_bytes(frame + TRAILER.pack(crc))
    # zarr's own crc32c codec checks our trailer and strips it...
    inner = Crc32cCodec()._decode_sync(stored, chunk_spec)
    # ...and produces the same trailer from the same bytes.
    assert Crc32cCodec()._encode_sync(Buffer.from_bytes(frame), chunk_spec).to_bytes() == (
        stored.to_bytes()
    )
    blosc = BloscCodec(cname=spec.cname, clevel=spec.clevel, shuffle="bitshuffle", typesize=4)
    decoded = blosc._decode_sync(inner, chunk_spec).as_numpy_array()
    assert decoded.tobytes() == raw.tobytes()


def test_our_blosc_frames_equal_numcodecs_frames() -> None:
    import numcodecs.blosc

    raw = np.random.default_rng(1).standard_normal(100_000).astype(np.float32)
    previous = numcodecs.blosc.use_threads
    numcodecs.blosc.use_threads = False  # numcodecs' single-threaded contextual path
    try:
        for name in ("lz4", "zstd-1", "zstd-3"):
            spec = codec_spec(name)
            assert spec.cname is not None
            theirs = numcodecs.blosc.compress(raw, spec.cname.encode(), spec.clevel, 2, 0, 4)
            assert encode(spec, raw, 4) == bytes(theirs)
    finally:
        numcodecs.blosc.use_threads = previous


def test_numcodecs_fallback_round_trips(save: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    from ckptstore.format import codecs as codecs_module
    from ckptstore.format import read_checkpoint

    monkeypatch.setattr(codecs_module._CTX, "compress", None)
    monkeypatch.setattr(codecs_module._CTX, "decompress", None)
    state = {"w": torch.randn(5000), "b": torch.randn(7).to(torch.bfloat16)}
    directory, manifest = save(state, codec="lz4", chunk_bytes=4096)
    out = read_checkpoint(directory, manifest)
    assert torch.equal(out["w"], state["w"]) and torch.equal(out["b"], state["b"])
