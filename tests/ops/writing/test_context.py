"""Every save records the run's context: code, command, environment, config."""

from __future__ import annotations

import platform
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from sqlalchemy import text

from ckptstore import CheckpointStore
from ckptstore.capture import blob_digest, capture_context, safe_config
from ckptstore.ops.reading.reproduce import check_against, diff_contexts

GIT = shutil.which("git")
pytestmark = pytest.mark.skipif(GIT is None, reason="needs git")


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-c", "user.email=t@t", "-c", "user.name=t", *args],
                          cwd=repo, check=True, capture_output=True, text=True).stdout.strip()


@pytest.fixture
def repo(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A git checkout with one commit, a tracked edit and an untracked file; the cwd.

    Capture is on (tests/conftest.py turns it off for the rest of the suite).
    """
    monkeypatch.setenv("CKPT_CAPTURE", "1")
    root = tmp_path / "repo"
    root.mkdir()
    _git(root, "init", "-q", "-b", "main")
    (root / "train.py").write_text("print('v1')\n")
    _git(root, "add", ".")
    _git(root, "commit", "-qm", "one")
    _git(root, "remote", "add", "origin", "https://alice:s3cret@git.example.com/team/x.git")
    (root / "train.py").write_text("print('v2')\n")
    (root / "notes.txt").write_text("untracked\n")
    monkeypatch.chdir(root)
    return root


def _state() -> dict[str, torch.Tensor]:
    return {"w": torch.arange(8, dtype=torch.float32)}


def test_save_records_code_command_environment_config(repo: Path, tmp_path: Path) -> None:
    with CheckpointStore.open(tmp_path / "store") as store:
        ck = store.save("a", 1, _state(), config={"lr": 1e-3, "api_token": "t0k"},
                        data_version="d7")
        ctx = store.catalog.context_of(ck)
        assert ctx is not None
        doc = ctx.document
        code = doc["code"]
        assert code["commit"] == _git(repo, "rev-parse", "HEAD")
        assert code["branch"] == "main" and code["dirty"] is True
        assert "s3cret" not in code["remote"] and "git.example.com" in code["remote"]
        patch = store.catalog.context_blob(code["patch"]).decode()
        assert "print('v2')" in patch and "notes.txt" in patch
        assert doc["command"]["cwd"] == str(repo)
        env = doc["environment"]
        assert env["torch"] == torch.__version__ and env["python"]
        lock = store.catalog.context_blob(env["lock"]).decode()
        assert f"torch=={torch.__version__.split('+')[0]}" in lock.replace("+cpu", "")
        assert doc["config"] == {"lr": 1e-3, "api_token": "***"}
        assert doc["data_version"] == "d7" and doc["world_size"] == 1
        run = store.catalog.get_run("a")
        assert run.config == {"lr": 1e-3, "api_token": "***"} and run.data_version == "d7"
        assert run.code_version.startswith("git:") and run.code_version.endswith("+dirty")
        # A second save with the same context records nothing new.
        store.save("a", 2, _state(), config={"lr": 1e-3, "api_token": "t0k"},
                   data_version="d7")
        assert len(store.catalog.run_contexts("a")) == 1


def test_a_new_process_with_another_context_records_it(repo: Path, tmp_path: Path) -> None:
    with CheckpointStore.open(tmp_path / "store") as store:
        first = store.save("a", 1, _state(), config={"lr": 0.1})
    _git(repo, "add", ".")
    _git(repo, "commit", "-qm", "two")
    with CheckpointStore.open(tmp_path / "store") as store:  # the resuming process
        second = store.save("a", 2, _state(), config={"lr": 0.1})
        third = store.save("a", 3, _state(), config={"lr": 0.05})
        contexts = store.catalog.run_contexts("a")
        assert [c.from_version for c in contexts] == [1, 2, 3]
        one, two = store.catalog.context_of(first), store.catalog.context_of(second)
        assert one is not None and two is not None
        assert one.document["code"]["dirty"] and not two.document["code"]["dirty"]
        assert store.catalog.context_of(third).document["config"] == {"lr": 0.05}
        # Identical blobs (the lock) are stored once: one lock row for three contexts.
        assert one.document["environment"]["lock"] == two.document["environment"]["lock"]
        with store.catalog.engine.connect() as conn:
            digests = [r[0] for r in conn.execute(text("SELECT digest FROM context_blobs"))]
        patches = {c.document["code"]["patch"] for c in contexts} - {None}
        assert sorted(digests) == sorted({one.document["environment"]["lock"], *patches})


def test_save_async_records_context(repo: Path, tmp_path: Path) -> None:
    with CheckpointStore.open(tmp_path / "store") as store:
        ck = store.save_async("a", 1, _state(), config={"lr": 2}).result()
        assert store.catalog.context_of(ck).document["config"] == {"lr": 2}


def test_opt_out(repo: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CKPT_CAPTURE", "0")
    with CheckpointStore.open(tmp_path / "store") as store:
        ck = store.save("a", 1, _state(), config={"lr": 2})
        assert store.catalog.context_of(ck) is None


def test_environment_variables_only_from_the_allow_list(
    repo: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MY_FLAG", "on")
    monkeypatch.setenv("OTHER", "hidden")
    monkeypatch.setenv("CKPT_CAPTURE_ENV", "MY_FLAG,MISSING")
    with CheckpointStore.open(tmp_path / "store") as store:
        ck = store.save("a", 1, _state())
        doc = store.catalog.context_of(ck).document
    assert doc["environment"]["env"] == {"MY_FLAG": "on"}
    assert "hidden" not in str(doc)


# ------------------------------------------------------------------ bad input: notes
def test_config_that_is_not_json_becomes_text_with_a_note(repo: Path, tmp_path: Path) -> None:
    class Opaque:
        def __repr__(self) -> str:
            return "Opaque()"

    with CheckpointStore.open(tmp_path / "store") as store:
        ck = store.save("a", 1, _state(),
                        config={"obj": Opaque(), "nan": float("nan"), "t": (1, 2),
                                "password": "pw"})
        doc = store.catalog.context_of(ck).document
    assert doc["config"] == {"obj": "Opaque()", "nan": "nan", "t": [1, 2], "password": "***"}
    assert any("Opaque is not JSON-serialisable" in n for n in doc["notes"])


def test_detached_head(repo: Path) -> None:
    _git(repo, "checkout", "-q", "--detach")
    doc = capture_context(where=repo).document
    assert doc["code"]["branch"] is None and doc["code"]["commit"]
    assert any("detached" in n for n in doc["notes"])


def test_broken_repository(repo: Path, tmp_path: Path) -> None:
    (repo / ".git" / "HEAD").write_text("ref: refs/heads/nowhere\n")
    (repo / ".git" / "index").write_bytes(b"garbage")
    with CheckpointStore.open(tmp_path / "store") as store:
        ck = store.save("a", 1, _state())  # never a failed save
        doc = store.catalog.context_of(ck).document
    assert doc["notes"], doc


def test_huge_untracked_file_is_left_out(repo: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("ckptstore.capture.MAX_UNTRACKED_FILE_BYTES", 1000)
    (repo / "big.bin").write_bytes(b"x" * 5000)
    doc = capture_context(where=repo).document
    assert doc["code"]["untracked_skipped"] == ["big.bin"]
    assert "notes.txt" in doc["code"]["untracked"]
    assert any("big.bin" in n for n in doc["notes"])


def test_no_git_binary(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CKPT_CAPTURE", "1")
    monkeypatch.setenv("PATH", str(tmp_path))  # no git anywhere on it
    with CheckpointStore.open(tmp_path / "store") as store:
        ck = store.save("a", 1, _state())
        doc = store.catalog.context_of(ck).document
    assert doc["code"] == {"git": False}
    assert any("no git binary" in n for n in doc["notes"])


def test_not_a_repository(tmp_path: Path) -> None:
    doc = capture_context(where=tmp_path).document
    assert doc["code"] == {"git": False} and any("not inside" in n for n in doc["notes"])


def test_safe_config_masks_secret_keys() -> None:
    masked = safe_config({"hub_token": "x", "secret": "y", "db_password": "z", "key": "k",
                          "monkey": 1, "keyframe_every": 3, "nested": {"aws_secret_key": 1}})
    assert masked == {"hub_token": "***", "secret": "***", "db_password": "***",
                      "key": "***", "monkey": 1, "keyframe_every": 3,
                      "nested": {"aws_secret_key": "***"}}


def test_a_config_that_cannot_be_copied_still_saves(repo: Path, tmp_path: Path) -> None:
    import threading

    with CheckpointStore.open(tmp_path / "store") as store:
        ck = store.save("a", 1, _state(), config={"lock": threading.Lock(), "lr": 1})
        doc = store.catalog.context_of(ck).document
    assert doc["config"]["lr"] == 1 and doc["config"]["lock"].startswith("<unlocked")


def test_many_untracked_files_are_capped(repo: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("ckptstore.capture.MAX_UNTRACKED_FILES", 3)
    for i in range(6):
        (repo / f"extra{i}.txt").write_text(f"{i}\n")
    doc = capture_context(where=repo).document
    assert len(doc["code"]["untracked"]) == 3
    assert any("7 untracked files" in n for n in doc["notes"])


# ------------------------------------------------------------------ seeds, world, platform
def test_seeds_world_size_and_platform_are_recorded(
    repo: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PYTHONHASHSEED", "7")
    monkeypatch.setenv("WORLD_SIZE", "4")  # as torchrun sets them, before the process group
    monkeypatch.setenv("RANK", "3")
    torch.manual_seed(1234)
    doc = capture_context(where=repo).document
    assert doc["seeds"] == {"pythonhashseed": "7", "torch": 1234}
    assert (doc["world_size"], doc["rank"]) == (4, 3)
    env = doc["environment"]
    assert env["platform"] == platform.platform() and env["machine"] == platform.machine()
    assert env["python"] == platform.python_version()


def test_capture_false_in_the_config_file_records_nothing(
    repo: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("CKPT_CAPTURE")
    for capture, recorded in (("false", False), ("true", True)):
        config = tmp_path / f"{capture}.toml"
        config.write_text(f'root = "{tmp_path / capture}"\ncapture = {capture}\n')
        with CheckpointStore.open(config=config) as store:
            ck = store.save("a", 1, _state(), config={"lr": 2})
            assert (store.catalog.context_of(ck) is not None) is recorded, capture


# ------------------------------------------------------------------ differences
def test_differences_of_code_environment_and_packages(repo: Path, tmp_path: Path) -> None:
    # What `ckpt runs diff` and `ckpt reproduce --check` list beyond the config: the
    # commit, the change, Python, the platform and every package whose version differs.
    with CheckpointStore.open(tmp_path / "store") as store:
        ck = store.save("a", 1, _state(), config={"lr": 2})
        ctx = store.catalog.context_of(ck)
        assert ctx is not None
        old_lock = b"torch==0.0.1\nnumpy==1.0.0\nnot-installed-here==3.0\n"
        digest = blob_digest(old_lock)
        other = {**ctx.document,
                 "code": {**ctx.document["code"], "commit": "0" * 40, "dirty": False,
                          "patch": None},
                 "environment": {**ctx.document["environment"], "python": "3.9.0",
                                 "platform": "Elsewhere-1.0", "lock": digest}}
        store.run("b")
        store.catalog.record_context("b", 1, other, "other", {digest: old_lock})
        fields = {d.field: (d.a, d.b) for d in diff_contexts(store, ctx.document, other)}
        assert fields["code.commit"][1] == "0" * 40
        assert fields["code.dirty"] == (True, False) and "code.change" in fields
        assert fields["environment.python"] == (platform.python_version(), "3.9.0")
        assert fields["environment.platform"][1] == "Elsewhere-1.0"
        assert fields["package.torch"][1] == "0.0.1"
        assert fields["package.not-installed-here"] == (None, "3.0")
        assert "config.lr" not in fields
        # --check: the recorded context against this process, packages from its own lock.
        recorded = store.catalog.run_contexts("b")[-1]
        checked = {d.field: (d.a, d.b) for d in check_against(store, recorded, where=repo)}
        assert checked["package.torch"][0] == "0.0.1"
        assert checked["package.torch"][1] not in (None, "0.0.1")  # this environment's
        assert checked["package.not-installed-here"] == ("3.0", None)
        assert checked["code.commit"][0] == "0" * 40
