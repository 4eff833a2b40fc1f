"""The conventions every ``ckpt`` command follows: ``--json`` (results and failures), the
global options before or after the command name, ``--version`` and shell completion."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from cli_support import Ckpt, FilledStore, make_filled_store

from ckptstore.cli.app import main
from ckptstore.cli.commands import click_command
from ckptstore.store import CheckpointStore

#: Commands that run until interrupted (servers): they print no result to put in JSON.
SERVERS = {"serve", "ui", "agent"}
#: Commands whose own --config names another file (the remote store's config): this store's
#: --config goes before the command name; --store and --verbose go anywhere.
OWN_CONFIG = {"remote add"}


def leaf_commands(group: Any = None, prefix: tuple[str, ...] = ()) -> dict[str, Any]:
    """``"db upgrade"`` -> click command, for every command a user can run."""
    group = click_command() if group is None else group
    found: dict[str, Any] = {}
    for name, command in group.commands.items():
        path = (*prefix, name)
        if hasattr(command, "commands"):
            found.update(leaf_commands(command, path))
        else:
            found[" ".join(path)] = command
    return found


@dataclass
class Case:
    """One command run with --json: its arguments and what its JSON must hold."""

    command: str
    args: list[str] = field(default_factory=list)
    check: Callable[[Any], bool] = lambda doc: True
    prepare: Callable[[FilledStore], None] | None = None
    code: int = 0


def _keypair(fs: FilledStore) -> None:
    from ckptstore.ops.sharing.signing import generate_keypair

    if not (fs.work / "alice.key").exists():
        generate_keypair(fs.work, "alice")


def _signed(fs: FilledStore) -> None:
    from ckptstore.ops.sharing.signing import sign_checkpoint

    _keypair(fs)
    with CheckpointStore.open(config=fs.config) as store:
        sign_checkpoint(store, "base@latest", fs.work / "alice.key")


def _pt_file(fs: FilledStore) -> None:
    (fs.work / "pt").mkdir(exist_ok=True)
    torch.save({"w": torch.arange(8.0)}, fs.work / "pt" / "state.pt")


def _bundle(fs: FilledStore) -> None:
    from ckptstore.ops.sharing.bundle import export_bundle

    with CheckpointStore.open(config=fs.config) as store:
        export_bundle(store, "tuned@latest", fs.work / "tuned.tar")


def _other_store(fs: FilledStore) -> None:
    """A second store's config in the work directory (created when first opened)."""
    (fs.work / "other.toml").write_text(f'root = "{fs.work / "other"}"\n')


def _warm_tier(fs: FilledStore) -> None:
    """The warm tier's directory, which the first archive creates (``tiers`` exits 1 for a
    tier that is not reachable)."""
    (fs.config.parent / "warm").mkdir(exist_ok=True)


def _remote(fs: FilledStore) -> None:
    """The remote ``other`` registered, as the ``remote add`` case leaves it."""
    from ckptstore.ops.sharing.remote import add_remote

    _other_store(fs)
    with CheckpointStore.open(config=fs.config) as store:
        if "other" not in {r.name for r in store.catalog.remotes()}:
            add_remote(store, "other", fs.work / "other.toml")


def _pushed(ref: str) -> Callable[[FilledStore], None]:
    """``ref`` on the remote ``other`` (a push of what is there already changes nothing)."""

    def prepare(fs: FilledStore) -> None:
        _remote(fs)
        assert main(["--config", str(fs.config), "push", ref, "--to", "other"]) == 0

    return prepare


def _record(doc: Any) -> bool:
    """The shape `ckpt ls --json` gives a checkpoint."""
    return isinstance(doc, dict) and {"id", "ref", "run", "step", "replicas"} <= set(doc)


