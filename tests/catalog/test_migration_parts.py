"""Revision 9d4a6b1c2e80 (parts, hosts, catalogued manifests) upgrades a populated catalog in
place and downgrades without losing the rows that existed before it."""

from __future__ import annotations

import uuid

from sqlalchemy import inspect, text

from ckptstore.catalog import Catalog, migrate
from ckptstore.catalog.engine import create_catalog_engine
from ckptstore.records import PartSpec, ReplicaState

PREVIOUS = "c18bb4f8a103"
THIS = "9d4a6b1c2e80"


def test_upgrade_keeps_rows_and_downgrade_drops_only_the_new_schema(empty_url: str) -> None:
    migrate.upgrade(empty_url, PREVIOUS)
    old_id = str(uuid.uuid4())
    engine = create_catalog_engine(empty_url)
    try:
        with engine.begin() as conn:
            conn.execute(text("INSERT INTO runs (id, name) VALUES (1, 'old-run')"))
            conn.execute(text(
                "INSERT INTO checkpoints (id, run_id, step, version, state, manifest_digest, "
                "codec) VALUES (:id, 1, 7, 1, 'COMMITTED', :digest, 'lz4')"
            ), {"id": old_id, "digest": "ab" * 32})
            conn.execute(text(
                "INSERT INTO replicas (checkpoint_id, tier, uri, state, bytes) "
                "VALUES (:id, 'hot', '/hot/old-run/x', 'PRESENT', 123)"
            ), {"id": old_id})
    finally:
        engine.dispose()

    # Through THIS to the head: the catalog API refuses any schema older than the head
    # (revisions after THIS, e.g. the remotes table, add tables of their own).
    assert THIS in [info.revision for info in migrate.revisions()]
    migrate.upgrade(empty_url)
    with Catalog(empty_url, upgrade=False) as cat:
        old = cat.get_any(old_id)
        # An existing checkpoint is not parted: its one hot directory holds it all.
        assert old.hosts == () and not old.parted and old.replica("hot").bytes == 123  # type: ignore[union-attr]
        assert cat.parts(old_id) == []
        ck = cat.begin_checkpoint("old-run", 8)
        cat.commit_parted(ck.id, manifest=b"{}", manifest_digest="cd" * 32, logical_bytes=2,
                          stored_bytes=2, parts=[PartSpec("a", (0,), 1, 1),
                                                 PartSpec("b", (1,), 1, 1)])
        cat.set_part(ck.id, "warm", "a", stored_on=None, state=ReplicaState.PRESENT)

    migrate.downgrade(empty_url, PREVIOUS)
    assert migrate.current(empty_url) == PREVIOUS
    engine = create_catalog_engine(empty_url)
    try:
        tables = set(inspect(engine).get_table_names())
        assert not tables & {"replica_parts", "hosts", "checkpoint_manifests"}
        columns = {c["name"] for c in inspect(engine).get_columns("checkpoints")}
        assert "part_hosts" not in columns
        with engine.connect() as conn:
            assert conn.execute(text("SELECT count(*) FROM checkpoints")).scalar_one() == 2
            # Rows that reference checkpoints survive too (a table rebuild would cascade).
            assert conn.execute(text("SELECT count(*) FROM replicas")).scalar_one() == 3
    finally:
        engine.dispose()
    migrate.upgrade(empty_url)
    assert migrate.current(empty_url) == migrate.head()
