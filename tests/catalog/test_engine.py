"""Engine set-up: URL handling and masking, SQLite pragmas and write locking."""

from __future__ import annotations

import logging
import struct
from pathlib import Path

import pytest
from sqlalchemy import Integer, bindparam, event, text
from sqlalchemy.dialects.postgresql import ARRAY

from ckptstore.catalog import Catalog, mask_url
from ckptstore.catalog.engine import WRITE_OPTION, create_catalog_engine, parse_catalog_url
from ckptstore.catalog.pg_ids import IdArray, PackedIds
from ckptstore.errors import ConfigError, StorageError

SECRET = "s3cr%3Et-pw"


@pytest.mark.parametrize(
    ("url", "masked"),
    [
        (
            "postgresql+psycopg://ckpt:hunter2@db:5432/cat",
            "postgresql+psycopg://ckpt:***@db:5432/cat",
        ),
        ("postgresql://u:p%40ss@h/db", "postgresql://u:***@h/db"),
        ("postgresql://u@h/db", "postgresql://u@h/db"),
        ("sqlite:////tmp/x/catalog.db", "sqlite:////tmp/x/catalog.db"),
        # Not parseable by SQLAlchemy: masked by pattern instead.
        ("weird://user:pw@host:notaport/x", "weird://user:***@host:notaport/x"),
    ],
)
def test_mask_url(url: str, masked: str) -> None:
    assert mask_url(url) == masked


def test_parse_catalog_url() -> None:
    assert parse_catalog_url("postgresql://u@h/db").drivername == "postgresql+psycopg"
    for bad in ("mysql://u@h/db", "postgresql+asyncpg://u@h/db", "not a url"):
        with pytest.raises(ConfigError):
            parse_catalog_url(bad)


def test_password_never_leaks(caplog: pytest.LogCaptureFixture, tmp_path: Path) -> None:
    caplog.set_level(logging.DEBUG)
    url = f"postgresql+psycopg://ckpt:{SECRET}@127.0.0.1:1/nowhere"  # nothing listens on :1
    with pytest.raises(StorageError) as info:
        Catalog(url)
    chain: list[BaseException] = []
    err: BaseException | None = info.value
    while err is not None:
        chain.append(err)
        err = err.__cause__ or err.__context__
    texts = [str(e) for e in chain] + [r.getMessage() for r in caplog.records]
    assert texts and not any(SECRET in t or "s3cr" in t for t in texts)
    assert "ckpt:***@127.0.0.1:1" in str(info.value)


def test_catalog_url_is_masked(catalog_url: str) -> None:
    if catalog_url.startswith("postgresql"):
        # Trust auth ignores the password, so a URL with one still connects.
        catalog_url = catalog_url.replace("postgres@", f"postgres:{SECRET}@")
    with Catalog(catalog_url) as cat:
        assert SECRET not in cat.url and SECRET not in repr(cat)
        assert cat.dialect == ("postgresql" if catalog_url.startswith("postgresql") else "sqlite")
        if cat.dialect == "postgresql":
            assert ":***@" in cat.url


def test_sqlite_pragmas_and_parent_dir(tmp_path: Path) -> None:
    path = tmp_path / "a" / "b" / "catalog.db"
    engine = create_catalog_engine(f"sqlite:///{path}")
    try:
        with engine.connect() as conn:
            assert conn.execute(text("PRAGMA journal_mode")).scalar() == "wal"
            assert conn.execute(text("PRAGMA busy_timeout")).scalar() == 30000
            assert conn.execute(text("PRAGMA foreign_keys")).scalar() == 1
            assert conn.execute(text("PRAGMA synchronous")).scalar() == 2  # FULL
        assert path.parent.is_dir()
    finally:
        engine.dispose()


