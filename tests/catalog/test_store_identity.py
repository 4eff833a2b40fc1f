"""One config file is one store, wherever it is used; a catalog and a hot tier of different
stores are never opened together.

Before: with ``save_dir`` and no ``root`` the catalog landed in ``./ckpt`` of the current
directory, so ``ckpt --config c.toml ls`` showed a different catalog from every directory; and
nothing stopped a catalog from being opened with another store's hot tier.
"""

from __future__ import annotations

import json
import os
import threading
import uuid
from pathlib import Path

import pytest
import torch
from sqlalchemy import text

from ckptstore import CheckpointStore
from ckptstore.catalog import Catalog, migrate
from ckptstore.catalog.engine import create_catalog_engine
from ckptstore.cli.app import main
from ckptstore.config import load_settings
from ckptstore.errors import ConfigError

PREVIOUS = "5c8e0f3a2d17"  # the revision before store_meta
MARKER = ".ckptstore.json"


def _ls(capsys: pytest.CaptureFixture[str], *args: str) -> list[dict[str, object]]:
    assert main([*args, "ls", "--json"]) == 0
    rows: list[dict[str, object]] = json.loads(capsys.readouterr().out)
    return rows


def _state(i: int) -> dict[str, torch.Tensor]:
    return {"w": torch.full((8,), float(i))}


# ---------------------------------------------------------------------- config resolution
def test_one_config_means_one_store_from_any_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    hot = tmp_path / "nvme" / "hot"
    cfg_dir = tmp_path / "project"
    cfg_dir.mkdir()
    cfg = cfg_dir / "c.toml"
    cfg.write_text(f'save_dir = "{hot}"\nkeep_last = 2\n')
    one, two = tmp_path / "one", tmp_path / "two"
    one.mkdir()
    two.mkdir()
    monkeypatch.chdir(one)
    with CheckpointStore.open(config=cfg) as store:
        store.save("r", 1, _state(1))
        assert store.settings.root == hot / ".ckptstore"
    assert [r["step"] for r in _ls(capsys, "--config", str(cfg))] == [1]
    monkeypatch.chdir(two)
    assert [r["step"] for r in _ls(capsys, "--config", str(cfg))] == [1]
    assert (hot / ".ckptstore" / "catalog.db").is_file() and (hot / MARKER).is_file()
    assert not (one / "ckpt").exists() and not (two / "ckpt").exists()


def test_relative_paths_in_a_config_file_are_relative_to_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg_dir = tmp_path / "conf"
    cfg_dir.mkdir()
    cfg = cfg_dir / "c.toml"
    cfg.write_text('save_dir = "hot"\narchive_dir = "../warm"\nmemory_tier_dir = "shm"\n'
                   'catalog_url = "sqlite:///db/catalog.db"\n')
    monkeypatch.chdir(tmp_path)
    s = load_settings(cfg)
    assert s.hot_path == cfg_dir / "hot"
    assert s.warm == str(tmp_path / "warm") and s.memory_tier_dir == str(cfg_dir / "shm")
    assert s.resolved_catalog_url == f"sqlite:///{cfg_dir / 'db' / 'catalog.db'}"
    assert s.root == cfg_dir / "hot" / ".ckptstore"
    cfg.write_text('codec = "lz4"\n')  # neither root nor hot: ckpt/ next to the file
    assert load_settings(cfg).root == cfg_dir / "ckpt"
    cfg.write_text('root = "store"\nwarm = "s3://bucket/x"\n')
    s = load_settings(cfg)
    assert s.root == cfg_dir / "store" and s.warm == "s3://bucket/x"
    monkeypatch.setenv("CKPT_HOT", "envhot")  # from the environment: the current directory
    assert load_settings(cfg).hot_path == tmp_path / "envhot"


def test_a_store_created_before_the_rule_is_found_with_a_hint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    hot = tmp_path / "hot"
    legacy_root = tmp_path / "cwd" / "ckpt"
    with CheckpointStore.open(legacy_root, hot=str(hot)) as store:  # where it used to go
        store.save("r", 1, _state(1))
    (hot / MARKER).unlink()  # stores of that time had no marker
    cfg = tmp_path / "c.toml"
    cfg.write_text(f'save_dir = "{hot}"\n')
    with pytest.raises(ConfigError, match=r"ckpt/catalog.db") as caught:
        CheckpointStore.open(config=cfg)
    assert str(hot / ".ckptstore") in str(caught.value)
    assert not (hot / ".ckptstore" / "catalog.db").exists()  # nothing created
    cfg.write_text(f'save_dir = "{hot}"\nroot = "{legacy_root}"\n')
    with CheckpointStore.open(config=cfg) as store:
        assert store.get("r@latest").step == 1


