"""Alembic environment of the ckptstore catalog.

There is no ``alembic.ini``: :mod:`ckptstore.catalog.migrate` builds the Alembic ``Config`` in
code, with ``script_location = "ckptstore.migrations:"`` (a package resource, so it works from
the source tree and from an installed wheel alike). It either hands over an open connection in
``config.attributes["connection"]`` (what ``Catalog.upgrade()`` and ``ckpt db upgrade`` do)
or sets ``sqlalchemy.url``; the URL never comes from a file, so no password is stored in one.

The whole upgrade runs in ONE transaction on both backends: PostgreSQL has transactional DDL,
and SQLite has it too once pysqlite's implicit transaction handling is replaced by our own
``BEGIN IMMEDIATE`` (``ckptstore.catalog.engine``). Concurrent upgrades are serialised: on
SQLite by that write lock, on PostgreSQL by a transaction-level advisory lock, so several
processes opening a fresh catalog at once end with one schema and no error.
"""

from __future__ import annotations

import logging

from alembic import context
from sqlalchemy import Connection, text

from ckptstore.catalog.engine import WRITE_OPTION, create_catalog_engine, mask_url
from ckptstore.catalog.models import Base
from ckptstore.errors import ConfigError

logger = logging.getLogger("ckptstore.migrations")

target_metadata = Base.metadata

# Arbitrary constant shared by every ckptstore process ("ckpt" in ASCII).
_PG_MIGRATION_LOCK = 0x636B7074


def _configure(connection: Connection) -> None:
    sqlite = connection.dialect.name == "sqlite"
    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        # SQLite cannot ALTER most things; batch mode copies the table instead.
        render_as_batch=sqlite,
        # Our manual BEGIN makes SQLite DDL transactional; Alembic assumes it is not.
        transactional_ddl=True,
        compare_type=True,
    )


def _run(connection: Connection) -> None:
    _configure(connection)
    with context.begin_transaction():
        if connection.dialect.name == "postgresql":
            connection.execute(
                text("SELECT pg_advisory_xact_lock(:key)"), {"key": _PG_MIGRATION_LOCK}
            )
        context.run_migrations()


def run_migrations_offline() -> None:
    """Emit the migration SQL as text (``alembic upgrade --sql``)."""
    url = context.config.get_main_option("sqlalchemy.url")
    context.configure(
        url=url,
        target_metadata=target_metadata,
        literal_binds=True,
        render_as_batch=True,
        compare_type=True,
        dialect_opts={"paramstyle": "named"},
    )
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    """Run the migrations on the handed-over connection, or on one to ``sqlalchemy.url``."""
    connection = context.config.attributes.get("connection")
    if connection is not None:
        _run(connection)
        return
    url = context.config.get_main_option("sqlalchemy.url")
    if not url:
        raise ConfigError(
            "no catalog connection: use ckptstore.catalog.upgrade(url) or `ckpt db upgrade`"
        )
    logger.info("migrating catalog %s", mask_url(url))
    engine = create_catalog_engine(url)
    try:
        with engine.connect() as conn:
            conn.execution_options(**{WRITE_OPTION: True})
            _run(conn)
    finally:
        engine.dispose()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
