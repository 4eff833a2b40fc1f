"""Revision 5c8e0f3a2d17 (``checkpoints.lossy_scope``) upgrades a populated catalog in place."""

from __future__ import annotations

import uuid

import pytest
from sqlalchemy import text

from ckptstore.catalog import Catalog, migrate
from ckptstore.catalog.engine import create_catalog_engine
from ckptstore.errors import InvalidNameError

PREVIOUS = "7b1d4e2a9c63"


def test_upgrade_keeps_rows_and_records_the_scope_from_then_on(empty_url: str) -> None:
    migrate.upgrade(empty_url, PREVIOUS)
    old_id = str(uuid.uuid4())
    engine = create_catalog_engine(empty_url)
    try:
        with engine.begin() as conn:
            conn.execute(text("INSERT INTO runs (id, name) VALUES (1, 'old-run')"))
            conn.execute(text(
                "INSERT INTO checkpoints (id, run_id, step, version, state, manifest_digest, "
                "codec, lossy, error_bound) VALUES (:id, 1, 7, 1, 'COMMITTED', :digest, 'lz4', "
                ":lossy, 0.5)"
            ), {"id": old_id, "digest": "ab" * 32, "lossy": True})
            conn.execute(text(
                "INSERT INTO replicas (checkpoint_id, tier, uri, state, bytes) "
                "VALUES (:id, 'hot', 'hot://x', 'PRESENT', 123)"
            ), {"id": old_id})
    finally:
        engine.dispose()

    migrate.upgrade(empty_url)
    assert migrate.current(empty_url) == migrate.head()
    with Catalog(empty_url, upgrade=False) as cat:
        old = cat.get_any(old_id)
        # NULL reads as "none recorded"; the flag and the bound are untouched.
        assert (old.lossy, old.error_bound, old.lossy_scope) == (True, 0.5, ())
        ck = cat.begin_checkpoint("old-run", 8, kind="full", lossy=True)
        done = cat.commit_checkpoint(ck.id, manifest_digest="cd" * 32, logical_bytes=10,
                                     stored_bytes=5, lossy=True, error_bound=0.25,
                                     lossy_scope=("*exp_avg", "*exp_avg_sq"))
        assert (done.error_bound, done.lossy_scope) == (0.25, ("*exp_avg", "*exp_avg_sq"))
        assert cat.get_any(ck.id).lossy_scope == ("*exp_avg", "*exp_avg_sq")

    migrate.downgrade(empty_url, PREVIOUS)
    assert migrate.current(empty_url) == PREVIOUS
    engine = create_catalog_engine(empty_url)
    try:
        with engine.connect() as conn:
            assert conn.execute(text("SELECT count(*) FROM checkpoints")).scalar_one() == 2
            # Rows that reference checkpoints survive too (a table rebuild would cascade).
            assert conn.execute(text("SELECT count(*) FROM replicas")).scalar_one() == 2
    finally:
        engine.dispose()


def test_a_bad_scope_pattern_is_refused(empty_url: str) -> None:
    migrate.upgrade(empty_url)
    with Catalog(empty_url, upgrade=False) as cat:
        cat.ensure_run("r")
        ck = cat.begin_checkpoint("r", 0)
        with pytest.raises(InvalidNameError, match="lossy_scope"):
            cat.commit_checkpoint(ck.id, manifest_digest="cd" * 32, logical_bytes=1,
                                  stored_bytes=1, lossy=True, lossy_scope=["*exp_avg", ""])
        assert cat.get_any(ck.id).state.name == "PENDING"  # nothing half-written
