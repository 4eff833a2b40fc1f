"""The ``ckpt remote``, ``push``, ``pull`` and ``sync`` commands (src/ckptstore/cli/remote.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from ckptstore.cli.app import main

pytestmark = [pytest.mark.postgres, pytest.mark.s3]


def _ckpt(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, Any]:
    code = main(list(args))
    out = capsys.readouterr().out
    return code, json.loads(out) if "--json" in args else out


def test_remote_push_pull_sync_from_the_command_line(
        stores: Any, kit: Any, capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    a, c = stores.a, stores.c
    s = kit.state(30)
    one = a.save("cli", 1, s, metrics={"loss": 2.0})
    two = a.save("cli", 2, kit.tweaked(s), metrics={"loss": 1.0})
    a_cfg, c_cfg = str(stores.a_config), str(stores.c_config)

    code, listed = _ckpt(capsys, "remote", "ls", "--config", a_cfg, "--json")
    assert code == 0 and [r["name"] for r in listed] == ["b"]
    code, added = _ckpt(capsys, "--config", c_cfg, "remote", "add", "a", "--config", a_cfg,
                        "--json")
    assert code == 0 and added["config"] == str(Path(a_cfg).resolve())

    code, pushed = _ckpt(capsys, "push", "cli@v1", "--to", "b", "--config", a_cfg, "--json")
    assert code == 0 and pushed["pushed"] == [one.id] and pushed["bytes_sent"] > 0
    code, synced = _ckpt(capsys, "sync", "cli", "--to", "b", "--config", a_cfg, "--json")
    assert code == 0 and synced["pushed"] == [two.id] and synced["present"] == [one.id]
    code, pulled = _ckpt(capsys, "pull", "cli@latest", "--from", "b", "--config", c_cfg,
                         "--json")
    assert code == 0 and pulled["direction"] == "pull"
    assert set(pulled["pushed"]) == {one.id, two.id}
    assert kit.same(c.load("cli@latest"), kit.tweaked(s))
    code, text = _ckpt(capsys, "push", "cli@latest", "--to", "b", "--config", a_cfg)
    assert code == 0 and "1 already there" in text

    # Our errors: one line, exit 1, and the JSON error document.
    code, err = _ckpt(capsys, "push", "cli@latest", "--to", "nope", "--config", a_cfg,
                      "--json")
    assert code == 1 and err["error"]["type"] == "RemoteError"
    code, err = _ckpt(capsys, "--config", a_cfg, "remote", "add", "b", "--config", a_cfg,
                      "--json")
    assert code == 1 and err["error"]["type"] == "RemoteError"
    code, err = _ckpt(capsys, "pull", "cli@v7", "--from", "b", "--config", c_cfg, "--json")
    assert code == 1 and err["error"]["type"] == "CheckpointNotFoundError"
    code, removed = _ckpt(capsys, "remote", "rm", "a", "--config", c_cfg, "--json")
    assert code == 0 and removed == {"removed": "a"}
    code, text = _ckpt(capsys, "push", "--help")
    assert code == 0 and "--self-contained" in text and "--require-signature" in text
