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

import os
import shutil
import socket
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url
from sqlalchemy.pool import NullPool

from ckptstore.catalog import Catalog, migrate
from ckptstore.records import Checkpoint

PG_HOST, PG_PORT = "127.0.0.1", 5432
PG_ADMIN_URL = f"postgresql+psycopg://postgres@{PG_HOST}:{PG_PORT}/test"

# Dependents first, so TRUNCATE order never matters even without CASCADE.
TABLES = (
    "leases",
    "events",
    "aliases",
    "lineage_edges",
    "replicas",
    "checkpoint_metrics",
    "checkpoint_tags",
    "checkpoints",
    "runs",
    "experiments",
)


def pg_answers() -> bool:
    """True when something listens on the PostgreSQL port."""
    try:
        with socket.create_connection((PG_HOST, PG_PORT), timeout=1.0):
            return True
    except OSError:
        return False


def require_pg() -> None:
    """Skip (or fail on CI) when PostgreSQL is not reachable."""
    if pg_answers():
        return
    message = f"PostgreSQL is not reachable on {PG_HOST}:{PG_PORT}"
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"{message} (CI=true: the PostgreSQL suite must run)")
    pytest.skip(message)


def create_pg_database(prefix: str = "ckpt_test") -> str:
    """Create a uniquely named database; returns its URL."""
    name = f"{prefix}_{uuid.uuid4().hex[:12]}"
    admin = create_engine(PG_ADMIN_URL, isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as conn:
            conn.execute(text(f'CREATE DATABASE "{name}"'))
    finally:
        admin.dispose()
    return str(make_url(PG_ADMIN_URL).set(database=name).render_as_string(hide_password=False))


def drop_pg_database(url: str) -> None:
    """Drop a database created by :func:`create_pg_database` (kicking out its sessions)."""
    name = make_url(url).database
    assert name and name.startswith("ckpt_")
    admin = create_engine(PG_ADMIN_URL, isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
    finally:
        admin.dispose()


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
