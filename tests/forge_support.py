"""Forging chunk files the way a hostile store would: other content, same size, same crc32c.

crc32c is linear: after changing any bytes of a chunk, four bytes placed right before the
crc trailer can be chosen so that the body's crc32c is the old one again. The trailer and the
size stay as they were, so only a content hash (the manifest's blake3) tells the difference.
Used by tests/ops/sharing/ and tests/reliability/test_hostile_remote.py.
"""

from __future__ import annotations

from pathlib import Path

import crc32c

_POLY = 0x82F63B78  # crc32c, reflected
_MASK = 0xFFFFFFFF


def _unstep(reg: int) -> int:
    """One bit step of the reflected crc register, backwards (the polynomial's top bit is
    set, so the register's top bit says whether the step xored it in)."""
    if reg & 0x80000000:
        return (((reg ^ _POLY) << 1) | 1) & _MASK
    return (reg << 1) & _MASK


def same_crc(body: bytes, crc: int) -> bytes:
    """``body`` with its last four bytes replaced so that its crc32c is ``crc``."""
    assert len(body) >= 4
    before = crc32c.crc32c(body[:-4]) ^ _MASK  # the register after the prefix
    reg = crc ^ _MASK  # the register after the whole body
    for _ in range(32):
        reg = _unstep(reg)
    fixed = body[:-4] + (reg ^ before).to_bytes(4, "little")
    assert crc32c.crc32c(fixed) == crc
    return fixed


def forge_chunk_bytes(data: bytes, *, at: int = 0) -> bytes:
    """A forged version of chunk file ``data`` (body + 4-byte crc trailer): up to 8 bytes
    from ``at`` changed, the body's crc32c restored, the trailer and the size untouched.

    A body of 4 bytes or less cannot be forged (its crc32c determines it): see
    :func:`forgeable`.
    """
    body, trailer = bytearray(data[:-4]), data[-4:]
    crc = crc32c.crc32c(bytes(body))
    assert int.from_bytes(trailer, "little") == crc, "not a chunk file with a crc trailer"
    assert forgeable(data), "a body of 4 bytes or less is determined by its crc32c"
    at = min(at, len(body) - 5)
    for i in range(at, min(at + 8, len(body) - 4)):
        body[i] ^= 0x5A
    forged = same_crc(bytes(body), crc) + trailer
    assert len(forged) == len(data) and forged != data
    return forged


def forgeable(data: bytes) -> bool:
    """Whether chunk file ``data`` has more body bytes than its crc32c determines."""
    return len(data) - 4 > 4


def forge_chunk_file(path: Path) -> bytes:
    """Forge the chunk file at ``path`` in place (see :func:`forge_chunk_bytes`); returns
    the original bytes."""
    original = path.read_bytes()
    path.chmod(0o644)
    path.write_bytes(forge_chunk_bytes(original))
    return original


def first_chunk_file(directory: Path) -> Path:
    """The first chunk file (``<array>/c/<i>``) of a checkpoint directory."""
    return next(p for p in sorted(directory.rglob("*")) if p.is_file() and "/c/" in str(p))
