"""Reproduce a result from the catalog, as a user would (issue: every checkpoint records what
made it).

A training script in a git repository, with an uncommitted change, trains a few CPU steps
and saves; from another directory ``ckpt reproduce REF --dir D`` writes the recipe; the
recipe, run in a fresh directory without network (the code is cloned from the recorded
checkout, the lock checked against this environment, not installed), resumes the run, and
the next steps' weights equal the original run's bit for bit.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from context_support import git

from ckptstore import CheckpointStore
from ckptstore.capture import blob_digest

pytestmark = [pytest.mark.skipif(shutil.which("git") is None, reason="needs git"),
              pytest.mark.slow]

STEPS, SAVE_AT = 6, 3

TRAIN = '''\
"""A tiny training run: resumes from $CKPT_RESUME when the recipe sets it."""
import os
import sys

import torch

from ckptstore import CheckpointStore

LR = {lr}


def batch(step):
    gen = torch.Generator().manual_seed(step)
    return torch.randn(8, 4, generator=gen), torch.randn(8, 2, generator=gen)


def main(steps, out):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    start = 0
    with CheckpointStore.open() as store:
        resume = os.environ.get("CKPT_RESUME")
        if resume:
            state = store.load(resume)
            model.load_state_dict(state["model"])
            for p, buf in zip(model.parameters(), state["momentum"]):
                opt.state[p]["momentum_buffer"] = buf.clone()
            start = int(state["step"])
        for step in range(start + 1, steps + 1):
            x, y = batch(step)
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            if step == {save_at} and not resume:
                momentum = [opt.state[p]["momentum_buffer"] for p in model.parameters()]
                store.save("e2e", step, {{"model": model.state_dict(), "momentum": momentum,
                                          "step": step}}, config={{"lr": LR, "steps": steps}})
    torch.save(model.state_dict(), out)


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2])
'''


def _env(store: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CKPT_")}
    env.update(CKPT_ROOT=str(store), CKPT_CAPTURE="1", PYTHON=sys.executable,
               PATH=f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}",
               GIT_CONFIG_NOSYSTEM="1")
    return env


def _run(args: list[str], cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=300,
                          check=False)
    assert done.returncode == 0, f"{args}: {done.stdout}\n{done.stderr}"
    return done


def test_a_recipe_resumes_the_run_bit_for_bit(tmp_path: Path) -> None:
    repo, store = tmp_path / "repo", tmp_path / "store"
    repo.mkdir()
    env = _env(store)
    git(repo, "init", "-q", "-b", "main")
    (repo / "train.py").write_text(TRAIN.format(lr=0.1, save_at=SAVE_AT))
    git(repo, "add", ".")
    git(repo, "commit", "-qm", "the committed run")
    # The result comes from an uncommitted change: the recipe must bring it back.
    (repo / "train.py").write_text(TRAIN.format(lr=0.03, save_at=SAVE_AT))
    (repo / "helper.txt").write_text("an untracked file\n")
    _run([sys.executable, "train.py", str(STEPS), "final.pt"], repo, env)
    original = torch.load(repo / "final.pt")

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    shown = json.loads(_run([sys.executable, "-m", "ckptstore", "show", f"e2e@{SAVE_AT}",
                             "--json"], elsewhere, env).stdout)
    context = shown["reproduction"]["context"]
    assert context["commit"] == git(repo, "rev-parse", "HEAD") and context["dirty"]
    assert context["command"] == ["train.py", str(STEPS), "final.pt"]
    assert context["config"] == {"lr": 0.03, "steps": STEPS}
    with CheckpointStore.open(store) as opened:  # the whole recorded document
        recorded = opened.catalog.context_of(opened.catalog.get(f"e2e@{SAVE_AT}"))
    assert recorded is not None
    command, environment = recorded.document["command"], recorded.document["environment"]
    assert command["entry"] == str((repo / "train.py").resolve())
    assert command["entry_blake3"] == blob_digest((repo / "train.py").read_bytes())
    assert environment["platform"] == platform.platform()
    assert recorded.document["seeds"]["torch"] == 0  # train.py's torch.manual_seed(0)
    recipe = tmp_path / "recipe"
    _run([sys.executable, "-m", "ckptstore", "reproduce", f"e2e@{SAVE_AT}", "--dir",
          str(recipe)], elsewhere, env)
    assert {p.name for p in recipe.iterdir()} == {"reproduce.sh", "change.patch",
                                                  "requirements.txt", "context.json"}

    fresh = tmp_path / "fresh"
    fresh.mkdir()
    _run(["sh", str(recipe / "reproduce.sh"), str(fresh / "src")], fresh, env)
    resumed = torch.load(fresh / "src" / "final.pt")
    assert (fresh / "src" / "helper.txt").read_text() == "an untracked file\n"
    assert set(resumed) == set(original)
    for key, value in original.items():
        assert torch.equal(resumed[key].view(torch.int32), value.view(torch.int32)), key
    # A different LR (the committed one) would not have matched: the change mattered.
    assert "LR = 0.03" in (fresh / "src" / "train.py").read_text()


def test_check_lists_every_difference(tmp_path: Path) -> None:
    repo, store = tmp_path / "repo", tmp_path / "store"
    repo.mkdir()
    env = _env(store)
    git(repo, "init", "-q", "-b", "main")
    (repo / "train.py").write_text(TRAIN.format(lr=0.1, save_at=1))
    git(repo, "add", ".")
    git(repo, "commit", "-qm", "one")
    _run([sys.executable, "train.py", "1", "final.pt"], repo, env)
    (repo / "final.pt").unlink()
    same = subprocess.run([sys.executable, "-m", "ckptstore", "reproduce", "e2e@1",
                           "--check", "--json"], cwd=repo, env=env, capture_output=True,
                          text=True, timeout=120, check=False)
    assert same.returncode == 0, same.stdout + same.stderr
    assert json.loads(same.stdout) == {"differences": []}
    (repo / "train.py").write_text(TRAIN.format(lr=0.2, save_at=1))
    git(repo, "commit", "-qam", "two")
    (repo / "cfg.json").write_text('{"lr": 0.5, "steps": 1}')
    differs = subprocess.run([sys.executable, "-m", "ckptstore", "reproduce", "e2e@1",
                              "--check", "--json", "--compare-config", "cfg.json"],
                             cwd=repo, env=env, capture_output=True, text=True, timeout=120,
                             check=False)
    assert differs.returncode == 1, differs.stdout + differs.stderr
    report = json.loads(differs.stdout)
    assert "differences" in report, report
    fields = {d["field"] for d in report["differences"]}
    assert {"code.commit", "config.lr", "code.dirty", "code.change"} <= fields
