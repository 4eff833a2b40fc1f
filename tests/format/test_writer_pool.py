"""Writer threads outlive a save (their buffers are reused) and never outlive a fork."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from pathlib import Path

import pytest
import torch

import ckptstore.format.writer as writer_mod
from ckptstore.errors import StorageError
from ckptstore.format import write_checkpoint


def _save(root: Path, state: dict[str, torch.Tensor], **kw: object) -> Path:
    directory = root / str(uuid.uuid4())
    write_checkpoint(directory, state, ckpt_id=directory.name, run="r", step=0,
                     chunk_bytes=1 << 16, threads=2, **kw)  # type: ignore[arg-type]
    return directory


def _writer_threads() -> set[int]:
    return {t.ident or 0 for t in threading.enumerate() if t.name.startswith("ckpt-write")}


def test_saves_reuse_the_same_writer_threads(tmp_path: Path) -> None:
    state = {"w": torch.randn(100_000)}
    _save(tmp_path, state)
    first = _writer_threads()
    for _ in range(3):
        _save(tmp_path, state)
    assert first and _writer_threads() == first


FORK_SCRIPT = textwrap.dedent(
    """
    import os, sys, uuid, torch
    from ckptstore.format import read_checkpoint, read_manifest, write_checkpoint

    # Under 32768 elements: torch runs such ops inline. Its OpenMP pool, once used, is not
    # fork-safe (a known torch limit, unrelated to the writer threads checked here).
    def save(root):
        directory = os.path.join(root, str(uuid.uuid4()))
        write_checkpoint(directory, {"w": torch.arange(30_000.0)}, ckpt_id=os.path.basename(
            directory), run="r", step=0, chunk_bytes=1 << 14, threads=2)
        out = read_checkpoint(directory, read_manifest(directory))
        assert torch.equal(out["w"], torch.arange(30_000.0))

    save(sys.argv[1])  # the parent's writer threads exist now
    pid = os.fork()
    if pid == 0:
        try:
            save(sys.argv[1])
        finally:
            os._exit(0 if sys.exc_info()[0] is None else 1)
    _, status = os.waitpid(pid, 0)
    sys.exit(os.waitstatus_to_exitcode(status))
    """
)


def test_a_forked_child_saves_with_its_own_threads(tmp_path: Path) -> None:
    # In a fresh process, so no earlier test has started torch's OpenMP threads.
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    try:
        proc = subprocess.run([sys.executable, "-c", FORK_SCRIPT, str(tmp_path)], env=env,
                              capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired:
        pytest.fail("a save in a forked child hung on the parent's writer threads")
    assert proc.returncode == 0, proc.stderr


def test_a_failed_save_leaves_no_writer_running(tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    # One chunk's write fails while the other thread is mid-write: by the time the save
    # raises, nothing of it is still writing (the caller then deletes the directory).
    finished: list[float] = []
    original = writer_mod._ChunkWriter._write_file

    def slow_or_failing(self: object, path: Path, payload: list[object]) -> tuple[int, int]:
        if path.name == "2":
            raise StorageError("injected: disk full")
        time.sleep(0.05)
        done = original(self, path, payload)  # type: ignore[arg-type]
        finished.append(time.monotonic())
        return done

    monkeypatch.setattr(writer_mod._ChunkWriter, "_write_file", slow_or_failing)
    with pytest.raises(StorageError, match="injected"):
        _save(tmp_path, {"w": torch.randn(400_000)}, codec="lz4")
    raised = time.monotonic()
    time.sleep(0.3)
    assert finished and max(finished) <= raised
