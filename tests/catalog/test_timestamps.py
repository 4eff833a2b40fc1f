"""How the catalog reads timestamps back: always aware, always UTC, whatever the spelling."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from ckptstore.catalog import Catalog
from ckptstore.catalog.models import parse_utc


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        # SQLite's own text (no zone: stored as UTC), with and without a fraction
        ("2026-01-01 05:33:00.123456", datetime(2026, 1, 1, 5, 33, 0, 123456, tzinfo=UTC)),
        ("2026-01-01 05:33:00", datetime(2026, 1, 1, 5, 33, tzinfo=UTC)),
        # PostgreSQL's JSON carries the session's zone: converted to UTC
        ("2026-01-01T05:33:00+00:00", datetime(2026, 1, 1, 5, 33, tzinfo=UTC)),
        ("2026-01-01T07:33:00.5+02:00", datetime(2026, 1, 1, 5, 33, 0, 500000, tzinfo=UTC)),
        ("2026-01-01T00:33:00-05:00", datetime(2026, 1, 1, 5, 33, tzinfo=UTC)),
        ("2026-01-01T10:33:00+05", datetime(2026, 1, 1, 5, 33, tzinfo=UTC)),
        ("2026-01-01T05:33:00Z", datetime(2026, 1, 1, 5, 33, tzinfo=UTC)),
        ("2026-01-01", datetime(2026, 1, 1, tzinfo=UTC)),
    ],
)
def test_parse_utc(text: str, expected: datetime) -> None:
    parsed = parse_utc(text)
    assert parsed == expected
    assert parsed.utcoffset() == timedelta(0)


def test_not_a_timestamp_is_an_error() -> None:
    with pytest.raises(ValueError):
        parse_utc("yesterday at noon")


def test_records_read_back_are_aware_utc(tmp_path: Path) -> None:
    cat = Catalog(f"sqlite:///{tmp_path}/c.db")
    try:
        before = datetime.now(UTC)
        cid = cat.begin_checkpoint("r", 1, uri="/h/r/1").id
        cat.commit_checkpoint(cid, manifest_digest="blake3:x", logical_bytes=1, stored_bytes=1)
        ck = cat.get(cid)
        replica = ck.replica("hot")
        assert replica is not None  # verified_at comes through the row's JSON document
        for stamp in (ck.created_at, ck.committed_at, replica.verified_at):
            assert stamp is not None and stamp.utcoffset() == timedelta(0)
            assert before - timedelta(seconds=5) <= stamp <= datetime.now(UTC)
    finally:
        cat.close()
