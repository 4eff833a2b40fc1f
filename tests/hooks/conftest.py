"""Fixtures for the training-integration tests: a real store on a temporary directory."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from ckptstore.ops.writing.async_save import close_saver
from ckptstore.store import CheckpointStore


@pytest.fixture
def store(tmp_path: Path) -> Iterator[CheckpointStore]:
    """An embedded store (SQLite catalog + hot tier) under ``tmp_path``."""
    st = CheckpointStore.open(tmp_path / "store")
    try:
        yield st
    finally:
        try:
            close_saver(st)
        finally:
            st.close()
