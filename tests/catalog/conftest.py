"""Catalog fixtures: every test runs on SQLite AND PostgreSQL through ``catalog_url``.

SQLite: one schema is built per session by ``alembic upgrade head`` into a template file,
and each test gets a copy (a copy costs a millisecond, an upgrade tens).

PostgreSQL (127.0.0.1:5432, database ``test`` used only as the maintenance database): one
``ckpt_test_<random>`` database per session, upgraded once, dropped at the end; tables are
truncated before each test. When the server does not answer, PostgreSQL cases are skipped,
or fail when ``CI=true`` (CI must not silently lose half the matrix).

Schemas are only ever created through the migrations, never with ``create_all``.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from pg_support import create_pg_database, drop_pg_database, require_pg
from sqlalchemy import create_engine, text
from sqlalchemy.pool import NullPool

from ckptstore.catalog import Catalog, migrate
from ckptstore.records import Checkpoint

# Dependents first, so TRUNCATE order never matters even without CASCADE.
TABLES = (
    "metric_history",
    "replica_parts",
    "checkpoint_manifests",
    "hosts",
    "leases",
    "events",
    "aliases",
    "lineage_edges",
    "replicas",
    "checkpoint_metrics",
    "checkpoint_tags",
    "checkpoints",
    "run_contexts",
    "context_blobs",
    "runs",
    "experiments",
    # Which store the catalog belongs to: emptied too, so each test's store adopts it.
    "store_meta",
)


@pytest.fixture(scope="session")
def sqlite_template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A SQLite catalog file at schema head, built once per session."""
    path = tmp_path_factory.mktemp("catalog-template") / "catalog.db"
    migrate.upgrade(f"sqlite:///{path}")
    # The engine was disposed by upgrade(): the WAL is checkpointed into the main file.
    return path


@pytest.fixture(scope="session")
def pg_session_url() -> Iterator[str]:
    """One fresh PostgreSQL database at schema head for the whole session."""
    require_pg()
    url = create_pg_database()
    try:
        migrate.upgrade(url)
        yield url
    finally:
        drop_pg_database(url)


_CLEANERS: dict[str, Any] = {}


def truncate_all(url: str) -> None:
    """Empty every catalog table (keeps the schema and alembic_version).

    DELETE, not TRUNCATE: on tables this small TRUNCATE is ~20x slower, because it swaps in
    new files for every table.
    """
    engine = _CLEANERS.get(url)
    if engine is None:
        engine = _CLEANERS[url] = create_engine(url, poolclass=NullPool)
    with engine.begin() as conn:
        for table in TABLES:
            conn.execute(text(f"DELETE FROM {table}"))


@pytest.fixture
def fresh_pg_database() -> Iterator[Callable[[], str]]:
    """Factory of EMPTY PostgreSQL databases, each dropped after the test."""
    require_pg()
    created: list[str] = []

    def _create() -> str:
        url = create_pg_database("ckpt_fresh")
        created.append(url)
        return url

    try:
        yield _create
    finally:
        for url in created:
            drop_pg_database(url)


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)])
def empty_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """URL of an EMPTY database (no schema yet) on each backend."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'nested' / 'dir' / 'catalog.db'}"
    factory: Callable[[], str] = request.getfixturevalue("fresh_pg_database")
    return factory()


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)])
def catalog_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """URL of an empty catalog at schema head, on each backend."""
    if request.param == "sqlite":
        template: Path = request.getfixturevalue("sqlite_template")
        path = tmp_path / "catalog" / "catalog.db"
        path.parent.mkdir()
        shutil.copyfile(template, path)
        return f"sqlite:///{path}"
    url: str = request.getfixturevalue("pg_session_url")
    truncate_all(url)
    return url


@pytest.fixture
def catalog(catalog_url: str) -> Iterator[Catalog]:
    """An open :class:`Catalog` on an empty database."""
    cat = Catalog(catalog_url)
    try:
        yield cat
    finally:
        cat.close()


SaveFn = Callable[..., Checkpoint]


@pytest.fixture
def save(catalog: Catalog) -> SaveFn:
    """``save(run, step, **begin_kwargs)``: begin + commit a checkpoint in one call."""

    def _save(run: str, step: int, *, stored_bytes: int = 100, **kwargs: Any) -> Checkpoint:
        ck = catalog.begin_checkpoint(run, step, **kwargs)
        return catalog.commit_checkpoint(
            ck.id,
            manifest_digest=f"blake3:{ck.id}",
            logical_bytes=stored_bytes * 2,
            stored_bytes=stored_bytes,
            tier=kwargs.get("tier", "hot"),
        )

    return _save
