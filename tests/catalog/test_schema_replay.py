"""A fresh SQLite catalog gets exactly the schema ``alembic upgrade head`` builds: the head
schema built once per process and replayed (``migrate._replay_head``) is the same database,
entry for entry and row for row, as the revision chain run on the file itself."""

from __future__ import annotations

import sqlite3
import threading
from pathlib import Path

from alembic import command

from ckptstore.catalog import Catalog, migrate
from ckptstore.catalog.engine import WRITE_OPTION, create_catalog_engine


def _chain(path: Path) -> None:
    """Run every revision on the file itself (what ``upgrade`` did before the replay)."""
    engine = create_catalog_engine(f"sqlite:///{path}")
    try:
        with engine.connect() as conn:
            conn.execution_options(**{WRITE_OPTION: True})
            with conn.begin():
                cfg = migrate.alembic_config()
                cfg.attributes["connection"] = conn
                command.upgrade(cfg, "head")
    finally:
        engine.dispose()


def _dump(path: Path) -> dict[str, object]:
    """Everything that makes up the database: its schema entries, pragmas and every row."""
    with sqlite3.connect(path) as db:
        master = sorted(db.execute("SELECT type, name, tbl_name, sql FROM sqlite_master"))
        tables = [name for kind, name, _t, _s in master if kind == "table"]
        return {
            "master": master,
            "rows": {t: sorted(db.execute(f'SELECT * FROM "{t}"')) for t in tables},
            "user_version": db.execute("PRAGMA user_version").fetchone(),
            "application_id": db.execute("PRAGMA application_id").fetchone(),
            "integrity": db.execute("PRAGMA integrity_check").fetchall(),
            "foreign_keys": db.execute("PRAGMA foreign_key_check").fetchall(),
        }


def test_a_replayed_head_schema_is_the_chains_schema(tmp_path: Path) -> None:
    chained, replayed, again = (tmp_path / f"{n}.db" for n in ("chain", "replay", "again"))
    _chain(chained)
    migrate.upgrade(f"sqlite:///{replayed}")  # builds the head schema if this process has none
    migrate.upgrade(f"sqlite:///{again}")  # replays the one already built
    expected = _dump(chained)
    assert expected["rows"]["alembic_version"] == [(migrate.head(),)]
    assert len(expected["master"]) > 20  # tables, their indexes and autoindexes
    assert _dump(replayed) == expected
    assert _dump(again) == expected
    # The revisions still run on anything not empty: a no-op at head.
    migrate.upgrade(f"sqlite:///{again}")
    assert _dump(again) == expected


def test_concurrent_first_opens_of_one_file_make_one_schema(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'catalog.db'}"
    errors: list[BaseException] = []
    start = threading.Barrier(4)

    def open_it() -> None:
        try:
            start.wait(10)
            Catalog(url).close()
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=open_it) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert errors == []
    chained = tmp_path / "chain.db"
    _chain(chained)
    assert _dump(tmp_path / "catalog.db") == _dump(chained)