# ---------------------------------------------------------------------- store identity
def test_a_catalog_of_another_store_is_refused(tmp_path: Path, catalog_url: str) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    with CheckpointStore.open(a) as store_a:
        store_a.save("r", 1, _state(1))
    with CheckpointStore.open(b, catalog_url=catalog_url) as store_b:
        store_b.save("q", 1, _state(2))
        b_id = store_b.catalog.store_identity()
    assert b_id is not None and b_id.hot_tier == str(b / "hot")
    marker_a = (a / "hot" / MARKER).read_bytes()

    # b's catalog with a's hot tier: both carry their (different) store ids.
    with pytest.raises(ConfigError) as caught:
        CheckpointStore.open(tmp_path / "x", hot=str(a / "hot"), catalog_url=catalog_url)
    message = str(caught.value)
    assert str(b / "hot") in message and str(a / "hot") in message
    assert (a / "hot" / MARKER).read_bytes() == marker_a  # nothing rewritten

    # b's catalog with a new, empty hot tier while b's own still exists: refused, and says
    # where the catalog's hot tier is and how to move it.
    fresh = tmp_path / "fresh-hot"
    with pytest.raises(ConfigError, match=r"copy .*ckptstore\.json") as caught:
        CheckpointStore.open(tmp_path / "y", hot=str(fresh), catalog_url=catalog_url)
    assert str(b / "hot") in str(caught.value)
    assert not (fresh / MARKER).exists()

    # a's hot tier with a brand-new catalog: refused before the catalog is created.
    new_db = tmp_path / "new" / "catalog.db"
    with pytest.raises(ConfigError, match="belongs to store") as caught:
        CheckpointStore.open(tmp_path / "z", hot=str(a / "hot"),
                             catalog_url=f"sqlite:///{new_db}")
    assert str(a / "catalog.db") in str(caught.value)
    assert not new_db.exists()

    # Each store still opens as itself.
    with CheckpointStore.open(a) as again:
        assert again.get("r@latest").step == 1
    with CheckpointStore.open(b, catalog_url=catalog_url) as again:
        assert again.get("q@latest").step == 1


def test_a_moved_hot_tier_is_followed(tmp_path: Path) -> None:
    with CheckpointStore.open(tmp_path / "s") as store:
        store.save("r", 1, _state(1))
    moved = tmp_path / "elsewhere"
    os.rename(tmp_path / "s" / "hot", moved)  # the marker moves with it
    with CheckpointStore.open(tmp_path / "s", hot=str(moved)) as store:
        assert store.catalog.store_identity().hot_tier == str(moved)  # type: ignore[union-attr]
        assert store.load("r@latest")["w"][0] == 1.0