W = "{work}"  # replaced by the test's work directory
CASES = [
    Case("init", [f"{W}/new-store"], lambda d: d["created"] is True
         and d["root"].endswith("/new-store") and d["hot"].endswith("/new-store/hot")),
    Case("ls", check=lambda d: isinstance(d, list) and all(_record(r) for r in d) and len(d) == 6),
    Case("show", ["base@latest"], lambda d: d["checkpoint"]["step"] == 100),
    Case("runs", check=lambda d: {r["name"] for r in d} >= {"base", "tuned"}),
    # Saved with capture off (tests/conftest.py): no context, a clear error in JSON.
    Case("reproduce", ["base@latest", "--check"], lambda d: "no context" in
         d["error"]["message"], code=1),
    Case("lineage", ["tuned@latest"],
         lambda d: d["direction"] == "ancestors" and d["nodes"][0]["ref"] == "base@v3"
         and d["edges"] == [{"from": "base@v3", "to": "tuned@v1", "kind": "parent"}]),
    Case("alias", ["base@20", "prod"],
         lambda d: d["alias"] == "prod" and d["checkpoint"]["step"] == 20),
    Case("pin", ["base@10"], lambda d: _record(d) and d["pinned"] is True),
    Case("unpin", ["base@10"], lambda d: _record(d) and d["pinned"] is False),
    Case("du", check=lambda d: sum(r["checkpoints"] for r in d) == 6),
    Case("events", ["--limit", "3"], lambda d: len(d) == 3 and "kind" in d[0]),
    Case("gc", ["--dry-run"], lambda d: d["dry_run"] is True and d["removed_dirs"] == []),
    Case("db upgrade", check=lambda d: d["revision"] and "catalog.db" in d["catalog"]),
    Case("db current", check=lambda d: bool(d["revision"])),
    Case("db history", check=lambda d: any(r["is_head"] for r in d["revisions"])),
    Case("archive", ["--run", "base"],
         lambda d: len(d["archive"]["archived"]) == 3 and d["demote"] is None),
    Case("prune", ["--dry-run", "--keep-last", "1"], lambda d: isinstance(d, dict)),
    Case("restore", ["base@10", "--to", f"{W}/restored"],
         lambda d: d["checkpoint"]["step"] == 10 and "/restored/" in d["path"]),
    # 6 hot copies, and the warm copies archive made.
    Case("verify", ["--all"], lambda d: len(d["checked"]) >= 6 and not d["unrepaired"]),
    Case("verify", ["base@latest", "--signature", "--pubkey", f"{W}/alice.pub"],
         lambda d: d["valid"] is True, prepare=_signed),
    Case("convert", ["base@latest", "--format", "safetensors", "--out", f"{W}/w.safetensors"],
         lambda d: d["outputs"][0].endswith("w.safetensors") and d["bytes"] > 0),
    Case("convert", ["base@latest", "--codec", "zstd-3"],
         lambda d: d["checkpoint"]["codec"] == "zstd-3" and d["source"] == "base@latest"),
    Case("convert", ["--input-dir", f"{W}/pt", "--output-dir", f"{W}/out", "-f", "safetensors"],
         lambda d: len(d["outputs"]) == 1, prepare=_pt_file),
    Case("import", [f"{W}/pt/state.pt", "--run", "imported", "--step", "7"],
         lambda d: _record(d) and d["ref"] == "imported@v1", prepare=_pt_file),
    Case("export", ["tuned@latest", "--out", f"{W}/t.tar"],
         lambda d: d["ref"] == "tuned@v1" and d["bytes"] > 0),
    Case("import-bundle", [f"{W}/tuned.tar", "--run", "tuned"],
         lambda d: _record(d) and d["ref"] == "tuned@v1", prepare=_bundle),
    Case("keygen", ["--out", f"{W}/keys", "--name", "bob"],
         lambda d: len(d["fingerprint"]) == 64 and d["public_key"].endswith("bob.pub")),
    Case("sign", ["base@latest", "--key", f"{W}/alice.key"],
         lambda d: d["ref"].startswith("base@v") and d["signature"], prepare=_keypair),
    Case("verify-signature", ["base@latest", "--pubkey", f"{W}/alice.pub"],
         lambda d: d["valid"] is True, prepare=_signed),
    Case("diff", ["base@10", "base@20"], lambda d: d["summary"]["elements_changed"] == 256),
    Case("compact", ["delta@latest"],
         lambda d: _record(d) and d["kind"] == "full" and d["ref"] == "delta@v3"),
    Case("merge", ["base@10", "base@20", "--run", "soup", "--step", "1"],
         lambda d: _record(d["checkpoint"]) and d["checkpoint"]["ref"] == "soup@v1"
         and [i["ref"] for i in d["merge"]["inputs"]] == ["base@v1", "base@v2"]),
    Case("prefetch", ["base@10"], lambda d: d["to"] == "hot" and d["ref"].startswith("base@v")
         and d["lease_expires_at"]),
    Case("thaw", ["base@latest"], lambda d: d["ref"].startswith("base@v") and d["path"]),
    Case("tiers", check=lambda d: {t["name"] for t in d} == {"hot", "warm"},
         prepare=_warm_tier),
    Case("report", ["--html", f"{W}/report.html"], lambda d: d["bytes"] > 0),
    Case("doctor", check=lambda d: d["ok"] is True),
    Case("config", check=lambda d: d["settings"]["hot"]["value"].endswith("/hot")
         and "from" in d["settings"]["codec"]),
    Case("remote add", ["other", "--config", f"{W}/other.toml"],
         lambda d: d["name"] == "other" and d["config"].endswith("other.toml"),
         prepare=_other_store),
    Case("remote ls", check=lambda d: [r["name"] for r in d] == ["other"], prepare=_remote),
    Case("push", ["base@10", "--to", "other"],
         lambda d: d["direction"] == "push" and len(d["pushed"]) == 1 and d["bytes_sent"] > 0,
         prepare=_remote),
    Case("sync", ["base", "--to", "other"],
         lambda d: len(d["pushed"]) >= 2 and len(d["present"]) == 1,
         prepare=_pushed("base@10")),
    Case("pull", ["base@latest", "--from", "other"],
         lambda d: d["direction"] == "pull" and len(d["present"]) == 1,
         prepare=_pushed("base@latest")),
    Case("remote rm", ["other"], lambda d: d == {"removed": "other"}, prepare=_remote),
]


