"""Schema migrations of the catalog, driven from code (``ckpt db upgrade``, ``current``, ...).

The schema is created only by the Alembic revisions in ``ckptstore.migrations``; there is no
``alembic.ini``. :func:`alembic_config` builds the configuration in code and points
``script_location`` at the package resource ``ckptstore.migrations:``, which resolves both in
a source checkout and in an installed wheel.

An empty SQLite catalog brought to ``head`` gets the schema that ``alembic upgrade head``
built once in this process, in memory: its ``CREATE`` statements and rows (the
``alembic_version`` row) are replayed in the same write transaction the revisions would have
run in (:func:`_replay_head`). A process that creates many catalogs (a test suite, a
benchmark) pays for the revision chain once, not per catalog (tens of milliseconds each);
the schema is still only ever made by the revisions.
"""

from __future__ import annotations

import functools
import logging
import re
import threading
import time
from dataclasses import dataclass
from importlib import resources
from typing import TYPE_CHECKING

from sqlalchemy import Connection, Engine, inspect
from sqlalchemy.engine import URL
from sqlalchemy.exc import DBAPIError, OperationalError

from ckptstore.catalog.engine import WRITE_OPTION, create_catalog_engine
from ckptstore.errors import StorageError
from ckptstore.redact import mask_url, scrub

if TYPE_CHECKING:
    from alembic.config import Config
    from alembic.script import ScriptDirectory

# Alembic itself is imported only where a command runs or the revision graph is walked:
# opening an up-to-date catalog reads the head from the revision files and the current
# revision with one query, so `ckpt ls` never pays for importing Alembic.

__all__ = [
    "SCRIPT_LOCATION",
    "MigrationInfo",
    "alembic_config",
    "current",
    "downgrade",
    "head",
    "history",
    "revisions",
    "upgrade",
]

logger = logging.getLogger(__name__)

#: Retries (0.1 s apart) of a schema-revision read that SQLite refuses as locked.
_LOCKED_RETRIES = 100

#: Where the revisions live, as a package resource (works from a wheel too).
SCRIPT_LOCATION = "ckptstore.migrations:"

# Alembic keeps the running migration's context in module globals (alembic.context), so two
# threads of one process must not run commands at once. Processes are serialised by the
# database itself (see migrations/env.py).
_COMMAND_LOCK = threading.Lock()


@dataclass(frozen=True)
class MigrationInfo:
    """One revision, as ``ckpt db history`` shows it."""

    revision: str
    down_revision: str | None
    message: str
    is_head: bool

    def __str__(self) -> str:
        down = self.down_revision or "<base>"
        head = " (head)" if self.is_head else ""
        return f"{down} -> {self.revision}{head}, {self.message}"


def alembic_config(url: str | URL | None = None) -> Config:
    """Build the Alembic configuration in code.

    Args:
        url: Optional catalog URL for ``sqlalchemy.url`` (only needed by raw ``alembic.command``
            calls without a connection; our helpers pass a connection instead).

    Returns:
        A :class:`alembic.config.Config` whose ``script_location`` is the migrations package.
    """
    from alembic.config import Config

    cfg = Config()
    cfg.set_main_option("script_location", SCRIPT_LOCATION)
    # Date-prefixed revision files, e.g. versions/20260101_initial_catalog.py.
    cfg.set_main_option("file_template", "%%(year)d%%(month).2d%%(day).2d_%%(slug)s")
    if url is not None:
        # ConfigParser interpolates '%': escape it (URL-encoded passwords contain '%').
        text = url if isinstance(url, str) else url.render_as_string(hide_password=False)
        cfg.set_main_option("sqlalchemy.url", text.replace("%", "%%"))
    return cfg


@functools.cache
def _script() -> ScriptDirectory:
    # Loading the revision modules costs milliseconds.
    from alembic.script import ScriptDirectory

    return ScriptDirectory.from_config(alembic_config())


_REVISION = re.compile(r"^revision\s*(?::[^=]*)?=\s*[\"']([0-9A-Za-z_]+)[\"']\s*$", re.M)
_DOWN = re.compile(r"^down_revision\s*(?::[^=]*)?=\s*(.+?)\s*$", re.M)
_QUOTED = re.compile(r"[\"']([0-9A-Za-z_]+)[\"']")


