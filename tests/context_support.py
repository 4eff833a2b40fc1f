"""A git checkout for tests of the context a save records (ckptstore.capture)."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest

__all__ = ["assert_full_context", "git", "training_repo"]


def git(repo: Path, *args: str) -> str:
    """Run git in ``repo`` with a fixed identity; its stdout."""
    return subprocess.run(["git", "-c", "user.email=t@t", "-c", "user.name=t", *args],
                          cwd=repo, check=True, capture_output=True, text=True).stdout.strip()


def training_repo(root: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A checkout with one commit and an uncommitted edit, made the cwd; capture on."""
    root.mkdir(parents=True, exist_ok=True)
    git(root, "init", "-q", "-b", "main")
    (root / "train.py").write_text("LR = 0.1\n")
    git(root, "add", ".")
    git(root, "commit", "-qm", "one")
    (root / "train.py").write_text("LR = 0.2\n")
    monkeypatch.chdir(root)
    monkeypatch.setenv("CKPT_CAPTURE", "1")
    return root


def assert_full_context(doc: dict[str, Any], repo: Path) -> None:
    """Every part of a context is there: code with its change, command, environment."""
    assert doc["code"]["commit"] == git(repo, "rev-parse", "HEAD")
    assert doc["code"]["dirty"] is True and doc["code"]["patch"].startswith("b3:")
    assert doc["command"]["argv"] and doc["command"]["cwd"]
    env = doc["environment"]
    assert env["python"] and env["torch"] and env["lock"].startswith("b3:")
    assert "world_size" in doc and "seeds" in doc
