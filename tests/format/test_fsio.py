"""Vectored writes: every byte in order, in calls the page cache copies fast."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from ckptstore.format import fsio


def _write(path: Path, buffers: list[Any]) -> int:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
    try:
        return fsio.writev_all(fd, buffers)
    finally:
        os.close(fd)


def test_large_buffers_are_written_in_capped_calls_in_order(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    rng = np.random.default_rng(0)
    buffers = [rng.integers(0, 256, n, dtype=np.uint8)
               for n in (3 << 20, 1, 0, 700_000, fsio.WRITE_CALL_BYTES, 5)]
    calls: list[int] = []
    real = os.writev

    def writev(fd: int, views: Any) -> int:
        calls.append(sum(memoryview(v).nbytes for v in views))
        return real(fd, views)

    monkeypatch.setattr(fsio.os, "writev", writev)
    expected = b"".join(b.tobytes() for b in buffers)
    assert _write(tmp_path / "f", buffers) == len(expected)
    assert (tmp_path / "f").read_bytes() == expected
    assert max(calls) <= fsio.WRITE_CALL_BYTES
    assert sum(calls) == len(expected)


def test_short_writes_continue_where_the_kernel_stopped(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    buffers = [bytes(range(256)) * 5000, b"tail", bytes(300_000)]
    real = os.writev

    def short(fd: int, views: Any) -> int:
        # The kernel may write less than asked: take 1/3 of the call, at least one byte.
        data = b"".join(bytes(v) for v in views)
        return real(fd, [data[: max(1, len(data) // 3)]])

    monkeypatch.setattr(fsio.os, "writev", short)
    expected = b"".join(buffers)
    assert _write(tmp_path / "f", buffers) == len(expected)
    assert (tmp_path / "f").read_bytes() == expected


def test_a_write_that_makes_no_progress_raises(tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fsio.os, "writev", lambda fd, views: 0)
    with pytest.raises(OSError, match="wrote nothing"):
        _write(tmp_path / "f", [b"abc"])