def test_sqlite_writes_begin_immediate_and_reads_do_not(tmp_path: Path) -> None:
    with Catalog(f"sqlite:///{tmp_path / 'c.db'}") as cat:
        seen: list[str] = []

        def record(conn, cursor, statement, params, context, executemany) -> None:  # type: ignore[no-untyped-def]
            if statement.startswith("BEGIN"):
                seen.append(statement)

        event.listen(cat.engine, "before_cursor_execute", record)
        cat.ensure_run("r")
        cat.runs()
        assert seen == ["BEGIN IMMEDIATE", "BEGIN"]
        event.remove(cat.engine, "before_cursor_execute", record)
        with cat.engine.connect() as conn:
            conn.execution_options(**{WRITE_OPTION: True})
            with conn.begin():
                assert conn.in_transaction()


def test_foreign_keys_are_enforced(catalog: Catalog) -> None:
    from sqlalchemy.exc import IntegrityError

    with pytest.raises(IntegrityError), catalog.engine.begin() as conn:
        conn.execute(text("INSERT INTO checkpoint_tags (checkpoint_id, tag) VALUES ('nope', 't')"))


def test_in_memory_sqlite_works() -> None:
    with Catalog("sqlite://") as cat:
        ck = cat.begin_checkpoint("r", 1)
        cat.commit_checkpoint(ck.id, manifest_digest="d", logical_bytes=1, stored_bytes=1)
        assert cat.latest("r").id == ck.id


def test_one_catalog_is_shared_by_threads(catalog: Catalog) -> None:
    from concurrent.futures import ThreadPoolExecutor

    def work(i: int) -> int:
        ck = catalog.begin_checkpoint("threads", i, metrics={"loss": float(i)})
        catalog.commit_checkpoint(ck.id, manifest_digest="d", logical_bytes=1, stored_bytes=1)
        assert catalog.get(ck.id).step == i
        return ck.version

    with ThreadPoolExecutor(max_workers=6) as pool:
        versions = sorted(pool.map(work, range(24)))
    assert versions == list(range(1, 25))


def test_reads_survive_connections_the_server_closed(catalog: Catalog, save) -> None:  # type: ignore[no-untyped-def]
    # Single-statement reads use connections that are not pinged (PostgreSQL): one the
    # server closed meanwhile (a restart, an idle timeout) fails once, and the read is run
    # again on a fresh connection instead of surfacing the error.
    ck = save("r", 1)
    assert catalog.get("r@latest").id == ck.id and catalog.list(run="r")[0].id == ck.id
    if catalog.dialect == "postgresql":
        with catalog.engine.connect() as conn:
            killed = conn.execute(text(
                "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                "WHERE datname = current_database() AND pid <> pg_backend_pid()"
            )).scalar_one()
        assert killed >= 1
    assert [c.id for c in catalog.list(run="r")] == [ck.id]
    assert catalog.get("r@latest").id == ck.id
    assert [c.id for c in catalog.lineage(ck.id)] == []


@pytest.mark.postgres
def test_packed_ids_reach_postgresql_as_integer_arrays(pg_session_url: str) -> None:
    # Config listings bind the matching run ids in binary (catalog/pg_ids.py); the server
    # must read back exactly the ids given, and lists keep their usual dumping.
    engine = create_catalog_engine(pg_session_url, reads=True)
    packed = text("SELECT CAST(:ids AS INTEGER[])").bindparams(bindparam("ids", type_=IdArray()))
    listed = text("SELECT CAST(:ids AS INTEGER[])").bindparams(
        bindparam("ids", type_=ARRAY(Integer)))
    try:
        with engine.connect() as conn:
            for ids in ([], [7], [0, -1, 2**31 - 1, -(2**31), 5, 5], list(range(1, 1001))):
                assert conn.execute(packed, {"ids": PackedIds(ids)}).scalar_one() == ids
                assert conn.execute(listed, {"ids": ids}).scalar_one() == ids
    finally:
        engine.dispose()
    with pytest.raises(struct.error):
        PackedIds([2**31])
