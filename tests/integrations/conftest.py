"""Fixtures for the framework adapter tests: a real store on a temporary directory."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from ckptstore.store import CheckpointStore

# Never reach the Hugging Face Hub: the models are built from configs.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture
def store(tmp_path: Path) -> Iterator[CheckpointStore]:
    """An embedded store (SQLite catalog + hot tier) under ``tmp_path``."""
    opened = CheckpointStore.open(tmp_path / "store")
    try:
        yield opened
    finally:
        opened.close()
