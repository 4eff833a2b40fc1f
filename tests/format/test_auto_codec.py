"""What the default codec, ``auto``, stores each array with (format/codecs.py): LZ4 where a
float array's sample shrinks enough, raw bytes otherwise, and the choice reaches the files."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from ckptstore import CheckpointStore
from ckptstore.format import read_manifest
from ckptstore.format.codecs import (
    AUTO_MAX_RATIO,
    AUTO_MAX_RATIO_FP32,
    auto_codec,
    codec_spec,
    encode,
)


def _bytes(t: torch.Tensor) -> np.ndarray:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy()


def _choice(t: torch.Tensor) -> str:
    return auto_codec(t.element_size(), t.dtype.is_floating_point, _bytes(t))


@pytest.mark.parametrize(("name", "tensor", "codec"), [
    # Trained weights and AdamW moments: the sign and exponent bits repeat.
    ("fp32 weights", torch.randn(1 << 18, generator=torch.Generator().manual_seed(0)) * 0.02,
     "lz4"),
    ("fp32 second moments", torch.rand(1 << 18, generator=torch.Generator().manual_seed(1))
     ** 2 * 1e-6, "lz4"),
    ("bf16 weights", torch.randn(1 << 18).to(torch.bfloat16), "lz4"),
    # Random bits: nothing to gain; fp64 and integers are never compressed.
    ("fp32 random bits", torch.randint(0, 256, (1 << 20,), dtype=torch.uint8,
                                       generator=torch.Generator().manual_seed(2)
                                       ).view(torch.float32), "none"),
    ("fp64 weights", torch.randn(1 << 17, dtype=torch.float64) * 0.02, "none"),
    ("int32 ids", torch.zeros(1 << 18, dtype=torch.int32), "none"),
    ("fp32 under 4 KiB", torch.randn(512) * 0.02, "none"),
])
def test_auto_compresses_float_arrays_that_shrink(name: str, tensor: torch.Tensor,
                                                  codec: str) -> None:
    assert _choice(tensor) == codec, name


def test_fp32_must_shrink_more_than_bf16() -> None:
    # fp32 whose sample shrinks to about 93 %: enough for bf16's 95 %, not fp32's 90 %.
    gen = torch.Generator().manual_seed(3)
    bits = torch.randint(0, 2**31 - 1, (1 << 18,), dtype=torch.int64, generator=gen)
    # Three constant high bits out of 32: bit-shuffle + LZ4 gains about 7 %.
    values = ((bits & 0x1FFFFFFF) | 0x20000000).to(torch.int32).view(torch.float32)
    data = _bytes(values)[: 1 << 20]
    ratio = len(encode(codec_spec("lz4"), data, 4)) / len(data)
    assert AUTO_MAX_RATIO_FP32 < ratio <= AUTO_MAX_RATIO, ratio
    assert auto_codec(4, True, data) == "none"


def test_a_save_stores_each_array_with_its_choice(tmp_path: Path) -> None:
    gen = torch.Generator().manual_seed(4)
    state = {"w": torch.randn(512, 512, generator=gen) * 0.02,
             "noise": torch.randint(0, 256, (1 << 20,), dtype=torch.uint8, generator=gen
                                    ).view(torch.float32),
             "ids": torch.arange(300_000, dtype=torch.int64)}
    with CheckpointStore.open(tmp_path / "s") as store:
        ck = store.save("r", 1, state)
        manifest = read_manifest(store.checkpoint_dir(ck.run, ck.id))
        codecs = {name.rpartition("/")[2]: a.codec for name, a in manifest.arrays.items()}
        assert codecs == {"w": "lz4", "noise": "none", "ids": "none"}
        out = store.load(ck.ref)
        assert all(torch.equal(out[k].view(torch.uint8), state[k].view(torch.uint8))
                   for k in ("w", "noise"))
        assert torch.equal(out["ids"], state["ids"])
