"""Revision e4f1a7c2b9d3 (``lineage_edges.weight`` / ``position``) upgrades a populated catalog
in place: existing edges keep their meaning, merges record their weights from then on."""

from __future__ import annotations

import uuid

from sqlalchemy import text

from ckptstore.catalog import Catalog, migrate
from ckptstore.catalog.engine import create_catalog_engine

PREVIOUS = "b7c3d9e1f5a2"


def test_upgrade_keeps_edges_and_records_merge_weights_from_then_on(empty_url: str) -> None:
    migrate.upgrade(empty_url, PREVIOUS)
    ids = [str(uuid.uuid4()) for _ in range(3)]
    engine = create_catalog_engine(empty_url)
    try:
        with engine.begin() as conn:
            conn.execute(text("INSERT INTO runs (id, name) VALUES (1, 'old-run')"))
            for version, cid in enumerate(ids, start=1):
                conn.execute(text(
                    "INSERT INTO checkpoints (id, run_id, step, version, state, "
                    "manifest_digest, codec) VALUES (:id, 1, :v, :v, 'COMMITTED', :d, 'lz4')"
                ), {"id": cid, "v": version, "d": "ab" * 32})
            conn.execute(text(
                "INSERT INTO lineage_edges (src_id, dst_id, kind) VALUES (:a, :b, 'merged-from')"
            ), {"a": ids[0], "b": ids[1]})
    finally:
        engine.dispose()

    migrate.upgrade(empty_url)
    assert migrate.current(empty_url) == migrate.head()
    with Catalog(empty_url, upgrade=False) as cat:
        (old,) = cat.links(ids[1])
        # NULL reads as "no weight recorded": an edge written before merges had weights.
        assert (old.src, old.kind, old.weight, old.position) == (
            ids[0], "merged-from", None, None)
        assert cat.merge_inputs(ids[1])[0].weight is None
        cat.record_merge(ids[2], [(ids[0], 0.75), (ids[1], 0.25)], {"method": "weighted"})
        assert [(i.weight, i.position) for i in cat.merge_inputs(ids[2])] == [(0.75, 0), (0.25, 1)]

    # And back: the downgrade drops the two columns and keeps every edge.
    migrate.downgrade(empty_url, PREVIOUS)
    assert migrate.current(empty_url) == PREVIOUS
    engine = create_catalog_engine(empty_url)
    try:
        with engine.connect() as conn:
            assert conn.execute(text("SELECT count(*) FROM lineage_edges")).scalar_one() == 3
    finally:
        engine.dispose()
