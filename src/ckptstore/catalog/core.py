"""The catalog's plumbing: engine, one-transaction-per-call sessions, shared helpers.

Every public :class:`~ckptstore.catalog.Catalog` method runs in exactly one short transaction,
opened by :meth:`CatalogCore._read` or :meth:`CatalogCore._write`, or, for the reads whose
answer is one statement (listings, resolving a reference), on a connection of its own
outside any transaction on PostgreSQL (:meth:`CatalogCore._reading`). Write transactions take the
SQLite write lock up front (``BEGIN IMMEDIATE``, see :mod:`ckptstore.catalog.engine`); on
PostgreSQL the methods that read-then-write lock the rows they depend on explicitly.
Nothing here ever holds a transaction open across I/O outside the database.
"""

from __future__ import annotations

import getpass
import logging
import os
import socket
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from datetime import datetime
from types import TracebackType
from typing import Any, Literal, TypeVar

from sqlalchemy import Engine, func, insert, select
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import Connection
from sqlalchemy.exc import DBAPIError, InterfaceError, OperationalError
from sqlalchemy.orm import Session, sessionmaker

from ckptstore.catalog import migrate
from ckptstore.catalog.checks import check_checkpoint_id
from ckptstore.catalog.engine import WRITE_OPTION, create_catalog_engine
from ckptstore.catalog.models import Base, EventRow, RunRow, utcnow
from ckptstore.errors import (
    CheckpointNotFoundError,
    ConfigError,
    InvalidNameError,
    StorageError,
)
from ckptstore.format.gcpause import gc_paused
from ckptstore.redact import mask_url, scrub
from ckptstore.refs import Ref, parse_ref

__all__ = [
    "MAX_BOUND_IDS",
    "CatalogCore",
    "checkpoint_id_batches",
    "default_actor",
    "default_writer",
    "name_list",
    "names_hint",
    "runs_hint",
]

logger = logging.getLogger("ckptstore.catalog")

_T = TypeVar("_T")

#: Most ids bound in one ``IN (...)`` list. Both backends cap the parameters of one statement
#: (SQLite 32,766, PostgreSQL 65,535); methods taking id sets query in batches of this size,
#: so the sets a caller can pass have no limit and the usual sizes still cost one query.
MAX_BOUND_IDS = 5000


def checkpoint_id_batches(ids: Iterable[object]) -> list[list[str]]:
    """Validated, de-duplicated checkpoint ids in sorted batches of :data:`MAX_BOUND_IDS`.

    Raises:
        InvalidNameError: If ``ids`` is a bare string or holds something that is not a uuid.
    """
    if isinstance(ids, str | bytes):
        # A lone id would otherwise be read as a sequence of characters.
        raise InvalidNameError("pass checkpoint ids as a list or set, not a single string")
    wanted = sorted({check_checkpoint_id(i) for i in ids})
    return [wanted[i : i + MAX_BOUND_IDS] for i in range(0, len(wanted), MAX_BOUND_IDS)]


def default_writer() -> str:
    """``host:pid`` of this process, recorded on the checkpoints it saves."""
    return f"{socket.gethostname()}:{os.getpid()}"


def default_actor() -> str:
    """``user@host`` for the audit log."""
    try:
        user = getpass.getuser()
    except (KeyError, OSError):  # no passwd entry (containers) and no $USER
        user = "unknown"
    return f"{user}@{socket.gethostname()}"


def name_list(names: Sequence[object], *, limit: int = 20, total: int | None = None) -> str:
    """``"a, b, c"``, shortened to ``limit`` items plus a count for long lists."""
    shown = ", ".join(str(n) for n in names[:limit])
    count = len(names) if total is None else total
    if count > limit:
        shown += f", ... ({count} in total)"
    return shown