def test_every_command_that_prints_a_result_has_a_json_case() -> None:
    covered = {case.command for case in CASES}
    assert covered == set(leaf_commands()) - SERVERS


@pytest.fixture(scope="module", params=["after", "before", "both"])
def placed(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory,
           catalog_template: Path) -> tuple[str, FilledStore, FilledStore]:
    """Where the global options go (after the command name, before it, or both with
    different values) and a store for that placement. The cases change it as they run; each
    case's ``prepare`` makes what the case needs, so a case passes alone as well as after the
    others (``pytest -n 2`` without ``--dist loadfile`` spreads them over processes)."""
    base = tmp_path_factory.mktemp(f"json-{request.param}")
    decoy = make_filled_store(base / "decoy", catalog_template)
    return request.param, make_filled_store(base / "real", catalog_template), decoy


def _argv(case: Case, placement: str, fs: FilledStore, decoy: FilledStore) -> list[str]:
    args = [a.replace(W, str(fs.work)) for a in case.args]
    command = case.command.split()
    mine = ["--config", str(fs.config), "--store", str(fs.root)]
    if case.command in OWN_CONFIG:
        if placement == "after":
            return [*command, *args, "--json", "--store", str(fs.root)]
        if placement == "both":
            return ["-s", str(decoy.root), *command, *args, "--json", "-v", "--store",
                    str(fs.root)]
    if placement == "after":
        return [*command, *args, "--json", *mine]
    if placement == "before":
        return [*mine, *command, *args, "--json"]
    # Both: the decoy store before the name, the real one (and -v) after it, which wins.
    return ["--config", str(decoy.config), "-s", str(decoy.root), *command, *args, "--json",
            "-v", *mine]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c.command} {' '.join(c.args)}"[:40])
def test_json_output_and_global_option_placement(
    case: Case, placed: tuple[str, FilledStore, FilledStore], ckpt: Ckpt
) -> None:
    placement, fs, decoy = placed
    if case.prepare is not None:
        case.prepare(fs)
    result = ckpt(*_argv(case, placement, fs, decoy))
    assert result.code == case.code, result.err + result.out
    doc = json.loads(result.out)  # the whole of stdout is one JSON document
    assert case.check(doc), doc


def test_failures_with_json_are_json_too(filled: FilledStore, ckpt: Ckpt) -> None:
    s = ["--store", str(filled.root)]
    result = ckpt("show", "base@7", "--json", *s)
    assert result.code == 1
    error = json.loads(result.out)["error"]
    assert error["type"] == "CheckpointNotFoundError" and "100" in error["message"]
    # Bad usage keeps exit code 2, and says so in JSON.
    result = ckpt("ls", "--json", "--no-such-option", *s)
    assert result.code == 2
    assert json.loads(result.out)["error"]["type"] == "NoSuchOption"
    result = ckpt("show", "--json", *s)
    assert result.code == 2 and json.loads(result.out)["error"]["type"] == "MissingParameter"
    # A check that fails: the error object, exit 1.
    _keypair(filled)
    result = ckpt("verify-signature", "base@latest", "--pubkey", filled.work / "alice.pub",
                  "--json", *s)
    assert result.code == 1
    assert "not signed" in json.loads(result.out)["error"]["message"]
    # Commands that report findings keep their exit 1 with the report itself.
    with CheckpointStore.open(filled.root) as store:
        import shutil

        shutil.rmtree(store.checkpoint_dir("tuned", store.get("tuned@latest").id))
    result = ckpt("doctor", "--json", *s)
    assert result.code == 1 and json.loads(result.out)["ok"] is False
    # Without --json the same failure is one line on stderr, nothing on stdout.
    result = ckpt("show", "base@7", *s)
    assert result.code == 1 and result.out == "" and result.err.startswith("error: ")


