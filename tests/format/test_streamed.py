"""Writing a state whose tensors are produced chunk by chunk (StreamedState), and reading
ranges of tensors (RangeReader): the same bytes as the in-memory paths."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest
import torch

from ckptstore.errors import IntegrityError, InvalidNameError
from ckptstore.format import flatten_state, read_checkpoint, read_manifest, write_checkpoint
from ckptstore.format.constants import chunk_rel
from ckptstore.format.reader import RangeReader
from ckptstore.format.sources import (
    ByteBuffer,
    MemorySource,
    Range,
    StreamedState,
    StreamedTensor,
    TensorSource,
)


def _state() -> dict[str, object]:
    g = torch.Generator().manual_seed(0)
    return {
        "big": torch.randn(70_000, generator=g),  # several 64 KiB chunks
        "half": torch.randn(40_000, generator=g).bfloat16(),  # sampled by the auto codec
        "small": [torch.randn(n, generator=g) for n in (3, 500, 7)],  # packed together
        "ints": torch.arange(100),
        "lr": 0.5,
    }


class _Counting(TensorSource):
    """Serves a state's bytes and records every call (which thread, which ranges)."""

    def __init__(self, state: object) -> None:
        flat = flatten_state(state)
        self._inner = MemorySource(
            {k: t.reshape(-1).view(torch.uint8).numpy() for k, t in flat.tensors.items()},
            {k: t.element_size() for k, t in flat.tensors.items()},
        )
        self.calls: list[tuple[str, list[Range]]] = []

    def read(self, ranges: Sequence[Range]) -> list[ByteBuffer]:
        self.calls.append((threading.current_thread().name, list(ranges)))
        return [np.array(v) for v in self._inner.read(ranges)]  # fresh copies, not views


def _streamed(state: object, source: TensorSource) -> StreamedState:
    flat = flatten_state(state)
    specs = {k: StreamedTensor(t.dtype, tuple(t.shape)) for k, t in flat.tensors.items()}
    return StreamedState(flat.tree, specs, source)


def test_a_streamed_state_writes_the_same_checkpoint_as_the_state(tmp_path: Path) -> None:
    state = _state()
    kw = {"run": "r", "step": 1, "codec": "auto", "chunk_bytes": 64 * 1024, "threads": 2}
    plain = write_checkpoint(tmp_path / "plain", state, ckpt_id=str(uuid.uuid4()), **kw)
    source = _Counting(state)
    streamed = write_checkpoint(tmp_path / "streamed", _streamed(state, source),
                                ckpt_id=str(uuid.uuid4()), **kw)
    assert streamed.tree == plain.tree
    for name, array in plain.arrays.items():
        other = streamed.arrays[name]
        assert other.codec == array.codec  # auto chose from the same sample
        assert [c.blake3 for c in other.chunks] == [c.blake3 for c in array.chunks]
    # Asked chunk by chunk, from the writer's threads; the codec samples are the only reads
    # on the calling thread: one per float array (fp32 and bf16), of its first elements.
    chunks = sum(len(a.chunks) for a in plain.arrays.values())
    on_pool = [c for c in source.calls if c[0].startswith("ckpt-write")]
    assert len(on_pool) == chunks
    samples = [r for t, r in source.calls if not t.startswith("ckpt-write")]
    floats = [a for a in plain.arrays.values() if a.torch_dtype in ("float32", "bfloat16")]
    assert len(samples) == len(floats) == 3  # float32, float32_small, bfloat16
    assert sorted(k for ranges in samples for k, first, _ in ranges if first == 0) == [
        "big", "half", "small/0", "small/1", "small/2"]
    assert sum(len(ranges) for ranges in samples) == 5
    back = read_checkpoint(tmp_path / "streamed", read_manifest(tmp_path / "streamed"))
    assert torch.equal(back["big"], state["big"]) and back["lr"] == 0.5


def test_a_streamed_state_must_match_its_tree(tmp_path: Path) -> None:
    state = {"a": torch.zeros(4)}
    flat = flatten_state(state)
    extra = StreamedState(flat.tree, {"a": StreamedTensor(torch.float32, (4,)),
                                      "b": StreamedTensor(torch.float32, (2,))},
                          _Counting(state))
    with pytest.raises(InvalidNameError, match="never references"):
        write_checkpoint(tmp_path / "x", extra, ckpt_id=str(uuid.uuid4()), run="r", step=1)
    missing = StreamedState(flat.tree, {}, _Counting(state))
    with pytest.raises(InvalidNameError, match="malformed"):
        write_checkpoint(tmp_path / "y", missing, ckpt_id=str(uuid.uuid4()), run="r", step=1)
    assert not any((tmp_path / "x").glob("*")) and not (tmp_path / "y").exists()


def test_range_reader_reads_any_range_and_names_a_damaged_chunk(tmp_path: Path) -> None:
    state = _state()
    directory = tmp_path / "ck"
    manifest = write_checkpoint(directory, state, ckpt_id=str(uuid.uuid4()), run="r", step=1,
                                codec="lz4", chunk_bytes=64 * 1024)
    reader = RangeReader(directory, manifest)
    big = state["big"]
    assert isinstance(big, torch.Tensor)
    spans = [(0, 5), (16_000, 16_500), (16_383, 32_769), (69_990, 70_000)]  # across chunks
    bufs = [np.empty((b - a) * 4, dtype=np.uint8) for a, b in spans]
    small = np.empty(4 * 4, dtype=np.uint8)
    reader.read([*(("big", a, b, buf) for (a, b), buf in zip(spans, bufs, strict=True)),
                 ("small/1", 10, 14, small)])
    for (a, b), buf in zip(spans, bufs, strict=True):
        assert torch.equal(torch.from_numpy(buf).view(torch.float32), big[a:b])
    small_1 = state["small"][1]  # type: ignore[index]
    assert torch.equal(torch.from_numpy(small).view(torch.float32), small_1[10:14])
    entry = manifest.tensors["big"]
    path = directory / chunk_rel(entry.array, entry.chunk_start + 1)
    data = bytearray(path.read_bytes())
    data[-10] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(IntegrityError, match=str(path)):
        reader.read([("big", 16_000, 20_000, np.empty(16_000, dtype=np.uint8))])
