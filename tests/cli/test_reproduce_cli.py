"""``ckpt show`` (how to reproduce), ``ckpt runs diff``, ``ckpt ls --where config.*`` and
``ckpt reproduce`` errors, as a user runs them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from context_support import training_repo

from ckptstore import CheckpointStore
from ckptstore.cli.app import main


def run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture
def recorded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    training_repo(tmp_path / "repo", monkeypatch)
    root = tmp_path / "store"
    with CheckpointStore.open(root) as store:
        store.save("a", 1, {"w": torch.ones(2)}, config={"lr": 1e-4, "opt": "adam"},
                   data_version="d1")
        store.save("b", 1, {"w": torch.ones(2)}, config={"lr": 0.1, "opt": "adam"},
                   data_version="d2")
    monkeypatch.setenv("CKPT_CAPTURE", "0")
    store_without = tmp_path / "store"
    with CheckpointStore.open(store_without) as store:
        store.save("old", 1, {"w": torch.ones(2)})
    return root


def test_show_has_a_how_to_reproduce_section(recorded: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "-s", str(recorded), "show", "a@latest", "--json")
    section = json.loads(out)["reproduction"]["context"]
    assert code == 0 and section["dirty"] and section["commit"]
    assert section["config"] == {"lr": 1e-4, "opt": "adam"} and section["python"]
    code, out, _ = run(capsys, "-s", str(recorded), "show", "a@latest")
    for field in ("commit", "dirty", "command", "config", "environment", "ckpt reproduce"):
        assert field in out
    code, out, _ = run(capsys, "-s", str(recorded), "show", "old@latest")
    assert code == 0 and "no context recorded" in out


def test_runs_diff(recorded: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "-s", str(recorded), "runs", "diff", "a", "b@latest", "--json")
    diffs = {d["field"]: (d["a"], d["b"]) for d in json.loads(out)["differences"]}
    assert code == 0
    assert diffs == {"config.lr": (1e-4, 0.1), "data_version": ("d1", "d2")}
    code, out, _ = run(capsys, "-s", str(recorded), "runs", "diff", "a", "b")
    assert code == 0 and "config.lr" in out
    code, out, _ = run(capsys, "-s", str(recorded), "runs", "--json")
    assert code == 0 and {r["name"] for r in json.loads(out)} == {"a", "b", "old"}
    code, _, err = run(capsys, "-s", str(recorded), "runs", "diff", "a", "old")
    assert code == 1 and "no context is recorded" in err


def test_ls_where_config(recorded: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "-s", str(recorded), "ls", "--json", "--where", "config.lr<1e-3")
    assert code == 0 and [r["run"] for r in json.loads(out)] == ["a"]
    code, out, _ = run(capsys, "-s", str(recorded), "ls", "--json",
                       "--where", "config.opt==adam", "--where", "config.lr>0.01")
    assert [r["run"] for r in json.loads(out)] == ["b"]
    code, _, err = run(capsys, "-s", str(recorded), "ls", "--where", "config.opt<adam")
    assert code == 1 and "strings compare with ==" in err


def test_reproduce_usage_and_missing_context(recorded: Path, tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    code, _, _ = run(capsys, "-s", str(recorded), "reproduce", "a@latest")
    assert code == 2
    code, _, err = run(capsys, "-s", str(recorded), "reproduce", "old@latest", "--dir",
                       str(tmp_path / "r"))
    assert code == 1 and "no context is recorded" in err
