"""Fixtures for the observability tests: a filled store, a moto S3 server, the CLI."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from ckptstore import CheckpointStore
from ckptstore.testing.s3 import MotoS3


@pytest.fixture(scope="module")
def s3() -> Iterator[MotoS3]:
    """One moto S3 server and bucket for the module."""
    with MotoS3() as server:
        yield server


@pytest.fixture
def filled_store(tmp_path: Path) -> Iterator[CheckpointStore]:
    """A store with two runs, three checkpoints on the hot tier."""
    store = CheckpointStore.open(tmp_path / "store")
    try:
        for step in (1, 2):
            store.save("alpha", step, {"w": torch.arange(1000, dtype=torch.float32) * step},
                       metrics={"loss": 1.0 / step})
        store.save("beta", 1, {"w": torch.zeros(10)}, parent="alpha@latest")
        yield store
    finally:
        store.close()


@pytest.fixture
def ckpt_cli() -> Callable[..., int]:
    """``ckpt`` as a function: arguments in, exit code out."""
    from ckptstore.cli.app import main

    def run(*args: str) -> int:
        return main(list(args))

    return run
