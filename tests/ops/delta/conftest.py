"""Fixtures for the incremental/quantized checkpoint tests."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from ckptstore import CheckpointStore

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

from delta_helpers import CHUNK  # noqa: E402


@pytest.fixture
def store(tmp_path: Path) -> Iterator[CheckpointStore]:
    """An embedded store with small chunks and a short keyframe interval."""
    opened = CheckpointStore.open(tmp_path / "store", chunk_bytes=CHUNK, keyframe_every=4)
    try:
        yield opened
    finally:
        opened.close()
