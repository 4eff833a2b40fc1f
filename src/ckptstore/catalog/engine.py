"""Engine creation for the catalog: SQLite pragmas, write locking, PostgreSQL driver choice.

SQLite (the embedded default) needs care under several writer processes: pysqlite's own
transaction handling does not ``BEGIN`` before a ``SELECT``, so a read-modify-write
(allocating the next version) silently loses updates, and a deferred transaction that read a
stale snapshot fails with "database is locked" the moment it writes, whatever
``busy_timeout`` says. The recipe used here:

* take transaction control away from pysqlite (``isolation_level = None``) and emit ``BEGIN``
  ourselves from the engine's ``begin`` event;
* ``BEGIN IMMEDIATE`` for write transactions (connections carrying the
  :data:`WRITE_OPTION` execution option), which takes the write lock up front and waits up to
  ``busy_timeout`` for it, so concurrent writers queue instead of failing;
* plain deferred ``BEGIN`` for reads, which in WAL mode never block and are never blocked;
* WAL, ``busy_timeout=30000``, ``foreign_keys=ON`` on every new connection.

PostgreSQL uses psycopg 3; version allocation there locks the run row (``SELECT ... FOR
UPDATE``) instead, see ``ckptstore.catalog.checkpoints``. Transactions there go through a
pool that pings each connection before use; the single-statement reads (listings, reference
lookups) go through a second, ``reads`` engine whose connections are in autocommit mode and
are not pinged: a read then costs one round trip to the server instead of four (ping,
``BEGIN``, the query, ``COMMIT``), and its caller retries once on a connection the server had
closed (``CatalogCore._reading``).
"""

from __future__ import annotations

import logging
import sqlite3
import time
from pathlib import Path
from typing import Any
from urllib.parse import quote, unquote

from sqlalchemy import Engine, create_engine, event
from sqlalchemy.engine import URL, Connection, make_url
from sqlalchemy.exc import ArgumentError
from sqlalchemy.pool import StaticPool

from ckptstore.catalog.pg_ids import register_on
from ckptstore.errors import ConfigError
from ckptstore.redact import mask_url, register_secret, split_userinfo

__all__ = ["WRITE_OPTION", "create_catalog_engine", "mask_url", "parse_catalog_url"]

logger = logging.getLogger(__name__)

#: Execution option that marks a connection's transaction as a write (``BEGIN IMMEDIATE``).
WRITE_OPTION = "ckpt_write"

_BUSY_TIMEOUT_MS = 30_000


def parse_catalog_url(url: str | URL) -> URL:
    """Parse and check a catalog URL, choosing psycopg 3 for plain ``postgresql://``.

    A password holding raw ``@``, ``:`` or ``/`` ends at the last ``@`` of the authority,
    the rule :func:`ckptstore.redact.split_userinfo` masks by (SQLAlchemy alone would end it
    at the first ``@`` and take the rest of the password for the host). The password is
    registered with :func:`ckptstore.redact.register_secret`, so no message repeats it.

    Args:
        url: ``sqlite:///path/to/catalog.db``, ``sqlite://`` (in memory, tests only) or
            ``postgresql[+psycopg]://user:password@host:port/db``.

    Returns:
        The parsed URL.

    Raises:
        ConfigError: If the URL cannot be parsed or names another database or driver.
    """
    try:
        parsed = make_url(_with_encoded_userinfo(url) if isinstance(url, str) else url)
    except (ArgumentError, ValueError):
        # Not chained: SQLAlchemy's message quotes the whole URL, password included.
        raise ConfigError(
            f"cannot parse catalog URL {mask_url(url)!r}: use sqlite:///path/to/catalog.db or "
            "postgresql+psycopg://user@host:5432/db (characters such as @ : / in the "
            "password may be written as %40 %3A %2F)"
        ) from None
    register_secret(parsed.password if isinstance(parsed.password, str) else None)
    backend, driver = parsed.get_backend_name(), parsed.get_driver_name()
    if backend == "postgresql":
        if parsed.drivername == "postgresql":
            parsed = parsed.set(drivername="postgresql+psycopg")
        elif driver != "psycopg":
            raise ConfigError(
                f"catalog URL {mask_url(parsed)!r} uses driver {driver!r}; "
                "use postgresql+psycopg:// (psycopg 3)"
            )
    elif backend != "sqlite":
        raise ConfigError(
            f"unsupported catalog database in {mask_url(parsed)!r}: use sqlite:///path or "
            "postgresql+psycopg://..."
        )
    return parsed


