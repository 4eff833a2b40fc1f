"""The durable-write primitives: real files, real failures, always StorageError."""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path
from typing import Any

import pytest

from ckptstore.durable import (
    TEMP_PREFIX,
    fsync_dir,
    fsync_file,
    fsync_many,
    fsync_tree,
    rename_into_place,
    replace_file,
    storage_error,
    write_new_file,
)
from ckptstore.errors import StorageError


def test_fsync_of_a_missing_directory_names_it(tmp_path: Path) -> None:
    missing = tmp_path / "nope"
    with pytest.raises(StorageError) as info:
        fsync_dir(missing)
    assert str(missing) in str(info.value)
    assert info.value.errno == errno.ENOENT
    assert info.value.filename == str(missing)
    assert isinstance(info.value.__cause__, FileNotFoundError)


def test_fsync_of_a_missing_file_raises(tmp_path: Path) -> None:
    with pytest.raises(StorageError, match="nope"):
        fsync_file(tmp_path / "nope")


def test_fsync_failure_is_raised_with_its_cause(tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "f"
    path.write_bytes(b"x")

    def fsync(fd: int) -> None:
        raise OSError(errno.EIO, "I/O error")

    monkeypatch.setattr(os, "fsync", fsync)
    with pytest.raises(StorageError, match="fsync") as info:
        fsync_file(path)
    assert "I/O error" in str(info.value) and str(path) in str(info.value)
    assert info.value.errno == errno.EIO
    with pytest.raises(StorageError, match="fsync directory"):
        fsync_dir(tmp_path)


def test_fsync_many_flushes_every_file_and_directory(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    files = [tmp_path / f"f{i}" for i in range(40)]
    for f in files:
        write_new_file(f, b"x", sync=False)
    flushed: list[int] = []
    real = os.fsync

    def fsync(fd: int) -> None:
        flushed.append(os.fstat(fd).st_ino)
        real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    fsync_many(files, [tmp_path])
    assert sorted(flushed) == sorted([f.stat().st_ino for f in files] + [tmp_path.stat().st_ino])


def test_fsync_many_raises_the_failure_after_the_others_finish(tmp_path: Path) -> None:
    good = [tmp_path / f"f{i}" for i in range(8)]
    for f in good:
        f.write_bytes(b"x")
    with pytest.raises(StorageError, match="missing") as info:
        fsync_many([*good, tmp_path / "missing"], [tmp_path])
    assert info.value.errno == errno.ENOENT


def test_write_new_file_writes_and_refuses_an_existing_file(tmp_path: Path) -> None:
    path = tmp_path / "a"
    write_new_file(path, b"first")
    assert path.read_bytes() == b"first"
    with pytest.raises(StorageError) as info:
        write_new_file(path, b"second")
    assert info.value.errno == errno.EEXIST
    assert "file exists" in str(info.value)
    assert path.read_bytes() == b"first"


def test_write_new_file_does_not_follow_a_planted_link(tmp_path: Path) -> None:
    target = tmp_path / "target"
    target.write_bytes(b"keep")
    link = tmp_path / "link"
    link.symlink_to(target)
    with pytest.raises(StorageError):
        write_new_file(link, b"evil")
    assert target.read_bytes() == b"keep"


def test_write_new_file_sets_the_mode(tmp_path: Path) -> None:
    path = tmp_path / "secret"
    write_new_file(path, b"k", mode=0o600)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600


def test_disk_full_says_what_to_do(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def writev(fd: int, buffers: Any) -> int:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "writev", writev)
    with pytest.raises(StorageError, match="disk full") as info:
        write_new_file(tmp_path / "big", b"data")
    assert info.value.errno == errno.ENOSPC


def test_replace_file_swaps_content_and_leaves_no_temp(tmp_path: Path) -> None:
    path = tmp_path / "doc"
    replace_file(path, b"old")
    replace_file(path, b"new")
    assert path.read_bytes() == b"new"
    assert [p.name for p in tmp_path.iterdir()] == ["doc"]


def test_replace_file_leaves_the_old_content_when_the_write_fails(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "doc"
    replace_file(path, b"old")
    real = os.writev
    calls = 0

    def writev(fd: int, buffers: Any) -> int:
        nonlocal calls
        calls += 1
        # Half the new content lands, then the disk fills up.
        real(fd, [memoryview(b"ne")])
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "writev", writev)
    with pytest.raises(StorageError, match="disk full"):
        replace_file(path, b"new content")
    monkeypatch.undo()
    assert calls == 1
    assert path.read_bytes() == b"old"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(TEMP_PREFIX)]


def test_replace_file_replaces_a_link_instead_of_following_it(tmp_path: Path) -> None:
    target = tmp_path / "target"
    target.write_bytes(b"keep")
    link = tmp_path / "link"
    link.symlink_to(target)
    replace_file(link, b"new")
    assert not link.is_symlink() and link.read_bytes() == b"new"
    assert target.read_bytes() == b"keep"


def test_rename_into_place_publishes_a_finished_file(tmp_path: Path) -> None:
    tmp = tmp_path / ".out.tmp"
    tmp.write_bytes(b"made by a library")
    out = tmp_path / "out"
    out.write_bytes(b"old")
    rename_into_place(tmp, out)
    assert out.read_bytes() == b"made by a library" and not tmp.exists()
    with pytest.raises(StorageError, match="missing"):
        rename_into_place(tmp_path / "missing", out)
    assert out.read_bytes() == b"made by a library"


def test_fsync_tree_flushes_every_directory_and_reports_a_missing_one(tmp_path: Path) -> None:
    (tmp_path / "a" / "b").mkdir(parents=True)
    (tmp_path / "a" / "b" / "f").write_bytes(b"x")
    fsync_tree(tmp_path / "a")
    with pytest.raises(StorageError, match="gone"):
        fsync_tree(tmp_path / "gone")


def test_storage_error_keeps_errno_path_and_hint() -> None:
    err = storage_error("/x/y", "write", OSError(errno.EROFS, "Read-only file system"))
    assert isinstance(err, OSError)
    assert err.errno == errno.EROFS and err.filename == "/x/y"
    assert "cannot write /x/y" in str(err) and "permission denied" in str(err)
