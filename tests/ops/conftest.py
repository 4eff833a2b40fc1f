"""Shared fixtures for the ops tests: a store on tmp_path, a moto S3 server, a tiered store.

Test modules may override ``store`` with their own fixture; these stay generic.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from ckptstore import Checkpoint, CheckpointStore
from ckptstore.format import BaseRef, read_manifest, write_checkpoint
from ckptstore.testing.s3 import MotoS3


@pytest.fixture
def store(tmp_path: Path) -> Iterator[CheckpointStore]:
    """An embedded store (SQLite catalog, hot tier) under tmp_path, closed afterwards."""
    opened = CheckpointStore.open(tmp_path / "store")
    try:
        yield opened
    finally:
        opened.close()


@pytest.fixture(scope="session")
def s3() -> Iterator[MotoS3]:
    """One moto S3 server and bucket for the whole session (tests use distinct prefixes)."""
    with MotoS3() as server:
        yield server


@pytest.fixture
def tiered_store(tmp_path: Path, s3: MotoS3) -> Iterator[
        CheckpointStore]:
    """A store with warm = s3://<bucket>/<test>/warm and cold = .../cold (STANDARD_IA).

    The cold tier uses STANDARD_IA so tests can read it back; GLACIER behaviour is tested
    on the tier itself.
    """
    prefix = uuid.uuid4().hex[:12]
    opened = CheckpointStore.open(
        tmp_path / "store",
        warm=s3.url(f"{prefix}/warm"),
        cold=s3.url(f"{prefix}/cold"),
        cold_storage_class="STANDARD_IA",
        storage_options=s3.storage_options,
    )
    try:
        yield opened
    finally:
        opened.close()


SaveDelta = Callable[[CheckpointStore, str, int, Any, Checkpoint], Checkpoint]


@pytest.fixture
def save_delta() -> SaveDelta:
    """Save a checkpoint deduplicated against ``base`` (chunks equal to the base's are
    referenced, not written), the way a delta-saving store does."""

    def save(store: CheckpointStore, run: str, step: int, state: Any,
             base: Checkpoint) -> Checkpoint:
        base_dir = store.checkpoint_dir(base.run, base.id)
        base_manifest = read_manifest(base_dir, expected_digest=base.manifest_digest)
        ck = store.catalog.begin_checkpoint(run, step, kind="delta", base_id=base.id,
                                            codec=base_manifest.codec)
        directory = store.checkpoint_dir(run, ck.id)
        directory.parent.mkdir(parents=True, exist_ok=True)
        manifest = write_checkpoint(
            directory, state, ckpt_id=ck.id, run=run, step=step, codec=base_manifest.codec,
            chunk_bytes=base_manifest.chunk_bytes, base=BaseRef(base_manifest, base_dir),
        )
        assert manifest.kind == "delta", "the state shares no chunk with the base"
        return store.catalog.commit_checkpoint(
            ck.id, manifest_digest=manifest.digest, logical_bytes=manifest.logical_bytes,
            stored_bytes=manifest.stored_bytes, tier="hot", uri=str(directory),
        )

    return save