@functools.cache
def _head_from_files() -> str | None:
    """The single head read from the revision files' ``revision`` and ``down_revision``
    lines, without importing Alembic or the revisions; None when the files do not say it
    plainly (then Alembic walks the graph)."""
    revisions: set[str] = set()
    downs: set[str] = set()
    try:
        versions = resources.files("ckptstore.migrations").joinpath("versions")
        for entry in versions.iterdir():
            if not entry.name.endswith(".py") or entry.name.startswith("__"):
                continue
            text = entry.read_text(encoding="utf-8")
            found, down = _REVISION.findall(text), _DOWN.findall(text)
            if len(found) != 1 or len(down) != 1:
                return None
            revisions.add(found[0])
            downs.update(_QUOTED.findall(down[0]))
    except (OSError, ModuleNotFoundError):
        return None
    heads = revisions - downs
    return heads.pop() if len(heads) == 1 and downs <= revisions else None


def head() -> str:
    """The revision id the code expects (the single head of the revision graph)."""
    rev = _head_from_files() or _script().get_current_head()
    assert rev is not None, "ckptstore.migrations has no revisions"
    return rev


def revisions() -> list[MigrationInfo]:
    """All revisions shipped with this version, oldest first.

    Returns:
        One :class:`MigrationInfo` per revision.
    """
    script = _script()
    heads = set(script.get_heads())
    infos = []
    for rev in script.walk_revisions():
        down = rev.down_revision
        infos.append(
            MigrationInfo(
                revision=rev.revision,
                down_revision=down if isinstance(down, str) or down is None else ",".join(down),
                message=(rev.doc or "").strip(),
                is_head=rev.revision in heads,
            )
        )
    infos.reverse()
    return infos


def history() -> list[str]:
    """One printable line per revision, oldest first (what ``ckpt db history`` prints).

    Returns:
        Lines such as ``"<base> -> 3f2c9a1e7b40 (head), initial catalog"``.
    """
    return [str(info) for info in revisions()]


def _with_engine(url: str | URL | Engine) -> tuple[Engine, bool]:
    if isinstance(url, Engine):
        return url, False
    return create_catalog_engine(url), True


def current(url: str | URL | Engine) -> str | None:
    """The revision the catalog database is at.

    Args:
        url: A catalog URL or an engine created by :func:`create_catalog_engine`.

    Returns:
        The revision id, or None for an empty database.

    Raises:
        StorageError: If the database cannot be reached.
    """
    engine, own = _with_engine(url)
    try:
        # A brand-new SQLite file that another process is creating the schema in can answer
        # "database is locked" without waiting (SQLite skips the busy handler there): retry
        # for a bounded time.
        for attempt in range(_LOCKED_RETRIES + 1):
            try:
                with engine.connect() as conn:
                    return _current_revision(conn)
            except OperationalError as e:
                if "locked" not in str(e.orig) or attempt == _LOCKED_RETRIES:
                    raise
                time.sleep(0.1)
        raise AssertionError("unreachable")
    except DBAPIError as e:
        raise StorageError(
            f"cannot read the schema revision of catalog {mask_url(engine.url)}: "
            f"{scrub(str(e.orig))}"
        ) from e
    finally:
        if own:
            engine.dispose()


def _current_revision(conn: Connection) -> str | None:
    """The ``alembic_version`` row, read with one query (Alembic's own reader for anything
    but a single row)."""
    if not inspect(conn).has_table("alembic_version"):
        return None
    rows = conn.exec_driver_sql("SELECT version_num FROM alembic_version").all()
    if len(rows) == 1:
        return str(rows[0][0])
    from alembic.runtime.migration import MigrationContext

    return MigrationContext.configure(conn).get_current_revision()


def _run_command(url: str | URL | Engine, action: str, revision: str) -> None:
    from alembic import command

    engine, own = _with_engine(url)
    cfg = alembic_config()
    try:
        with _COMMAND_LOCK, engine.connect() as conn:
            # A write transaction: BEGIN IMMEDIATE on SQLite serialises concurrent upgrades.
            conn.execution_options(**{WRITE_OPTION: True})
            with conn.begin():
                if action == "upgrade" and revision == "head" and _empty_sqlite(conn):
                    _replay_head(conn)
                    return
                cfg.attributes["connection"] = conn
                if action == "upgrade":
                    command.upgrade(cfg, revision)
                else:
                    command.downgrade(cfg, revision)
    except DBAPIError as e:
        raise StorageError(
            f"catalog {mask_url(engine.url)}: {action} to {revision} failed: "
            f"{scrub(str(e.orig))}"
        ) from e
    finally:
        if own:
            engine.dispose()


