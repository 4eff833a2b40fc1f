"""What a user reads: warnings that name the problem and the object (plurals right), one
error per damaged chunk, every metric in `ckpt ls` (`--columns` to choose), byte counts in
human units (exact in --json), "3 + 1 pinned" from prune, rounded alert values in the UI."""

from __future__ import annotations

import json
import logging
import urllib.request
from pathlib import Path

import pytest
import torch
from cli_support import Ckpt

from ckptstore.format import read_manifest, verify_checkpoint
from ckptstore.numeric import counted, rounded
from ckptstore.store import CheckpointStore


@pytest.fixture
def root(tmp_path: Path) -> Path:
    root = tmp_path / "store"
    with CheckpointStore.open(root) as store:
        for step in range(1, 6):
            store.save("run-a", step=step, state={"w": torch.full((20_000,), float(step))},
                       metrics={"loss": 2.0 / step, "acc": 0.1 * step, "lr": 1e-3})
        store.pin("run-a@2")
    return root


def _damage_one_chunk(store: CheckpointStore, ref: str) -> Path:
    ck = store.get(ref)
    chunk = next(p for p in store.checkpoint_dir(ck.run, ck.id).rglob("c/0"))
    data = bytearray(chunk.read_bytes())
    data[100] ^= 0xFF
    chunk.write_bytes(bytes(data))
    return store.checkpoint_dir(ck.run, ck.id)


def test_import_bundle_warns_of_nothing_when_nothing_is_wrong(root: Path, tmp_path: Path,
                                                             ckpt: Ckpt) -> None:
    bundle = tmp_path / "b.tar"
    assert ckpt("export", "run-a@latest", "--out", bundle, "--store", root).code == 0
    other = tmp_path / "other"
    for args in ([], ["-v"]):
        result = ckpt("import-bundle", bundle, "--store", other, *args, "--run", f"r{len(args)}")
        assert result.code == 0, result.err
        assert "problem" not in result.err, result.err
    assert ckpt("verify", "--all", "--store", other).code == 0


def test_a_damaged_copy_is_logged_with_its_problem_and_path(
        root: Path, caplog: pytest.LogCaptureFixture) -> None:
    with CheckpointStore.open(root) as store:
        directory = _damage_one_chunk(store, "run-a@5")
        manifest = read_manifest(directory)
    with caplog.at_level(logging.INFO, logger="ckptstore.format.verify"):
        problems = verify_checkpoint(directory, manifest)
    assert len(problems) == 1
    (line,) = [r.getMessage() for r in caplog.records]
    assert f"at {directory} has 1 problem: tensor w chunk float32/c/0" in line


def test_verify_prints_one_error_per_damaged_chunk(root: Path, ckpt: Ckpt) -> None:
    with CheckpointStore.open(root) as store:
        _damage_one_chunk(store, "run-a@5")
    result = ckpt("verify", "run-a@5", "--store", root)
    assert result.code == 1
    text = " ".join((result.out + result.err).split())
    assert text.count("fails its crc32c") == 1, text
    assert "checked 1 replica:" in text


def test_plurals() -> None:
    assert [counted(n, "problem") for n in (0, 1, 2)] == ["0 problems", "1 problem",
                                                           "2 problems"]
    assert counted(1, "copy", "copies") == "1 copy" and counted(3, "array") == "3 arrays"


def test_ls_shows_every_metric_that_fits_and_columns_choose(root: Path, ckpt: Ckpt) -> None:
    result = ckpt("ls", "--store", root)
    header = result.out.splitlines()[0]
    assert all(name in header for name in ("acc", "loss", "lr")), header
    assert "0.6667" in result.out  # 2/3, rounded for people
    chosen = ckpt("ls", "--store", root, "--columns", "checkpoint,loss")
    assert chosen.out.splitlines()[0].split() == ["checkpoint", "┃", "loss"]
    bad = ckpt("ls", "--store", root, "--columns", "checkpoint,nope")
    assert bad.code == 2 and "nope" in bad.err and "loss" in bad.err
    exact = json.loads(ckpt("ls", "--store", root, "--json").out)
    assert exact[0]["metrics"]["loss"] == 2.0 and isinstance(exact[0]["stored_bytes"], int)


def test_byte_counts_are_human_in_text(root: Path, tmp_path: Path, ckpt: Ckpt) -> None:
    config = tmp_path / "c.toml"
    config.write_text(f'root = "{root}"\n[tiers]\nwarm = "{tmp_path / "warm"}"\n')
    result = ckpt("archive", "--config", config)
    assert result.code == 0, result.err
    assert "KiB" in result.out and " bytes" not in result.out, result.out


def test_prune_says_how_many_it_keeps_and_why(root: Path, ckpt: Ckpt) -> None:
    result = ckpt("prune", "--keep-last", "3", "--dry-run", "--store", root)
    assert result.code == 0, result.err
    assert "4 copies kept (3 + 1 pinned)" in result.out, result.out
    assert "1 action," in result.out  # run-a@1 goes; @2 is pinned


def test_ui_alert_values_are_rounded(root: Path) -> None:
    from ckptstore.ops.upkeep.history import ALERT_EVENT
    from ckptstore.ui.app import start_background

    assert rounded(1.1026153340935707) == "1.103"
    with CheckpointStore.open(root) as store:
        store.catalog.record_history(
            "run-a", {"loss": [(1, 2.0), (2, 1.1026153340935707)]},
            events=[(ALERT_EVENT, {"step": 2, "metric": "loss", "kind": "spike",
                                   "loss": 1.1026153340935707,
                                   "reason": "loss 1.1026153340935707 above 0.5512345678"})])
        with start_background(store) as ui, \
                urllib.request.urlopen(ui.url + "runs/run-a", timeout=20) as resp:
            body = resp.read().decode()
    assert "1.1026153340935707" not in body and "0.5512345678" not in body
    assert '<td class="num">1.103</td>' in body and "above 0.5512" in body
