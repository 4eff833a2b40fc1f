"""A path that holds no store: read-only commands say so and create nothing; `ckpt init`
creates one; a file given as the store is refused in words; the API still creates a store
on its first save."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

import pytest
import torch
from cli_support import Ckpt

from ckptstore.errors import StoreNotFoundError
from ckptstore.store import CheckpointStore

#: Commands that only read, with the arguments they need to get as far as opening the store.
READ_ONLY = [
    ["ls"], ["show", "run-a@latest"], ["lineage", "run-a@latest"], ["du"], ["events"],
    ["runs"], ["verify", "--all"], ["doctor"], ["config"], ["tiers"],
    ["report", "--html", "r.html"], ["diff", "run-a@1", "run-a@2"], ["db", "current"],
]


def _tree(path: Path) -> list[str]:
    return sorted(str(p.relative_to(path)) for p in path.rglob("*"))


@pytest.mark.parametrize("args", READ_ONLY, ids=" ".join)
def test_read_only_commands_on_a_typo_create_nothing(
        args: list[str], ckpt: Ckpt, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    result = ckpt(*args, "--store", "./nope")
    assert result.code == 1, result.out + result.err
    expected = f"no store at {tmp_path / 'nope'} (create one with `ckpt init {tmp_path / 'nope'}`"
    assert expected in result.err
    assert _tree(tmp_path) == []  # neither ./nope nor ./ckpt nor anything else


def test_show_in_an_empty_directory_creates_no_ckpt(ckpt: Ckpt, tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    result = ckpt("show", "run-a@latest", "--json")
    assert result.code == 1
    error = json.loads(result.out)["error"]
    assert error["type"] == "StoreNotFoundError" and "ckpt init" in error["message"]
    assert not (tmp_path / "ckpt").exists()


def test_init_creates_catalog_hot_tier_and_marker(ckpt: Ckpt, tmp_path: Path) -> None:
    store = tmp_path / "store"
    result = ckpt("init", store, "--json")
    assert result.code == 0, result.err
    doc = json.loads(result.out)
    assert doc["created"] is True and doc["root"] == str(store)
    assert (store / "catalog.db").is_file() and (store / "hot" / ".ckptstore.json").is_file()
    # Now a store: read-only commands work on it, and init again leaves it as it is.
    assert ckpt("ls", "--store", store, "--json").out.strip() == "[]"
    again = ckpt("init", store)
    assert again.code == 0 and again.out.startswith("already a store")


def test_init_with_config_writes_a_commented_config(ckpt: Ckpt, tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    result = ckpt("init", "data/ckpt", "--config", "ckptstore.toml")
    assert result.code == 0, result.err
    text = (tmp_path / "ckptstore.toml").read_text()
    assert tomllib.loads(text) == {"root": str(tmp_path / "data" / "ckpt"), "tiers": {},
                                   "retention": {}, "schedules": {}}
    assert "# codec" in text and "CKPT_WARM" in text  # every other key, commented
    # Found as ./ckptstore.toml by the next command.
    listed = ckpt("config", "--json")
    assert listed.code == 0, listed.err
    assert json.loads(listed.out)["settings"]["root"]["value"] == str(tmp_path / "data/ckpt")
    # An existing config file is read, never replaced.
    before = (tmp_path / "ckptstore.toml").read_text()
    assert ckpt("init", "--config", "ckptstore.toml").code == 0
    assert (tmp_path / "ckptstore.toml").read_text() == before


def test_a_file_given_as_the_store_is_named_in_words(ckpt: Ckpt, tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text("print('training')\n")
    for args in (["ls"], ["init"], ["import", script, "--run", "r", "--step", "1"]):
        result = ckpt(*args, "--store", script)
        assert result.code == 1, (args, result.err)
        assert f"{script} is a file, not a store directory" in result.err, result.err
        assert "Errno" not in result.err
    with pytest.raises(StoreNotFoundError, match="is a file, not a store directory"):
        CheckpointStore.open(script)
    assert script.read_text() == "print('training')\n"


def test_api_saving_creates_the_store_and_create_false_does_not(tmp_path: Path) -> None:
    with pytest.raises(StoreNotFoundError, match="no store at"):
        CheckpointStore.open(tmp_path / "s", create=False)
    assert not (tmp_path / "s").exists()
    with CheckpointStore.open(tmp_path / "s") as store:
        store.save("run-a", step=1, state={"w": torch.ones(3)})
    with CheckpointStore.open(tmp_path / "s", create=False) as store:
        assert store.get("run-a@latest").step == 1
