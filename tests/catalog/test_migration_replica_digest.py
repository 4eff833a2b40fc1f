"""Revision 7b1d4e2a9c63 (``replicas.manifest_digest``) upgrades a populated catalog in place."""

from __future__ import annotations

import uuid

from sqlalchemy import text

from ckptstore.catalog import Catalog, migrate
from ckptstore.catalog.engine import create_catalog_engine
from ckptstore.records import ReplicaState, expected_digest

INITIAL = "3f2c9a1e7b40"


def test_upgrade_from_initial_keeps_rows_and_adds_a_null_digest(empty_url: str) -> None:
    migrate.upgrade(empty_url, INITIAL)
    ckpt_id = str(uuid.uuid4())
    engine = create_catalog_engine(empty_url)
    try:
        with engine.begin() as conn:
            conn.execute(text("INSERT INTO runs (id, name) VALUES (1, 'old-run')"))
            conn.execute(text(
                "INSERT INTO checkpoints (id, run_id, step, version, state, manifest_digest, "
                "codec) VALUES (:id, 1, 7, 1, 'COMMITTED', :digest, 'lz4')"
            ), {"id": ckpt_id, "digest": "ab" * 32})
            for tier in ("hot", "warm"):
                conn.execute(text(
                    "INSERT INTO replicas (checkpoint_id, tier, uri, state, bytes) "
                    "VALUES (:id, :tier, :uri, 'PRESENT', 123)"
                ), {"id": ckpt_id, "tier": tier, "uri": f"{tier}://x"})
    finally:
        engine.dispose()

    migrate.upgrade(empty_url)
    assert migrate.current(empty_url) == migrate.head()
    with Catalog(empty_url, upgrade=False) as cat:
        ck = cat.get_any(ckpt_id)
        assert (ck.run, ck.step, ck.codec) == ("old-run", 7, "lz4")
        assert [(r.tier, r.state, r.bytes, r.manifest_digest) for r in ck.replicas] == [
            ("hot", ReplicaState.PRESENT, 123, None),
            ("warm", ReplicaState.PRESENT, 123, None),
        ]
        # NULL keeps its old meaning: the copy holds the checkpoint's own manifest.
        assert expected_digest(ck, "warm") == "ab" * 32
        got = cat.set_replica(ckpt_id, "warm", state=ReplicaState.PRESENT,
                              manifest_digest="cd" * 32)
        assert got.manifest_digest == "cd" * 32
        assert cat.set_replica(ckpt_id, "warm", state=ReplicaState.PRESENT).manifest_digest \
            == "cd" * 32  # omitted: kept
        assert expected_digest(cat.get_any(ckpt_id), "warm") == "cd" * 32
        assert cat.set_replica(ckpt_id, "warm", state=ReplicaState.PRESENT,
                               manifest_digest=None).manifest_digest is None

    # And back: the downgrade drops only the column.
    migrate.downgrade(empty_url, INITIAL)
    assert migrate.current(empty_url) == INITIAL
    engine = create_catalog_engine(empty_url)
    try:
        with engine.connect() as conn:
            assert conn.execute(text("SELECT count(*) FROM replicas")).scalar_one() == 2
    finally:
        engine.dispose()
