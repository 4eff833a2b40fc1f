"""The README's tour, run as written: its Python API block trains a store (after a prelude
that defines what the block takes as given: a model, an optimizer and earlier saves), then
every command of its shell blocks runs against that store, in order, command by command,
including `ckpt export` of a default checkpoint and its import into another store, which
loads bit for bit."""

from __future__ import annotations

import re
import shlex
import subprocess
from pathlib import Path

import pytest
import torch

from ckptstore.store import CheckpointStore

README = Path(__file__).resolve().parent.parent / "README.md"
#: Commands that serve until interrupted: started by a user, not by a test.
SERVERS = {"ui", "serve", "agent"}


def _section(title: str) -> str:
    text = README.read_text(encoding="utf-8")
    start = text.index(title)
    end = text.find("\n### ", start + len(title))
    return text[start:end if end != -1 else None]


def _blocks(section: str, lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", section, re.S)


def _split(line: str) -> list[list[str]]:
    words = shlex.split(line, comments=True)
    commands: list[list[str]] = [[]]
    for word in words:
        if word.endswith(";"):
            commands[-1].append(word[:-1])
            commands.append([])
        else:
            commands[-1].append(word)
    return [c for c in commands if c]


def _prelude(work: Path) -> dict[str, object]:
    """What the tour's Python block takes as given, and the inputs its shell blocks name."""
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 4)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 16)).sum().backward()
    opt.step()
    with CheckpointStore.open(work / "ckpt") as store:
        # Nine earlier saves: the block merges run-a@v8..v10 and diffs v1 with v2.
        for i in range(1, 10):
            with torch.no_grad():
                model.weight.add_(0.01)
            store.save("run-a", step=10 * i, metrics={"loss": 3.0 - 0.1 * i},
                       state={"model": model.state_dict(), "optimizer": opt.state_dict(),
                              "step": 10 * i, "rng": torch.get_rng_state()})
        for n, site in enumerate(("site-a", "site-b", "site-c")):
            store.save(site, step=1, state={"model": {"w": torch.full((8,), float(n))}})
    torch.save({"w": torch.arange(6.0)}, work / "old.pt")
    (work / "ckptstore.toml").write_text('root = "ckpt"\n[tiers]\nwarm = "warm"\n')
    return {"model": model, "opt": opt}


def test_the_readme_tour_runs_as_written(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    from ckptstore.cli.app import main

    monkeypatch.chdir(tmp_path)
    for var in ("CKPT_CONFIG", "CKPT_ROOT", "CKPT_CATALOG_URL", "CKPT_HOT", "CKPT_WARM"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("CKPT_CAPTURE", "1")  # a user's default (the suite turns it off)
    # The tour is run from a training project's git checkout (`ckpt reproduce` needs a commit).
    (tmp_path / "train.py").write_text("# the training script\n")
    (tmp_path / ".gitignore").write_text("ckpt/\nwarm/\n")
    for git in (["init", "-q"], ["add", "train.py", ".gitignore"],
                ["-c", "user.name=t", "-c", "user.email=t@example.invalid", "commit", "-qm", "t"]):
        subprocess.run(["git", *git], cwd=tmp_path, check=True)
    given = _prelude(tmp_path)
    (python,) = _blocks(_section("### Python API"), "python")
    namespace = dict(given)
    exec(compile(python, "README.md (Python API)", "exec"), namespace)
    namespace["store"].close()

    commands = [c for block in (_blocks(_section("### The `ckpt` command"), "bash")
                                + _blocks(_section("### Merging checkpoints"), "bash"))
                for c in _split_block(block)]
    assert len(commands) >= 20 and ["ckpt", "export", "run-a@latest", "--out",
                                    "ck.tar"] in commands
    ran = []
    for argv in commands:
        if argv[1] in SERVERS:
            continue
        capsys.readouterr()
        code = main(argv[1:])
        out, err = capsys.readouterr()
        assert code == 0, f"{shlex.join(argv)} exited {code}: {err}{out}"
        ran.append(argv[1])
    assert {"export", "import-bundle", "archive", "merge", "compact"} <= set(ran)

    # The bundle of a default checkpoint (it deduplicates unchanged tensors against earlier
    # versions) arrived whole: the same bytes from the other store.
    with CheckpointStore.open(tmp_path / "ckpt") as here, \
            CheckpointStore.open(tmp_path / "elsewhere", create=False) as there:
        exported = there.get("run-a@latest").id
        assert here.manifest(exported).referenced_checkpoints()  # really a dedup save
        mine, theirs = here.load(exported), there.load(exported)
        flat_a, flat_b = _flat(mine), _flat(theirs)
        assert flat_a.keys() == flat_b.keys()
        for key, value in flat_a.items():
            if isinstance(value, torch.Tensor):
                assert value.dtype == flat_b[key].dtype and torch.equal(value, flat_b[key]), key
            else:
                assert value == flat_b[key], key


def _split_block(block: str) -> list[list[str]]:
    return [c for line in block.splitlines() for c in _split(line) if c[0] == "ckpt"]


def _flat(tree: object, prefix: str = "") -> dict[str, object]:
    if isinstance(tree, dict):
        out: dict[str, object] = {}
        for k, v in tree.items():
            out.update(_flat(v, f"{prefix}{k}/"))
        return out
    if isinstance(tree, list | tuple):
        out = {}
        for i, v in enumerate(tree):
            out.update(_flat(v, f"{prefix}{i}/"))
        return out
    return {prefix: tree}
