"""Failures during a save: StorageError with the cause, and never a commit marker."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch

from ckptstore.errors import IncompleteCheckpointError, InvalidNameError, StorageError
from ckptstore.format import PHASES, read_checkpoint, read_manifest, write_checkpoint


def _state() -> dict[str, Any]:
    return {"w": torch.randn(4000), "i": torch.arange(100), "meta": {"step": 1}}


def _write(directory: Path, **kwargs: Any) -> Any:
    kwargs.setdefault("chunk_bytes", 2048)
    return write_checkpoint(
        directory, _state(), ckpt_id=str(uuid.uuid4()), run="r", step=1, **kwargs
    )


def _failing_on(target: str, err: int = errno.ENOSPC) -> Any:
    """An os.writev that fails with ``err`` when writing a file whose path ends in target."""
    real = os.writev

    def writev(fd: int, buffers: Any) -> int:
        if os.readlink(f"/proc/self/fd/{fd}").endswith(target):
            raise OSError(err, os.strerror(err))
        return real(fd, buffers)

    return writev


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="needs /proc")
@pytest.mark.parametrize("codec", ["none", "lz4"])
@pytest.mark.parametrize(
    "target",
    [
        "float32/c/0",
        "float32/c/7",
        "int64/c/0",
        "int64/zarr.json",
        "/zarr.json",
        "manifest.json",
        "COMMITTED.tmp",
    ],
)
def test_disk_full_raises_storage_error_and_leaves_no_marker(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, codec: str, target: str
) -> None:
    directory = tmp_path / "c"
    monkeypatch.setattr(os, "writev", _failing_on(target))
    with pytest.raises(StorageError) as info:
        _write(directory, codec=codec, threads=2)
    monkeypatch.undo()
    err = info.value
    assert err.errno == errno.ENOSPC
    assert "disk full" in str(err) and str(directory) in str(err) and target in str(err)
    assert isinstance(err.__cause__, OSError)
    assert not (directory / "COMMITTED").exists()
    with pytest.raises(IncompleteCheckpointError):
        read_manifest(directory)


def test_fsync_failure_is_a_storage_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def fsync(fd: int) -> None:
        raise OSError(errno.EIO, "I/O error")

    monkeypatch.setattr(os, "fsync", fsync)
    with pytest.raises(StorageError, match="fsync"):
        _write(tmp_path / "c")
    monkeypatch.undo()
    assert not (tmp_path / "c" / "COMMITTED").exists()


@pytest.mark.parametrize("phase", PHASES[:-1])
def test_fault_before_commit_leaves_no_marker(tmp_path: Path, phase: str) -> None:
    seen: list[str] = []

    def fault(name: str) -> None:
        seen.append(name)
        if name == phase:
            raise RuntimeError(f"injected at {name}")

    directory = tmp_path / "c"
    with pytest.raises(RuntimeError, match=phase):
        _write(directory, fault_point=fault)
    assert seen == list(PHASES[: PHASES.index(phase) + 1])
    assert not (directory / "COMMITTED").exists()
    with pytest.raises(IncompleteCheckpointError):
        read_manifest(directory)


def test_fault_after_commit_leaves_a_complete_checkpoint(tmp_path: Path) -> None:
    def fault(name: str) -> None:
        if name == "committed":
            raise RuntimeError("died right after committing")

    directory = tmp_path / "c"
    with pytest.raises(RuntimeError):
        _write(directory, fault_point=fault)
    manifest = read_manifest(directory)
    assert torch.equal(read_checkpoint(directory, manifest)["i"], torch.arange(100))


def test_killed_process_leaves_an_incomplete_checkpoint(tmp_path: Path) -> None:
    directory = tmp_path / "c"
    script = textwrap.dedent(
        f"""
        import os, uuid, torch
        from ckptstore.format import write_checkpoint
        def die(name):
            if name == "manifest_written":
                os._exit(9)
        write_checkpoint({str(directory)!r}, {{"w": torch.ones(10)}}, ckpt_id=str(uuid.uuid4()),
                         run="r", step=0, fault_point=die)
        """
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    proc = subprocess.run([sys.executable, "-c", script], env=env, timeout=120, check=False)
    assert proc.returncode == 9
    assert (directory / "manifest.json").exists()
    with pytest.raises(IncompleteCheckpointError):
        read_manifest(directory)


def test_existing_files_are_never_overwritten(tmp_path: Path) -> None:
    directory = tmp_path / "c"
    _write(directory)
    before = (directory / "manifest.json").read_bytes()
    with pytest.raises(StorageError) as info:
        _write(directory)
    assert info.value.errno == errno.EEXIST
    assert (directory / "manifest.json").read_bytes() == before


def test_progress_reports_every_logical_byte(tmp_path: Path) -> None:
    seen: list[int] = []
    manifest = _write(tmp_path / "c", progress=seen.append)
    assert sum(seen) == manifest.logical_bytes
    assert len(seen) == sum(len(a.chunks) for a in manifest.arrays.values())


@pytest.mark.parametrize(
    "kwargs",
    [
        {"ckpt_id": "not-a-uuid"},
        {"codec": "gzip"},
        {"chunk_bytes": 0},
        {"threads": 0},
        {"run": ""},
        {"step": 1.5},
    ],
)
def test_bad_arguments_are_refused_before_writing(tmp_path: Path, kwargs: dict[str, Any]) -> None:
    args: dict[str, Any] = {"ckpt_id": str(uuid.uuid4()), "run": "r", "step": 0}
    args.update(kwargs)
    with pytest.raises(InvalidNameError):
        write_checkpoint(tmp_path / "c", {"w": torch.ones(1)}, **args)
    assert not (tmp_path / "c").exists()


def test_metadata_built_while_chunks_are_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The zarr documents are made on the saving thread before any chunk result is taken
    (so they overlap the chunk I/O), and the save still commits them all."""
    import ckptstore.format.writer as writer

    events: list[str] = []
    real = writer.build_metadata

    def build(*args: Any, **kwargs: Any) -> Any:
        events.append("metadata")
        return real(*args, **kwargs)

    monkeypatch.setattr(writer, "build_metadata", build)
    manifest = _write(tmp_path / "c", progress=lambda n: events.append("chunk"))
    assert events[0] == "metadata" and events.count("metadata") == 1
    assert events.count("chunk") == sum(len(a.chunks) for a in manifest.arrays.values())
    loaded = read_checkpoint(tmp_path / "c", read_manifest(tmp_path / "c"))
    assert loaded["w"].shape == (4000,)


def test_metadata_failure_stops_the_save_without_a_marker(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import ckptstore.format.writer as writer
    from ckptstore.errors import CkptError

    def build(*args: Any, **kwargs: Any) -> Any:
        raise CkptError("zarr wrote something unexpected")

    monkeypatch.setattr(writer, "build_metadata", build)
    with pytest.raises(CkptError, match="unexpected"):
        _write(tmp_path / "c")
    assert not (tmp_path / "c" / "COMMITTED").exists()
    assert not (tmp_path / "c" / "manifest.json").exists()
    with pytest.raises(IncompleteCheckpointError):
        read_manifest(tmp_path / "c")
