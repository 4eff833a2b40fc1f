"""Fixtures for the storage tests: one moto S3 server per module that needs it."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from ckptstore.testing.s3 import MotoS3


@pytest.fixture(scope="module")
def moto_s3() -> Iterator[MotoS3]:
    """A moto S3 server with one fresh bucket, shared by a test module."""
    with MotoS3() as s3:
        yield s3
