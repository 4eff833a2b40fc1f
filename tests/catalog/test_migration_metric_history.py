"""Revision c18bb4f8a103 (``metric_history``) upgrades a populated catalog and downgrades."""

from __future__ import annotations

import uuid

from sqlalchemy import inspect, text

from ckptstore.catalog import Catalog, migrate
from ckptstore.catalog.engine import create_catalog_engine

PREVIOUS = "84503541b9b8"
REVISION = "c18bb4f8a103"


def _tables(url: str) -> set[str]:
    engine = create_catalog_engine(url)
    try:
        return set(inspect(engine).get_table_names())
    finally:
        engine.dispose()


def test_upgrade_adds_the_table_and_downgrade_drops_only_it(empty_url: str) -> None:
    migrate.upgrade(empty_url, PREVIOUS)
    assert "metric_history" not in _tables(empty_url)
    old_id = str(uuid.uuid4())
    engine = create_catalog_engine(empty_url)
    try:
        with engine.begin() as conn:
            conn.execute(text("INSERT INTO runs (id, name) VALUES (1, 'old-run')"))
            conn.execute(text(
                "INSERT INTO checkpoints (id, run_id, step, version, state, manifest_digest, "
                "codec) VALUES (:id, 1, 7, 1, 'COMMITTED', :digest, 'lz4')"
            ), {"id": old_id, "digest": "ab" * 32})
    finally:
        engine.dispose()

    migrate.upgrade(empty_url, REVISION)
    assert migrate.current(empty_url) == REVISION
    with Catalog(empty_url) as cat:
        assert cat.get_any(old_id).step == 7  # existing rows untouched
        assert cat.metric_history("old-run") == []
        cat.record_history("old-run", {"loss": [(s, 1.0 / (s + 1)) for s in range(50)]},
                           max_points=8)
        assert sum(p.count for p in cat.metric_history("old-run")) == 50

    migrate.downgrade(empty_url, PREVIOUS)
    assert migrate.current(empty_url) == PREVIOUS
    assert "metric_history" not in _tables(empty_url)
    engine = create_catalog_engine(empty_url)
    try:
        with engine.connect() as conn:
            assert conn.execute(text("SELECT count(*) FROM runs")).scalar_one() == 1
            assert conn.execute(text("SELECT count(*) FROM checkpoints")).scalar_one() == 1
    finally:
        engine.dispose()
    # And up again: the revision is repeatable.
    migrate.upgrade(empty_url)
    assert "metric_history" in _tables(empty_url)
