"""crc32c_combine joins the crc32c of consecutive parts into the crc32c of the whole, as if
one pass had read it (a snapshot's two-thread read-back relies on it)."""

from __future__ import annotations

import random

import pytest

from ckptstore.format.codecs import crc32c_combine, crc32c_update


@pytest.mark.parametrize("len_a", [0, 1, 3, 4096, 1 << 20])
@pytest.mark.parametrize("len_b", [0, 1, 7, 333, 65536, (1 << 20) + 5])
def test_combine_equals_one_pass(len_a: int, len_b: int) -> None:
    rng = random.Random(len_a * 31 + len_b)
    a, b = rng.randbytes(len_a), rng.randbytes(len_b)
    assert crc32c_combine(crc32c_update(a), crc32c_update(b), len(b)) == crc32c_update(a + b)


def test_combine_chains_over_many_parts_and_depends_on_every_byte() -> None:
    rng = random.Random(7)
    parts = [rng.randbytes(rng.randrange(1, 5000)) for _ in range(20)]
    crc = 0
    for part in parts:
        crc = crc32c_combine(crc, crc32c_update(part), len(part))
    whole = b"".join(parts)
    assert crc == crc32c_update(whole)
    flipped = bytearray(whole)
    flipped[1234] ^= 0x10
    assert crc != crc32c_update(bytes(flipped))
    # The length matters: the same two CRCs joined as if B were one byte longer differ.
    a, b = parts[0], parts[1]
    assert crc32c_combine(crc32c_update(a), crc32c_update(b), len(b) + 1) != crc32c_update(a + b)