@dataclass(frozen=True)
class _Schema:
    """What ``alembic upgrade head`` leaves in an empty SQLite database."""

    statements: tuple[str, ...]  # CREATE TABLE first, then indexes, views, triggers
    rows: tuple[tuple[str, tuple[tuple[object, ...], ...]], ...]  # (table, its rows)


#: The head schema per head revision, built once per process (under ``_COMMAND_LOCK``).
_HEAD_SCHEMAS: dict[str, _Schema] = {}


def _empty_sqlite(conn: Connection) -> bool:
    """A SQLite database without a single table, index or view (read inside the write
    transaction, so no other process can be creating the schema meanwhile)."""
    if conn.dialect.name != "sqlite":
        return False
    return conn.exec_driver_sql("SELECT count(*) FROM sqlite_master").scalar() == 0


def _head_schema() -> _Schema:
    """Run ``alembic upgrade head`` on an in-memory SQLite database (once per head revision
    and process) and read back its schema and rows."""
    rev = head()
    schema = _HEAD_SCHEMAS.get(rev)
    if schema is not None:
        return schema
    engine = create_catalog_engine("sqlite://")
    try:
        with engine.connect() as conn:
            conn.execution_options(**{WRITE_OPTION: True})
            with conn.begin():
                from alembic import command

                cfg = alembic_config()
                cfg.attributes["connection"] = conn
                command.upgrade(cfg, rev)
            entries = conn.exec_driver_sql(
                "SELECT type, name, sql FROM sqlite_master "
                "WHERE sql IS NOT NULL AND name NOT LIKE 'sqlite^_%' ESCAPE '^' ORDER BY rowid"
            ).all()
            order = {"table": 0, "index": 1, "view": 2, "trigger": 3}
            statements = tuple(
                sql for _kind, _name, sql in sorted(entries, key=lambda e: order[e[0]]))
            tables = [name for kind, name, _sql in entries if kind == "table"]
            if conn.exec_driver_sql(
                    "SELECT 1 FROM sqlite_master WHERE name = 'sqlite_sequence'").first():
                tables.append("sqlite_sequence")  # AUTOINCREMENT counters, created with them
            rows = tuple(
                (table, tuple(tuple(r) for r in conn.exec_driver_sql(
                    f'SELECT * FROM "{table}"').all()))
                for table in tables
            )
    finally:
        engine.dispose()
    schema = _HEAD_SCHEMAS[rev] = _Schema(statements, tuple(r for r in rows if r[1]))
    return schema


def _replay_head(conn: Connection) -> None:
    """Create the head schema in the empty SQLite database of ``conn`` (inside its open
    write transaction) from what ``alembic upgrade head`` built in memory."""
    schema = _head_schema()
    for statement in schema.statements:
        conn.exec_driver_sql(statement)
    for table, rows in schema.rows:
        marks = ", ".join("?" * len(rows[0]))
        conn.exec_driver_sql(f'INSERT INTO "{table}" VALUES ({marks})', list(rows))
    logger.debug("catalog schema %s created from this process's head schema", head())


def upgrade(url: str | URL | Engine, revision: str = "head") -> None:
    """Bring the catalog schema up to ``revision`` (creates it in an empty database).

    Safe to call from several processes at once, and a no-op when already there.

    Args:
        url: A catalog URL or engine.
        revision: Target revision; ``"head"`` by default.

    Raises:
        StorageError: If the database cannot be reached or a migration fails.

    Example:
        >>> upgrade("sqlite:////tmp/ckpt/catalog.db")  # doctest: +SKIP
    """
    logger.info("upgrading catalog %s to %s", mask_url(_url_of(url)), revision)
    _run_command(url, "upgrade", revision)


def downgrade(url: str | URL | Engine, revision: str) -> None:
    """Revert the catalog schema to ``revision`` (``"base"`` drops every table: data is lost).

    Args:
        url: A catalog URL or engine.
        revision: Target revision, e.g. ``"base"`` or ``"-1"``.

    Raises:
        StorageError: If the database cannot be reached or a migration fails.
    """
    logger.warning("downgrading catalog %s to %s", mask_url(_url_of(url)), revision)
    _run_command(url, "downgrade", revision)


def _url_of(url: str | URL | Engine) -> str | URL:
    return url.url if isinstance(url, Engine) else url
