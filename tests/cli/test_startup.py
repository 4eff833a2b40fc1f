"""The catalog-only commands answer at once: `--version`, `--help`, tab completion and the
catalog queries import neither torch nor zarr nor Prefect (run under ``python -X importtime``,
which lists every module a process imports)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from cli_support import FilledStore, make_filled_store

from ckptstore import CheckpointStore

HEAVY = ("torch", "zarr", "prefect")
_MODULE = re.compile(r"^import time:\s+\d+ \|\s+\d+ \| +([\w.]+)\s*$", re.M)


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory, catalog_template: Path) -> FilledStore:
    return make_filled_store(tmp_path_factory.mktemp("startup"), catalog_template)


def imported(args: list[str], env: dict[str, str] | None = None) -> tuple[int, set[str], str]:
    """Run ``python -X importtime -m ckptstore ARGS``; its exit code, the top-level packages
    it imported, and its stdout."""
    proc = subprocess.run([sys.executable, "-X", "importtime", "-m", "ckptstore", *args],
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, **(env or {})})
    modules = {name.split(".")[0] for name in _MODULE.findall(proc.stderr)}
    return proc.returncode, modules, proc.stdout


COMMANDS = [
    ["--version"], ["--help"], ["ls", "--help"], ["ls", "--json"], ["ls"], ["runs", "--json"],
    ["du", "--json"], ["events", "--json"], ["config", "--json"],
    ["lineage", "tuned@latest", "--json"], ["show", "tuned@latest", "--json"],
    ["show", "tuned@latest"],
]


@pytest.mark.parametrize("args", COMMANDS, ids=" ".join)
def test_catalog_commands_never_import_torch_zarr_or_prefect(
        args: list[str], store: FilledStore) -> None:
    extra = [] if args[0].startswith("--") else ["--config", str(store.config)]
    code, modules, out = imported([*args, *extra])
    assert code == 0, out
    assert not modules & set(HEAVY), sorted(modules & set(HEAVY))
    assert "ckptstore" in modules  # the check itself works: it sees our own package


def test_runs_diff_never_imports_torch_zarr_or_prefect(
        tmp_path: Path, catalog_template: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CKPT_CAPTURE", "1")  # contexts to compare (off in the rest of the suite)
    filled = make_filled_store(tmp_path, catalog_template)
    code, modules, out = imported(["runs", "diff", "base", "tuned", "--config",
                                   str(filled.config)])
    assert code == 0 and "same context" in out, out
    assert not modules & set(HEAVY), sorted(modules & set(HEAVY))


def test_tab_completion_rides_the_fast_path() -> None:
    code, modules, out = imported([], env={"_CKPT_COMPLETE": "complete_bash",
                                           "COMP_WORDS": "ckpt l", "COMP_CWORD": "1"})
    assert code == 0 and {"ls", "lineage"} <= set(out.split())
    assert not modules & set(HEAVY), sorted(modules & set(HEAVY))


#: What the upkeep flows do, each in a fresh process on a worker: copy, verify, prune, restore,
#: clean and push checkpoints as files, never as tensors.
UPKEEP = [
    ["archive", "--run", "base"], ["verify", "base@latest"], ["restore", "base@10"],
    ["prune", "--keep-last", "1", "--tier", "hot", "--run", "base"], ["gc"],
    ["prefetch", "base@20"],
]
UPKEEP_FLOWS = ("archive", "retention", "gc", "verify", "restore", "prefetch", "sync")


def test_upkeep_never_imports_torch_or_zarr(tmp_path: Path, catalog_template: Path) -> None:
    # Importing torch costs a flow run more than a second of CPU on the node it shares with
    # training (src/ckptstore/store.py imports the tensor operations where they are used).
    filled = make_filled_store(tmp_path, catalog_template)
    for args in UPKEEP:
        code, modules, out = imported([*args, "--config", str(filled.config)])
        assert code == 0, (args, out)
        assert not modules & {"torch", "zarr", "prefect"}, (args, sorted(modules & set(HEAVY)))
    other = tmp_path / "other"
    other.mkdir()
    (other / "ckptstore.toml").write_text(f'root = "{other / "store"}"\n')
    CheckpointStore.open(config=other / "ckptstore.toml").close()
    for args in (["--config", str(filled.config), "remote", "add", "origin",
                  "--config", str(other / "ckptstore.toml")],
                 ["push", "base@latest", "--to", "origin", "--config", str(filled.config)]):
        code, modules, out = imported(args)
        assert code == 0, (args, out)
        assert not modules & {"torch", "zarr", "prefect"}, (args, sorted(modules & set(HEAVY)))
    with CheckpointStore.open(config=other / "ckptstore.toml") as store:
        assert store.get("base@latest").step == 100
    with CheckpointStore.open(config=filled.config) as store:
        # The commands did their work: archived, pruned from hot, prefetched back.
        assert "warm" in store.get("base@10").tiers
        assert "hot" not in store.get("base@10").tiers
        assert "hot" in store.get("base@20").tiers
    flows = "; ".join(f"import ckptstore.flows.{name}" for name in UPKEEP_FLOWS)
    proc = subprocess.run([sys.executable, "-X", "importtime", "-c", flows],
                          capture_output=True, text=True, timeout=120)
    modules = {name.split(".")[0] for name in _MODULE.findall(proc.stderr)}
    assert proc.returncode == 0 and "prefect" in modules, proc.stderr[-2000:]
    assert not modules & {"torch", "zarr"}, sorted(modules & {"torch", "zarr"})


def test_a_command_that_reads_tensors_still_works(store: FilledStore) -> None:
    # The counter-check: the store (and torch) load where a command needs them.
    code, modules, _ = imported(["diff", "base@10", "base@20", "--json",
                                 "--config", str(store.config)])
    assert code == 0 and "torch" in modules


def test_the_head_read_from_the_revision_files_is_alembics() -> None:
    # Opening a catalog compares its revision with this one without importing Alembic.
    from ckptstore.catalog import migrate

    assert migrate._head_from_files() == migrate._script().get_current_head()
