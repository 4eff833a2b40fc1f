"""The quantizer's own reconstruction is bit for bit what a load decodes, on hostile values.

The writer hashes the reconstruction it computed; a reader that decoded one different bit
would fail verification of a healthy checkpoint. These cases aim at the corners where two
float paths can disagree: signed zeros, subnormal and zero scales, dtype rounding, padding.
"""

from __future__ import annotations

import struct

import numpy as np
import pytest
import torch
from delta_helpers import bits_equal

from ckptstore.format.delta import dequantize_into, quantize_chunk, quantized_payload_size
from ckptstore.format.dtypes import dtype_info


def _round_trip(new: torch.Tensor, base: torch.Tensor, bits: int, block: int,
                threshold: float | None) -> tuple[torch.Tensor, torch.Tensor, float]:
    info = dtype_info(new.dtype)
    assert info is not None
    n = new.numel()
    new_b = new.contiguous().view(torch.uint8).numpy().copy()
    base_b = base.contiguous().view(torch.uint8).numpy().copy()
    payload = np.empty(quantized_payload_size(n, bits, block), dtype=np.uint8)
    recon = np.empty(n * info.itemsize, dtype=np.uint8)
    result = quantize_chunk(new_b, base_b, info, n, bits=bits, block=block,
                            threshold=threshold, payload_out=payload, recon_out=recon)
    assert result is not None
    dest = base_b.copy()
    dequantize_into(result.payload.copy(), dest, info, n, bits)
    written = torch.from_numpy(recon).view(new.dtype)
    loaded = torch.from_numpy(dest).view(new.dtype)
    return written, loaded, result.max_abs_error


def _hostile(dtype: torch.dtype, n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(n, generator=g, dtype=torch.float64)
    new = base + torch.randn(n, generator=g, dtype=torch.float64) * 1e-3
    # Signed zeros in the base with changes that quantize to a "negative zero" code.
    base[:64] = -0.0
    new[:64] = -torch.rand(64, generator=g, dtype=torch.float64) * 1e-9
    new[32:48] = 1.0  # so the block's scale is large and the tiny changes round to 0
    # A block of changes so small their scale is subnormal in float32.
    base[512:1024] = 0.0
    new[512:1024] = torch.randn(512, generator=g, dtype=torch.float64) * 1e-42
    # A block with one big jump next to small ones.
    new[1024] = base[1024] + 100.0
    # Values at the edge of the dtype's range.
    big = min(torch.finfo(dtype).max / 4, 1e30)
    base[1100:1110] = big
    new[1100:1110] = big * 0.999
    return new.to(dtype), base.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("threshold", [None, 1e-6])
def test_writer_reconstruction_equals_reader_bits(dtype: torch.dtype, bits: int,
                                                  threshold: float | None) -> None:
    # 3000 elements: not a multiple of the block, so the last block is padded.
    new, base = _hostile(dtype, 3000, seed=bits)
    written, loaded, bound = _round_trip(new, base, bits, 512, threshold)
    assert bits_equal(written, loaded)
    err = (loaded.double() - new.double()).abs().max().item()
    assert err <= bound
    _assert_within_half_a_step(new, base, loaded, bits, 512, threshold)


def _assert_within_half_a_step(new: torch.Tensor, base: torch.Tensor, loaded: torch.Tensor,
                               bits: int, block: int, threshold: float | None) -> None:
    """Each block is off by at most half its quantization step (plus dtype rounding)."""
    pad = -new.numel() % block
    delta = torch.nn.functional.pad((new.double() - base.double()).abs(), (0, pad))
    err = torch.nn.functional.pad((loaded.double() - new.double()).abs(), (0, pad))
    amax = delta.view(-1, block).amax(dim=1)
    step = (amax / (127 if bits == 8 else 7)).float().double()
    ulp = torch.finfo(new.dtype).eps * new.double().abs().max().item()
    limit = step * 0.5001 + ulp + (threshold or 0.0)
    # A block whose step is below float32's normal range is stored as "no change".
    limit = torch.where(step < torch.finfo(torch.float32).tiny, amax + ulp, limit)
    assert bool((err.view(-1, block).amax(dim=1) <= limit).all())


def test_float64_changes_beyond_float32_scales_are_left_lossless() -> None:
    # Scales are float32: a change too large for one cannot be quantized; the writer must
    # say so (and store the chunk exactly), never record a NaN reconstruction.
    base = torch.full((1024,), 1e300, dtype=torch.float64)
    new = base * 0.5
    info = dtype_info(torch.float64)
    assert info is not None
    payload = np.empty(quantized_payload_size(1024, 8, 512), dtype=np.uint8)
    recon = np.empty(1024 * 8, dtype=np.uint8)
    got = quantize_chunk(new.view(torch.uint8).numpy(), base.view(torch.uint8).numpy(), info,
                         1024, bits=8, block=512, threshold=None, payload_out=payload,
                         recon_out=recon)
    assert got is None


def test_codes_never_exceed_the_code_range() -> None:
    # |delta| * (1 / scale) lands a hair above qmax for some values: the codes must still
    # decode to within one quantization step, which an overflowed code would not.
    g = torch.Generator().manual_seed(7)
    base = torch.zeros(4096)
    new = torch.randn(4096, generator=g) * torch.logspace(-30, 30, 4096)
    for bits in (8, 4):
        written, loaded, bound = _round_trip(new, base, bits, 16, None)
        assert bits_equal(written, loaded)
        scale = new.abs().view(-1, 16).amax(dim=1) / (127 if bits == 8 else 7)
        err = (loaded - new).abs().view(-1, 16).amax(dim=1)
        assert bool((err <= scale * 0.5001 + 1e-45).all())
        assert (loaded - new).abs().max().item() <= bound


@pytest.mark.parametrize(("bits", "code_bytes"), [(4, b"\xf1\xb8"), (8, b"\xf9\x07\x00\x03")])
def test_payload_layout_is_stable(bits: int, code_bytes: bytes) -> None:
    # Hand-built payloads in the documented layout (4-bit: code + 8, low nibble first) must
    # decode to the same values forever: checkpoints written today are read years later.
    header = struct.pack("<4sB3xII", b"CKQ1", bits, 4, 4)
    payload = np.frombuffer(header + struct.pack("<f", 0.5) + code_bytes, dtype=np.uint8)
    base = torch.tensor([1.0, 1.0, 1.0, 1.0])
    dest = base.numpy().view(np.uint8).copy()
    info = dtype_info(torch.float32)
    assert info is not None
    dequantize_into(payload.copy(), dest, info, 4, bits)
    assert torch.from_numpy(dest).view(torch.float32).tolist() == [-2.5, 4.5, 1.0, 2.5]
    # And the writer produces exactly these bytes for these values.
    new = torch.tensor([-2.5, 4.5, 1.0, 2.5])
    out = np.empty(quantized_payload_size(4, bits, 4), dtype=np.uint8)
    recon = np.empty(16, dtype=np.uint8)
    if bits == 8:
        # 8-bit scales by max/127; pick values on its grid.
        new = base + torch.tensor([-127.0, 7.0, 0.0, 3.0]) * 0.5
    got = quantize_chunk(new.numpy().view(np.uint8), base.numpy().view(np.uint8).copy(), info,
                         4, bits=bits, block=4, threshold=None, payload_out=out,
                         recon_out=recon)
    assert got is not None
    codes = bytes(got.payload[len(header) + 4 :])
    assert codes == (code_bytes if bits == 4 else b"\x81\x07\x00\x03")
