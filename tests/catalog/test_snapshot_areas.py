"""Snapshot areas: one catalog row per run, host and rank, upserted, listed, forgotten."""

from __future__ import annotations

import pytest

from ckptstore.catalog import Catalog
from ckptstore.errors import CheckpointNotFoundError, InvalidNameError


def test_one_row_per_run_host_rank_upserted(catalog: Catalog) -> None:
    catalog.ensure_run("r")
    catalog.ensure_run("q")
    catalog.record_snapshot_area("r", "node-1", 0, "shm://node-1/dev/shm/a", slots=3,
                                 slot_bytes=100)
    catalog.record_snapshot_area("r", "node-1", 0, "shm://node-1/dev/shm/b", slots=2,
                                 slot_bytes=200)
    catalog.record_snapshot_area("r", "node-2", 1, "shm://node-2/dev/shm/c", slots=3,
                                 slot_bytes=100)
    catalog.record_snapshot_area("q", "node-1", 0, "shm://node-1/dev/shm/d", slots=3,
                                 slot_bytes=1)
    areas = catalog.snapshot_areas("r")
    assert [(a.host, a.rank, a.uri, a.slots, a.slot_bytes) for a in areas] == [
        ("node-1", 0, "shm://node-1/dev/shm/b", 2, 200),
        ("node-2", 1, "shm://node-2/dev/shm/c", 3, 100),
    ]
    assert areas[0].updated_at.tzinfo is not None
    assert len(catalog.snapshot_areas()) == 3
    assert catalog.forget_snapshot_area("r", "node-2", 1)
    assert not catalog.forget_snapshot_area("r", "node-2", 1)
    assert [a.host for a in catalog.snapshot_areas("r")] == ["node-1"]


def test_bad_input_refused(catalog: Catalog) -> None:
    with pytest.raises(CheckpointNotFoundError):
        catalog.record_snapshot_area("nope", "h", 0, "shm://h/x", slots=2, slot_bytes=1)
    catalog.ensure_run("r")
    with pytest.raises(InvalidNameError):
        catalog.record_snapshot_area("r", "", 0, "shm://h/x", slots=2, slot_bytes=1)
    with pytest.raises(InvalidNameError):
        catalog.record_snapshot_area("r", "h", -1, "shm://h/x", slots=2, slot_bytes=1)
    assert catalog.snapshot_areas("r") == []