def _with_encoded_userinfo(url: str) -> str:
    """``url`` with its user name and password percent-encoded, cut at the authority's last
    ``@`` (unchanged when there is no password, or nothing in the userinfo needs it)."""
    parts = split_userinfo(url)
    if parts is None or parts.password is None:
        return url
    user, password = unquote(parts.user), unquote(parts.password)
    register_secret(parts.password)
    if "@" not in parts.user + parts.password:
        return url
    return f"{parts.head}{quote(user, safe='')}:{quote(password, safe='')}@{parts.rest}"


def _sqlite_on_connect(dbapi_conn: Any, _record: Any) -> None:
    # We issue BEGIN ourselves (see _sqlite_on_begin); pysqlite must not.
    dbapi_conn.isolation_level = None
    cur = dbapi_conn.cursor()
    try:
        # busy_timeout first: switching to WAL needs a lock another process may hold.
        cur.execute(f"PRAGMA busy_timeout={_BUSY_TIMEOUT_MS}")
        _switch_to_wal(cur)
        # FULL, not NORMAL: a COMMITTED flip must survive a power cut, otherwise a checkpoint
        # whose files were fsynced could revert to PENDING and be garbage-collected. Catalog
        # writes are a handful per checkpoint, so the extra fsync is cheap.
        cur.execute("PRAGMA synchronous=FULL")
        cur.execute("PRAGMA foreign_keys=ON")
    finally:
        cur.close()


def _switch_to_wal(cur: Any) -> None:
    """``PRAGMA journal_mode=WAL``, retried while another process holds the database.

    On a brand-new database file, SQLite answers "database is locked" at once, without
    calling the busy handler, when another connection is switching the journal mode or
    creating the schema at the same moment: several processes opening one fresh catalog
    would fail at random. The wait is bounded (~10 s).
    """
    for attempt in range(100):
        try:
            cur.execute("PRAGMA journal_mode=WAL")
            return
        except sqlite3.OperationalError as exc:
            if "locked" not in str(exc) or attempt == 99:
                raise
            time.sleep(0.1)


def _sqlite_on_begin(conn: Connection) -> None:
    if conn.get_execution_options().get(WRITE_OPTION):
        conn.exec_driver_sql("BEGIN IMMEDIATE")
    else:
        conn.exec_driver_sql("BEGIN")


def create_catalog_engine(url: str | URL, *, echo: bool = False, reads: bool = False) -> Engine:
    """Create the SQLAlchemy engine for a catalog URL.

    For SQLite the parent directory of the database file is created, and the pragmas and
    ``BEGIN`` handling described in the module docstring are installed. For PostgreSQL the
    pool pings connections before use, so a restarted server does not surface as an error
    on the next call.

    Args:
        url: The catalog URL (see :func:`parse_catalog_url`).
        echo: Log every SQL statement (debugging).
        reads: PostgreSQL only: the engine of single-statement reads (autocommit, no ping;
            its user retries a statement that met a closed connection). A small pool: one
            connection per thread reading at the same moment.

    Returns:
        A thread-safe engine. Pass ``execution_options={WRITE_OPTION: True}`` when procuring
        a connection for a write transaction.

    Raises:
        ConfigError: If the URL is not a supported catalog URL.
    """
    parsed = parse_catalog_url(url)
    if parsed.get_backend_name() == "sqlite":
        database = parsed.database or ""
        if database in ("", ":memory:"):
            # One shared connection, or every checkout would see a different empty database.
            engine = create_engine(
                parsed,
                echo=echo,
                poolclass=StaticPool,
                connect_args={"check_same_thread": False},
            )
        else:
            if not database.startswith("file:"):
                Path(database).expanduser().parent.mkdir(parents=True, exist_ok=True)
            engine = create_engine(
                parsed,
                echo=echo,
                pool_size=5,
                max_overflow=10,
                # Connections are handed between threads by the pool, never shared at once.
                connect_args={"check_same_thread": False, "timeout": _BUSY_TIMEOUT_MS / 1000},
            )
        event.listen(engine, "connect", _sqlite_on_connect)
        event.listen(engine, "begin", _sqlite_on_begin)
    elif reads:
        engine = create_engine(
            parsed,
            echo=echo,
            isolation_level="AUTOCOMMIT",
            pool_size=2,
            max_overflow=10,
            connect_args={"connect_timeout": 10},
        )
    else:
        engine = create_engine(
            parsed,
            echo=echo,
            pool_pre_ping=True,
            pool_size=5,
            max_overflow=10,
            connect_args={"connect_timeout": 10},
        )
    if parsed.get_backend_name() != "sqlite":
        event.listen(engine, "connect", register_on)
    logger.debug("catalog engine created for %s", mask_url(parsed))
    return engine
