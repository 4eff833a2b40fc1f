"""The schema comes only from Alembic, round-trips, and matches the models on both backends."""

from __future__ import annotations

import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import Column, Integer, MetaData, Table, inspect

from ckptstore.catalog import Catalog, migrate
from ckptstore.catalog.engine import create_catalog_engine
from ckptstore.catalog.models import Base
from ckptstore.errors import ConfigError

TABLES = set(Base.metadata.tables)


def _diff(url: str, metadata: MetaData = Base.metadata) -> list[object]:
    engine = create_catalog_engine(url)
    try:
        with engine.connect() as conn:
            ctx = MigrationContext.configure(conn, opts={"compare_type": True})
            return list(compare_metadata(ctx, metadata))
    finally:
        engine.dispose()


def _tables(url: str) -> set[str]:
    engine = create_catalog_engine(url)
    try:
        return set(inspect(engine).get_table_names())
    finally:
        engine.dispose()


def test_upgrade_downgrade_upgrade_roundtrip(empty_url: str) -> None:
    # One database per backend covers the whole round trip (creating one costs ~0.5 s on PG).
    assert migrate.current(empty_url) is None
    migrate.upgrade(empty_url)
    assert migrate.current(empty_url) == migrate.head()
    assert _tables(empty_url) >= TABLES
    assert _diff(empty_url) == [], "models and migrations disagree"

    # Guard against a vacuous "no diff": a table the migrations lack must show up.
    extra = MetaData()
    for table in Base.metadata.tables.values():
        table.to_metadata(extra)
    Table("not_migrated", extra, Column("id", Integer, primary_key=True))
    assert any(op[0] == "add_table" for op in _diff(empty_url, extra) if isinstance(op, tuple))

    migrate.downgrade(empty_url, "base")
    assert migrate.current(empty_url) is None
    assert _tables(empty_url) <= {"alembic_version"}

    migrate.upgrade(empty_url)
    assert migrate.current(empty_url) == migrate.head()
    assert _diff(empty_url) == []


def test_catalog_open_upgrades_and_upgrade_is_idempotent(empty_url: str) -> None:
    with Catalog(empty_url) as cat:
        assert migrate.current(cat.engine) == migrate.head()
        cat.upgrade()
        assert cat.runs() == []
    migrate.upgrade(empty_url)
    assert migrate.current(empty_url) == migrate.head()


def test_open_without_upgrade_refuses_an_empty_schema(empty_url: str) -> None:
    with pytest.raises(ConfigError, match="ckpt db upgrade"):
        Catalog(empty_url, upgrade=False)


def test_history_lists_the_initial_revision() -> None:
    infos = migrate.revisions()
    assert infos[0].down_revision is None
    assert infos[-1].is_head and infos[-1].revision == migrate.head()
    lines = migrate.history()
    assert len(lines) == len(infos)
    assert "initial catalog" in lines[0] and "(head)" in lines[-1]


def test_script_location_is_the_package_resource() -> None:
    cfg = migrate.alembic_config()
    assert cfg.get_main_option("script_location") == "ckptstore.migrations:"