def test_every_command_takes_the_global_options_after_its_name() -> None:
    for path, command in leaf_commands().items():
        flags = {opt for param in command.params for opt in getattr(param, "opts", [])}
        assert {"--store", "-s", "--config", "-c", "--verbose", "-v"} <= flags, path


def test_store_after_the_command_wins(filled: FilledStore, ckpt: Ckpt,
                                      tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    assert ckpt("init", empty).code == 0
    result = ckpt("ls", "--store", filled.root, "--json")
    assert result.code == 0 and len(json.loads(result.out)) == 6
    result = ckpt("--store", empty, "ls", "-s", filled.root, "--json")
    assert len(json.loads(result.out)) == 6
    result = ckpt("--store", filled.root, "ls", "--store", empty, "--json")
    assert json.loads(result.out) == []
    # Nested commands too.
    result = ckpt("db", "current", "--store", filled.root, "--json")
    assert result.code == 0 and json.loads(result.out)["revision"]


def _run_cli_lines(*lines: list[str]) -> tuple[list[int], list[str]]:
    """Run each command line through the real ``ckpt`` entry point, in order, in one child
    process (tests/cli/masking_driver.py): its logging is configured by the CLI alone, as in
    ``ckpt`` itself. Returns each line's exit code and what it wrote on stderr."""
    driver = Path(__file__).with_name("masking_driver.py")
    proc = subprocess.run(
        [sys.executable, str(driver), *(json.dumps({"args": line}) for line in lines)],
        capture_output=True, text=True, timeout=120, env=dict(os.environ), check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    codes = [int(m.group(1)) for m in re.finditer(r"^=== \d+ exit (-?\d+)$", proc.stdout,
                                                    re.M)]
    assert len(codes) == len(lines), proc.stdout[-3000:] + proc.stderr[-3000:]
    errs = re.split(r"^=== \d+\n", proc.stderr, flags=re.M)[1:]
    assert len(errs) == len(lines), proc.stderr[-3000:]
    return codes, errs


def test_verbose_after_the_command_logs(filled: FilledStore) -> None:
    # Both runs in one process (starting the CLI costs seconds on a loaded machine): the
    # verbose one first, so it configures logging in a fresh process as `ckpt -v` does; the
    # quiet one after it must turn the INFO lines off again.
    codes, (loud, quiet) = _run_cli_lines(
        ["archive", "--config", str(filled.config), "--verbose"],
        ["archive", "--store", str(filled.root), "--config", str(filled.config)])
    assert codes == [0, 0], loud + quiet
    assert "INFO ckptstore" in loud  # archived ... lines, on stderr
    assert "INFO" not in quiet


def test_version(ckpt: Ckpt) -> None:
    from importlib.metadata import version

    # In this process: `python -m ckptstore` itself is run by the tests around this one.
    result = ckpt("--version")
    assert result.code == 0
    assert result.out.strip() == f"ckpt {version('ckptstore')}"


def test_shell_completion(ckpt: Ckpt, monkeypatch: pytest.MonkeyPatch) -> None:
    # As a bash user runs it. `--show-completion` takes no value: Typer names the shell of
    # the parent process, so the command runs under bash, not under whatever shell started
    # the test run (`sh`, under make, is one Typer refuses).
    script = 'out=$("$0" -m ckptstore --show-completion); rc=$?; printf "%s" "$out"; exit $rc'
    result = subprocess.run(["bash", "-c", script, sys.executable], capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0 and "_CKPT_COMPLETE" in result.stdout, result.stderr
    # What the installed completion script asks for when the user types `ckpt l<TAB>`: the
    # same entry point, answering from its environment (in this process; the interpreter's
    # start is what the run above already paid for).
    monkeypatch.setenv("_CKPT_COMPLETE", "complete_bash")
    monkeypatch.setenv("COMP_WORDS", "ckpt l")
    monkeypatch.setenv("COMP_CWORD", "1")
    answer = ckpt()
    assert answer.code == 0 and {"ls", "lineage"} <= set(answer.out.split())
    monkeypatch.setenv("COMP_WORDS", "ckpt ls --st")
    monkeypatch.setenv("COMP_CWORD", "2")
    assert "--store" in ckpt().out.split()


def test_help_uses_words_users_know(ckpt: Ckpt) -> None:
    """Help texts name commands and conventions, never words of how the tool was planned."""
    planning = re.compile(r"\b(seed|issue|lead|todo|fixme|xxx|ticket|milestone)s?\b", re.I)
    for path in ["", *leaf_commands()]:
        result = ckpt(*path.split(), "--help")
        assert result.code == 0, path
        assert not planning.search(result.out), (path, planning.findall(result.out))
