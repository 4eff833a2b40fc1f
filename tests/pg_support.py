"""The development PostgreSQL, for every test suite that needs one: reachability and
throwaway databases.

One module so the CI rule (fail, never skip, when ``CI=true``) and the database naming live
in one place. Importable from any test directory (pytest puts ``tests/`` on ``sys.path``).
"""

from __future__ import annotations

import os
import socket
import uuid

import pytest

__all__ = [
    "PG_ADMIN_URL",
    "PG_HOST",
    "PG_PORT",
    "create_pg_database",
    "drop_pg_database",
    "pg_answers",
    "require_pg",
]

PG_HOST, PG_PORT = "127.0.0.1", 5432
PG_ADMIN_URL = f"postgresql+psycopg://postgres@{PG_HOST}:{PG_PORT}/test"


def pg_answers() -> bool:
    """True when something listens on the PostgreSQL port."""
    try:
        with socket.create_connection((PG_HOST, PG_PORT), timeout=1.0):
            return True
    except OSError:
        return False


def require_pg() -> None:
    """Skip when PostgreSQL is not reachable; fail instead when ``CI=true``."""
    if pg_answers():
        return
    message = f"PostgreSQL is not reachable on {PG_HOST}:{PG_PORT}"
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"{message} (CI=true: the PostgreSQL cases must run)")
    pytest.skip(message)


def create_pg_database(prefix: str = "ckpt_test") -> str:
    """Create an empty, uniquely named database (``prefix`` must start with ``ckpt_``);
    returns its URL."""
    from sqlalchemy.engine import make_url

    assert prefix.startswith("ckpt_")
    name = f"{prefix}_{uuid.uuid4().hex[:12]}"
    _admin(f'CREATE DATABASE "{name}"')
    return str(make_url(PG_ADMIN_URL).set(database=name).render_as_string(hide_password=False))


def drop_pg_database(url: str) -> None:
    """Drop a database made by :func:`create_pg_database`, kicking out its sessions."""
    from sqlalchemy.engine import make_url

    name = make_url(url).database
    assert name and name.startswith("ckpt_")
    _admin(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def _admin(statement: str) -> None:
    """Run one statement outside a transaction (CREATE/DROP DATABASE need that)."""
    from sqlalchemy import create_engine, text

    admin = create_engine(PG_ADMIN_URL, isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as conn:
            conn.execute(text(statement))
    finally:
        admin.dispose()