def names_hint(
    session: Session | Connection, column: Any, what: str, *, limit: int = 20
) -> str | None:
    """``"<what>: a, b, ..."`` of the first names in a column, or None when there are none.

    Only ``limit + 1`` names are read; the total is counted only when there are more.
    """
    names = list(session.scalars(select(column).order_by(column).limit(limit + 1)))
    if not names:
        return None
    total = None
    if len(names) > limit:
        total = session.scalar(select(func.count()).select_from(column.class_))
    return f"{what}: {name_list(names, limit=limit, total=total)}"


def runs_hint(session: Session | Connection) -> str:
    """``"runs: a, b, ..."`` or ``"no runs exist yet"``, for not-found messages."""
    return names_hint(session, RunRow.name, "runs") or "no runs exist yet"


class CatalogCore:
    """Engine, sessions and helpers shared by the catalog's method groups.

    Args:
        url: Catalog URL, ``sqlite:///path/catalog.db`` or
            ``postgresql+psycopg://user:password@host:5432/db``.
        upgrade: Bring the schema to the newest revision on open (``alembic upgrade head``).
            With False, a catalog that is not at the expected revision is refused.

    Raises:
        ConfigError: If the URL is not a supported catalog URL, or the schema is not at the
            revision this code expects and ``upgrade`` is False.
        StorageError: If the database cannot be reached.
    """

    def __init__(self, url: str, *, upgrade: bool = True) -> None:
        self._engine: Engine = create_catalog_engine(url)
        self._url = mask_url(self._engine.url)
        self._sessions = sessionmaker(self._engine, expire_on_commit=False, autoflush=False)
        # How config listings read a filter's checkpoints, as its last count of matching
        # runs chose, until when (queries.QueriesMixin.list): (filter, limited) -> plan.
        self._config_plans: dict[tuple[object, bool], tuple[str, float]] = {}
        # SQLite reads cost no round trips: one engine serves both paths there.
        self._reader: Engine = (
            create_catalog_engine(url, reads=True)
            if self._engine.dialect.name == "postgresql"
            else self._engine
        )
        try:
            self._check_schema(upgrade)
        except BaseException:
            self.close()
            raise
        logger.debug("opened catalog %s", self._url)

    def _check_schema(self, upgrade: bool) -> None:
        # Comparing revisions first keeps opening an up-to-date catalog to one cheap query.
        expected = migrate.head()
        found = migrate.current(self._engine)
        if found == expected:
            return
        if upgrade:
            migrate.upgrade(self._engine)
            return
        raise ConfigError(
            f"catalog {self._url} is at schema revision {found or '<empty>'}, this version of "
            f"ckptstore needs {expected}; run `ckpt db upgrade`"
        )

    # ------------------------------------------------------------------ properties, life cycle
    @property
    def url(self) -> str:
        """The catalog URL with its password masked (safe to log and print)."""
        return self._url

    @property
    def dialect(self) -> Literal["sqlite", "postgresql"]:
        """``"sqlite"`` or ``"postgresql"``."""
        return "sqlite" if self._engine.dialect.name == "sqlite" else "postgresql"

    @property
    def engine(self) -> Engine:
        """The SQLAlchemy engine (for tests, benchmarks and migrations)."""
        return self._engine

    def upgrade(self) -> None:
        """Bring the schema to the newest revision (no-op when it is there)."""
        migrate.upgrade(self._engine)

    def close(self) -> None:
        """Close every pooled connection. The object must not be used afterwards."""
        self._engine.dispose()
        if self._reader is not self._engine:
            self._reader.dispose()

    def __enter__(self) -> CatalogCore:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._url!r})"

    # ------------------------------------------------------------------ transactions
    @contextmanager
    def _session(self, *, write: bool) -> Iterator[Session]:
        try:
            with self._sessions() as session, session.begin():
                if write:
                    # The session acquires its connection lazily: procure it now, flagged,
                    # so the engine's begin hook emits BEGIN IMMEDIATE before any statement.
                    session.connection(execution_options={WRITE_OPTION: True})
                yield session
        except (OperationalError, InterfaceError) as e:
            # The driver's message names host and database; scrubbed in case it repeats a
            # URL or a DSN fragment with the password.
            raise StorageError(f"catalog {self._url} failed: {scrub(str(e.orig))}") from e

    @contextmanager
    def _read(self) -> Iterator[Session]:
        """One read-only transaction (deferred ``BEGIN`` on SQLite: never waits for writers)."""
        with self._session(write=False) as session:
            yield session

    def _reading(self, query: Callable[[Connection], _T]) -> _T:
        """``query(connection)`` for a read whose answer is one statement (or a few
        independent ones).

        On PostgreSQL the connection is in autocommit mode and was not pinged: the read
        costs one round trip per statement instead of four (ping, ``BEGIN``, the query,
        ``COMMIT``), which was most of a listing's time. Each statement sees its own
        snapshot, so ``query`` must not need two statements to agree. A connection the
        server closed meanwhile (a restart, an idle timeout) fails its first statement and
        invalidates the pool; the query is then run once more on a fresh connection.
        """
        # The cyclic collector is paused for the whole read (statement, rows, records), not
        # only while records are built: a collection that came due in the middle found a
        # long answer (a 1,000-deep lineage: ~3,000 records) alive and promoted it, and the
        # promotions set off full collections over every object of the process, 11 in 400
        # lineage walks (2 with the pause), each longer than the walk itself. What a read
        # allocates holds no cycles; once the caller drops the answer, reference counting
        # frees it.
        with gc_paused():
            for attempt in (1, 2):
                try:
                    with self._reader.connect() as conn:
                        return query(conn)
                except DBAPIError as e:
                    if attempt == 1 and e.connection_invalidated:
                        logger.debug("catalog %s: connection lost, reading again", self._url)
                        continue
                    if isinstance(e, OperationalError | InterfaceError):
                        raise StorageError(
                            f"catalog {self._url} failed: {scrub(str(e.orig))}") from e
                    raise
        raise AssertionError("unreachable")  # pragma: no cover

    @contextmanager
    def _write(self) -> Iterator[Session]:
        """One write transaction (``BEGIN IMMEDIATE`` on SQLite: writers queue, never fail)."""
        with self._session(write=True) as session:
            yield session

    # ------------------------------------------------------------------ helpers
    def _insert(self, table: type[Base]) -> postgresql.Insert | sqlite.Insert:
        """A dialect-specific ``INSERT`` supporting ``ON CONFLICT`` (both backends have it)."""
        if self._engine.dialect.name == "postgresql":
            return postgresql.insert(table)
        return sqlite.insert(table)

    @staticmethod
    def _ref(ref: str | Ref) -> Ref:
        return ref if isinstance(ref, Ref) else parse_ref(ref)

    def _run_id(self, session: Session, name: str, *, lock: bool = False) -> int:
        """Id of run ``name``; with ``lock``, the row is locked until the transaction ends."""
        stmt = select(RunRow.id).where(RunRow.name == name)
        if lock:
            # FOR NO KEY UPDATE: serialises version allocation but, unlike FOR UPDATE, does
            # not block inserts whose foreign keys merely reference the run.
            stmt = stmt.with_for_update(key_share=True)
        run_id = session.scalar(stmt)
        if run_id is None:
            raise CheckpointNotFoundError(f"run {name!r} does not exist; {runs_hint(session)}")
        return run_id

    @staticmethod
    def _add_event(
        session: Session,
        kind: str,
        *,
        checkpoint_id: str | None = None,
        run_id: int | None = None,
        actor: str | None = None,
        detail: dict[str, Any] | None = None,
    ) -> datetime:
        """Append an audit-log entry inside the caller's transaction; returns its time."""
        at = utcnow()
        session.execute(
            insert(EventRow).values(
                kind=kind,
                checkpoint_id=checkpoint_id,
                run_id=run_id,
                actor=actor or default_actor(),
                detail=detail or {},
                at=at,
            )
        )
        return at