def test_each_host_has_a_hot_tier_of_its_own(tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """A cluster's nodes share the catalog, each with its own disk. Simulated on one machine,
    every node's disk is visible, which must not make a new node's empty disk "another
    store's": only what this host recorded counts."""
    url = f"sqlite:///{tmp_path / 'catalog.db'}"
    disks = {n: tmp_path / f"nvme-{n}" for n in ("node-a", "node-b")}
    for node, disk in disks.items():
        monkeypatch.setenv("CKPT_HOST", node)
        with CheckpointStore.open(tmp_path / node, hot=str(disk), catalog_url=url) as store:
            store.save(node, 1, _state(1))
            ident = store.catalog.store_identity(node)
            assert ident is not None and ident.hot_tier == str(disk)
    markers = {json.loads((d / MARKER).read_bytes())["store_id"] for d in disks.values()}
    assert len(markers) == 1
    # Node A with a new, empty disk while its recorded one still holds the marker: refused.
    monkeypatch.setenv("CKPT_HOST", "node-a")
    with pytest.raises(ConfigError, match=str(disks["node-a"])):
        CheckpointStore.open(tmp_path / "node-a", hot=str(tmp_path / "new"), catalog_url=url)
    assert not (tmp_path / "new" / MARKER).exists()
    with Catalog(url) as cat:
        assert cat.store_identity("node-b").hot_tier == str(disks["node-b"])  # type: ignore[union-attr]
        assert cat.store_identity("node-c").hot_tier == ""  # type: ignore[union-attr]


def test_stores_from_before_store_ids_are_adopted(empty_url: str, tmp_path: Path) -> None:
    root = tmp_path / "old"
    migrate.upgrade(empty_url, PREVIOUS)
    with CheckpointStore.open(root, catalog_url=empty_url) as store:  # upgrades, adopts
        store.save("r", 1, _state(1))
        first = store.catalog.store_identity()
    assert first is not None
    # Back to the revision before store_meta, without the marker: a store as it was.
    migrate.downgrade(empty_url, PREVIOUS)
    (root / "hot" / MARKER).unlink()
    with CheckpointStore.open(root, catalog_url=empty_url) as store:
        ident = store.catalog.store_identity()
        assert ident is not None and ident.hot_tier == str(root / "hot")
        marker = json.loads((root / "hot" / MARKER).read_bytes())
        assert marker["store_id"] == ident.store_id
        assert store.get("r@latest").step == 1
    # The marker kept, the catalog's row lost (downgrade): the catalog adopts the marker.
    migrate.downgrade(empty_url, PREVIOUS)
    with CheckpointStore.open(root, catalog_url=empty_url) as store:
        assert store.catalog.store_identity().store_id == ident.store_id  # type: ignore[union-attr]


def test_concurrent_opens_of_a_new_store_agree(tmp_path: Path) -> None:
    root = tmp_path / "s"
    ids: list[str] = []
    errors: list[BaseException] = []

    def open_it() -> None:
        try:
            with CheckpointStore.open(root) as store:
                ident = store.catalog.store_identity()
                assert ident is not None
                ids.append(ident.store_id)
        except BaseException as exc:  # reported by the assertion below
            errors.append(exc)

    threads = [threading.Thread(target=open_it) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors and len(set(ids)) == 1
    assert json.loads((root / "hot" / MARKER).read_bytes())["store_id"] == ids[0]


def test_the_marker_never_holds_a_password(tmp_path: Path) -> None:
    with CheckpointStore.open(tmp_path / "s") as store:
        url = store.catalog.url
    assert json.loads((tmp_path / "s" / "hot" / MARKER).read_bytes())["catalog"] == url


# ---------------------------------------------------------------------- the migration
def test_store_meta_migration_round_trip(empty_url: str) -> None:
    migrate.upgrade(empty_url, PREVIOUS)
    engine = create_catalog_engine(empty_url)
    try:
        with engine.begin() as conn:
            conn.execute(text("INSERT INTO runs (id, name) VALUES (1, 'old-run')"))
    finally:
        engine.dispose()
    migrate.upgrade(empty_url)
    with Catalog(empty_url, upgrade=False) as cat:
        assert cat.store_identity() is None and not cat.is_empty()
        sid = str(uuid.uuid4())
        assert cat.claim_store_identity(sid, "/hot/a").store_id == sid
        # The first id recorded wins; later claims read it back.
        assert cat.claim_store_identity(str(uuid.uuid4()), "/hot/b").store_id == sid
        cat.set_store_hot_tier("/hot/c")
        assert cat.store_identity().hot_tier == "/hot/c"  # type: ignore[union-attr]
        # No per-host record yet: the store-wide one stands for every host.
        assert cat.store_identity("h1").hot_tier == "/hot/c"  # type: ignore[union-attr]
        cat.set_store_hot_tier("/hot/h1", "h1")
        assert cat.store_identity("h1").hot_tier == "/hot/h1"  # type: ignore[union-attr]
        assert cat.store_identity("h2").hot_tier == ""  # type: ignore[union-attr]
    migrate.downgrade(empty_url, PREVIOUS)
    assert migrate.current(empty_url) == PREVIOUS
    with Catalog(empty_url) as cat:  # upgrades again: the rows are gone, the runs are not
        assert cat.store_identity() is None and [r.name for r in cat.runs()] == ["old-run"]
