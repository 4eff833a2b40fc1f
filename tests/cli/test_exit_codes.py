"""Exit codes, walked over every command: 2 for bad usage (an unknown option, a bad option
value, a malformed expression or reference, an unknown format), 1 for a well-formed request
that fails (a missing run or checkpoint). The README promises "2 = bad usage"."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from cli_support import Ckpt, FilledStore, make_filled_store

from ckptstore.cli.commands import click_command

W = "{work}"


def leaf_commands(group: Any = None, prefix: tuple[str, ...] = ()) -> set[str]:
    """Every command a user can run (``"db upgrade"``, ...)."""
    group = click_command() if group is None else group
    found: set[str] = set()
    for name, command in group.commands.items():
        if hasattr(command, "commands"):
            found |= leaf_commands(command, (*prefix, name))
        else:
            found.add(" ".join((*prefix, name)))
    return found


#: Per command: argument lists that are bad usage. Commands that take no value at all are
#: covered by the unknown option every command is also run with.
USAGE: dict[str, list[list[str]]] = {
    "init": [],
    "ls": [["--where", "loss<<2"], ["--order-by", "bogus"], ["--limit", "abc"],
           ["--where", "loss<"]],
    "show": [["run-a@v0"], ["base@best:"], ["base@latest", "--tensors", "x"]],
    "runs": [], "du": [], "config": [], "db upgrade": [], "db current": [], "db history": [],
    "remote ls": [],
    "events": [["run-a@v0"], ["--limit", "x"]],
    "alias": [["base@v0", "prod"], ["base@latest", "bad name"]],
    "pin": [["base@v0"]], "unpin": [["base@v0"]],
    "gc": [["--older-than", "soon"]],
    "archive": [["--ref", "base@v0"], ["--run", "bad name"]],
    "prune": [["--keep-best", "val_loss"], ["--keep-last", "x"]],
    "restore": [["base@v0"]],
    "verify": [["base@v0"], []],
    "convert": [["base@latest", "--format", "onnx", "--out", f"{W}/x"], ["base@latest"],
                ["base@latest", "--codec", "gzip"]],
    "import": [[f"{W}/s.pt", "--run", "bad name", "--step", "1"],
               [f"{W}/s.pt", "--run", "r", "--step", "1", "--format", "onnx"]],
    "serve": [["--pool", ""]],
    "agent": [["--pool", ""]],
    "doctor": [["--grace", "soon"]],
    "sign": [["base@v0", "--key", f"{W}/k"]],
    "verify-signature": [["base@v0", "--pubkey", f"{W}/p"]],
    "export": [["base@v0", "--out", f"{W}/x.tar"]],
    "import-bundle": [[f"{W}/b.tar", "--run", "bad name"]],
    "keygen": [["--out", f"{W}/keys", "--name", "bad name"]],
    "tiers": [["--probe-mib", "0"]],
    "ui": [["--port", "abc"]],
    "report": [["--html", f"{W}/r.html", "--max-checkpoints", "x"]],
    "diff": [["base@v0", "base@10"]],
    "compact": [["base@v0"]],
    "lineage": [["base@v0"], ["base@latest", "--format", "svg"]],
    "merge": [["base@10", "base@20", "--run", "s", "--step", "1", "--method", "median"],
              ["base@10", "base@v0", "--run", "s", "--step", "1"]],
    "prefetch": [["base@v0"], ["base@10", "--to", "cold"]],
    "thaw": [["base@v0"]],
    "push": [["base@v0", "--to", "x"]],
    "pull": [["base@v0", "--from", "x"]],
    "sync": [["bad name", "--to", "x"]],
    "remote add": [["bad name", "--config", f"{W}/x.toml"]],
    "remote rm": [["bad name"]],
    "reproduce": [["base@v0", "--dir", f"{W}/r"]],
}
#: Well-formed requests that fail: exit 1.
FAILED = {
    "show": ["nope@latest"], "events": ["nope@latest"], "alias": ["nope@latest", "prod"],
    "pin": ["nope@latest"], "unpin": ["nope@latest"], "restore": ["nope@latest"],
    "verify": ["nope@latest"], "convert": ["nope@latest", "--out", f"{W}/x.pt"],
    "import": [f"{W}/missing.pt", "--run", "r", "--step", "1"],
    "sign": ["nope@latest", "--key", f"{W}/missing.key"],
    "verify-signature": ["base@latest", "--pubkey", f"{W}/missing.pub"],
    "export": ["nope@latest", "--out", f"{W}/x.tar"],
    "import-bundle": [f"{W}/missing.tar"], "diff": ["nope@latest", "base@10"],
    "compact": ["nope@latest"], "lineage": ["nope@latest"],
    "merge": ["base@10", "nope@latest", "--run", "s", "--step", "1"],
    "prefetch": ["nope@latest"], "thaw": ["nope@latest"], "push": ["base@10", "--to", "nope"],
    "pull": ["base@10", "--from", "nope"], "sync": ["base", "--to", "nope"],
    "remote rm": ["nope"], "archive": ["--ref", "nope@latest"],
    "reproduce": ["nope@latest", "--dir", f"{W}/r"],
}


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory, catalog_template: Path) -> FilledStore:
    return make_filled_store(tmp_path_factory.mktemp("exit-codes"), catalog_template)


def _args(fs: FilledStore, args: list[str]) -> list[str]:
    return [a.replace(W, str(fs.work)) for a in args]


def test_the_walk_covers_every_command() -> None:
    assert set(USAGE) == leaf_commands()


@pytest.mark.parametrize("command", sorted(USAGE))
def test_bad_usage_exits_2(command: str, store: FilledStore, ckpt: Ckpt) -> None:
    s = ["--config", str(store.config)]
    for args in [["--no-such-option"], *USAGE[command]]:
        result = ckpt(*s, *command.split(), *_args(store, args))
        assert result.code == 2, (command, args, result.code, result.err + result.out)
        assert "Traceback" not in result.err
    for args in USAGE[command][:1]:  # in JSON too
        result = ckpt(*s, *command.split(), *_args(store, args), "--json")
        assert result.code == 2 and "error" in json.loads(result.out), (command, result.out)


@pytest.mark.parametrize("command", sorted(FAILED))
def test_failed_requests_exit_1(command: str, store: FilledStore, ckpt: Ckpt) -> None:
    result = ckpt("--config", store.config, *command.split(), *_args(store, FAILED[command]))
    assert result.code == 1, (command, result.code, result.err + result.out)
    assert result.err.startswith("error: ") and "Traceback" not in result.err
