"""The ``ckpt`` command as a user runs it: output, JSON, exit codes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ckptstore import CheckpointStore
from ckptstore.cli.app import main


@pytest.fixture
def filled(store_root: Path) -> Path:
    with CheckpointStore.open(store_root) as store:
        store.run("base", experiment="exp", config={"lr": 0.1}, code_version="c0ffee")
        for step, loss in [(10, 3.0), (20, 2.0), (100, 1.5)]:
            store.save("base", step=step, state={"w": torch.ones(4) * step},
                       metrics={"loss": loss}, tags=["warm"] if step == 10 else ())
        store.save("tuned", step=1, state={"w": torch.zeros(4)}, parent="base@latest")
    return store_root


def run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def test_ls_and_json(filled: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "--store", str(filled), "ls", "--run", "base")
    assert code == 0
    assert "base" in out and "100" in out
    code, out, _ = run(capsys, "--store", str(filled), "ls", "--json", "--where", "loss<2.5",
                       "--order-by", "-step")
    rows = json.loads(out)
    assert [r["step"] for r in rows] == [100, 20]
    code, out, _ = run(capsys, "--store", str(filled), "ls", "--json", "--tag", "warm")
    assert [r["step"] for r in json.loads(out)] == [10]


def test_show_runs_lineage_du_events(filled: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "-s", str(filled), "show", "base@best:loss", "--json")
    info = json.loads(out)
    assert code == 0 and info["checkpoint"]["step"] == 100
    assert info["reproduction"]["code_version"] == "c0ffee"
    code, out, _ = run(capsys, "-s", str(filled), "show", "base@10")
    assert code == 0 and "restore" in out
    code, out, _ = run(capsys, "-s", str(filled), "runs")
    assert code == 0 and "tuned" in out
    code, out, _ = run(capsys, "-s", str(filled), "lineage", "tuned@latest", "--format", "mermaid")
    assert code == 0 and "base@v3" in out and "-->" in out
    code, out, _ = run(capsys, "-s", str(filled), "lineage", "tuned@latest", "--format", "dot")
    assert '"base@v3" -> "tuned@v1"' in out
    code, out, _ = run(capsys, "-s", str(filled), "du")
    assert code == 0 and "total" in out
    code, out, _ = run(capsys, "-s", str(filled), "events", "base@latest", "--json")
    assert any(e["kind"] == "saved" for e in json.loads(out))


def test_alias_pin_gc(filled: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert run(capsys, "-s", str(filled), "alias", "base@20", "prod")[0] == 0
    code, out, _ = run(capsys, "-s", str(filled), "show", "prod", "--json")
    assert json.loads(out)["checkpoint"]["step"] == 20
    assert run(capsys, "-s", str(filled), "pin", "base@10")[0] == 0
    code, out, _ = run(capsys, "-s", str(filled), "ls", "--json", "--run", "base")
    assert [r["pinned"] for r in json.loads(out)] == [True, False, False]
    assert run(capsys, "-s", str(filled), "unpin", "base@10")[0] == 0
    code, out, _ = run(capsys, "-s", str(filled), "gc", "--dry-run")
    assert code == 0 and "nothing to clean" in out


def test_errors_and_exit_codes(filled: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(capsys, "-s", str(filled), "show", "base@7")
    assert code == 1 and "error:" in err and "100" in err  # lists what exists
    code, _, err = run(capsys, "-s", str(filled), "ls", "--order-by", "step; DROP TABLE runs")
    assert code == 2 and "order" in err.lower()  # bad usage
    code, _, err = run(capsys, "-s", str(filled), "ls", "--where", "loss<<2")
    assert code == 2
    code, _, err = run(capsys, "-s", str(filled), "show")
    assert code == 2
    code, _, err = run(capsys, "--no-such-option")
    assert code == 2
    code, _, err = run(capsys, "--config", str(filled / "missing.toml"), "ls")
    # The message is wrapped to the terminal width: a long temp path moves the line breaks.
    assert code == 1 and "does not exist" in " ".join(err.split())


def test_help_is_helpful() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "ckptstore", "--help"], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0
    for command in ("ls", "show", "runs", "gc", "archive", "prune", "restore", "convert"):
        assert command in out.stdout
    assert "run@latest" in out.stdout


def test_db_commands(store_root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert run(capsys, "-s", str(store_root), "db", "upgrade")[0] == 0
    code, out, _ = run(capsys, "-s", str(store_root), "db", "current")
    assert code == 0 and out.strip() and "empty" not in out
    code, out, _ = run(capsys, "db", "history")
    assert code == 0 and out.strip()


def test_convert_and_import(
    filled: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "w.safetensors"
    code, _, err = run(capsys, "-s", str(filled), "convert", "base@latest", "--format",
                       "safetensors", "--out", str(out))
    assert code == 0, err
    from safetensors.torch import load_file

    assert torch.equal(load_file(str(out))["w"], torch.ones(4) * 100)
    code, _, err = run(capsys, "-s", str(filled), "convert", "base@latest", "--format",
                       "safetensors", "--out", str(out))
    assert code == 1 and "exist" in err  # never overwrites silently
    pt = tmp_path / "state.pt"
    code, _, err = run(
        capsys, "-s", str(filled), "convert", "base@10", "-f", "pytorch", "-o", str(pt)
    )
    assert code == 0, err
    code, _, err = run(capsys, "-s", str(filled), "import", str(pt), "--run", "imported",
                              "--step", "7", "--metric", "loss=0.5")
    assert code == 0, err
    with CheckpointStore.open(filled) as store:
        assert torch.equal(store.load("imported@7")["w"], torch.ones(4) * 10)
        assert store.get("imported@latest").metrics == {"loss": 0.5}
    code, _, err = run(capsys, "-s", str(filled), "convert", "base@latest", "--codec", "zstd-3")
    assert code == 0, err
    plain_out = tmp_path / "plain-out"
    code, _, err = run(capsys, "convert", "--input-dir", str(tmp_path), "--output-dir",
                       str(plain_out), "--format", "pytorch")
    assert code == 0, err
    assert (plain_out / "state.pt").exists()
