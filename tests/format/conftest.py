"""Fixtures for the checkpoint format tests."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from ckptstore.format import Manifest, read_manifest, write_checkpoint

Save = Callable[..., tuple[Path, Manifest]]


@pytest.fixture
def save(tmp_path: Path) -> Save:
    """Write a committed checkpoint under tmp_path; returns (directory, re-read manifest).

    Keyword arguments go to write_checkpoint (defaults: fresh id, run "r", step 0).
    """
    counter = iter(range(1_000_000))

    def _save(state: Any, name: str | None = None, **kwargs: Any) -> tuple[Path, Manifest]:
        directory = tmp_path / (name or f"ckpt{next(counter)}")
        kwargs.setdefault("ckpt_id", str(uuid.uuid4()))
        kwargs.setdefault("run", "r")
        kwargs.setdefault("step", 0)
        written = write_checkpoint(directory, state, **kwargs)
        manifest = read_manifest(directory)
        assert manifest.to_json() == written.to_json()
        return directory, manifest

    return _save


def bits_equal(a: Any, b: Any) -> bool:
    """Bit-exact tensor comparison (NaN payloads and -0.0 included)."""
    import torch

    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    ua = a.detach().contiguous().reshape(-1).view(torch.uint8)
    ub = b.detach().contiguous().reshape(-1).view(torch.uint8)
    return bool(torch.equal(ua, ub))


@pytest.fixture
def same_bits() -> Callable[[Any, Any], bool]:
    """The bit-exact comparison, as a fixture (test modules cannot import each other)."""
    return bits_equal
