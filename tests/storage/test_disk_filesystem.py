"""A store on a disk file system beside its memory tier and snapshots in /dev/shm.

The suite's temporary directories are in memory (tests/conftest.py, ``pytest_configure``), so
its other tests put hot tiers on the same file system as memory tiers and snapshots. On a
training node they are two: the tiers on a disk, the memory tier and the snapshots in
/dev/shm. These tests put them there, so that what depends on it keeps running: hard links
that cannot cross the two (``EXDEV``: the chunk is referenced, not linked, and nothing is
lost), copies between them, and a hot and a warm tier written, fsynced and read on a disk.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from remote_support import same

from ckptstore.format import (
    BaseRef,
    read_checkpoint,
    read_manifest,
    verify_checkpoint,
    write_checkpoint,
)
from ckptstore.format.localize import link_shared_chunks
from ckptstore.hooks.manager import CheckpointManager
from ckptstore.ops.tiering.archive import archive_checkpoints
from ckptstore.ops.tiering.replicas import delete_replica
from ckptstore.ops.tiering.restore import restore_checkpoint
from ckptstore.ops.writing.memory import attach_memory_tier, load_from_memory
from ckptstore.ops.writing.snapshot import snapshot_dir
from ckptstore.store import CheckpointStore

#: File systems that hold their files in memory.
_MEMORY_FS = frozenset({"tmpfs", "ramfs"})
CHUNK = 64 * 1024  # one tensor per chunk below


def filesystem(path: Path) -> str:
    """The type of the file system holding ``path`` (its mount in /proc/self/mounts)."""
    real = os.path.realpath(path)
    best, kind = "", ""
    for line in Path("/proc/self/mounts").read_text().splitlines():
        fields = line.split()
        mount = fields[1].replace("\\040", " ")
        inside = real == mount or real.startswith(mount.rstrip("/") + "/")
        if inside and len(mount) >= len(best):
            best, kind = mount, fields[2]
    return kind


@pytest.fixture
def disk_dir() -> Iterator[Path]:
    """A new directory on a disk file system (the system's temporary directory, else
    /var/tmp), removed afterwards."""
    for parent in (tempfile.gettempdir(), "/var/tmp"):
        if os.path.isdir(parent) and filesystem(Path(parent)) not in _MEMORY_FS:
            break
    else:
        pytest.skip("no temporary directory on a disk file system here")
    path = Path(tempfile.mkdtemp(prefix="ckpt-disk-test-", dir=parent))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def memory_dir(shm_root: Path) -> Path:
    """``shm_root``, checked to be in memory and on another file system than the disk's."""
    if filesystem(shm_root.parent) not in _MEMORY_FS:
        pytest.skip("no memory file system (/dev/shm) here")
    shm_root.mkdir(parents=True)
    return shm_root


def _states() -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    a = {f"t{i}": torch.randn(CHUNK // 4) for i in range(8)}
    b = {k: (v + 1 if i % 2 == 0 else v.clone()) for i, (k, v) in enumerate(a.items())}
    return a, b


def test_a_chunk_shared_across_file_systems_is_referenced_not_linked(
    disk_dir: Path, memory_dir: Path,
) -> None:
    a, b = _states()
    dir_a, dir_b = memory_dir / "a", disk_dir / "b"
    write_checkpoint(dir_a, a, ckpt_id=str(uuid.uuid4()), run="r", step=0, chunk_bytes=CHUNK)
    man_a = read_manifest(dir_a)
    write_checkpoint(dir_b, b, ckpt_id=str(uuid.uuid4()), run="r", step=1, chunk_bytes=CHUNK,
                     base=BaseRef(man_a, dir_a))
    man_b = read_manifest(dir_b)
    assert os.stat(dir_a).st_dev != os.stat(dir_b).st_dev
    shared = [array.chunk_path(c.i) for array in man_b.arrays.values()
              for c in array.chunks if c.src is not None]
    arrays = {array.name for array in man_b.arrays.values()
              if any(c.src is not None for c in array.chunks)}
    assert len(shared) == 4 and arrays
    # The links failed with EXDEV: the chunks stay the base's, and their arrays say so.
    assert not any((dir_b / rel).exists() for rel in shared)
    assert {rel.rsplit("/", 1)[0] for rel in man_b.metadata_ref} == arrays
    locations = {man_a.id: dir_a}
    out = read_checkpoint(dir_b, man_b, locate=locations.__getitem__)
    assert same(out, b)
    assert verify_checkpoint(dir_b, man_b, locate=locations.__getitem__) == []

    # Linking the shared chunks in later (what a restore does) fails the same way and
    # leaves the copy as it was; from an owner on the same disk it succeeds.
    assert link_shared_chunks(dir_b, man_b, locations.__getitem__) == set()
    assert not any((dir_b / rel).exists() for rel in shared)
    assert same(read_checkpoint(dir_b, man_b, locate=locations.__getitem__), b)
    on_disk = {man_a.id: disk_dir / "a"}
    shutil.copytree(dir_a, on_disk[man_a.id])
    assert link_shared_chunks(dir_b, man_b, on_disk.__getitem__) == arrays
    assert all((dir_b / rel).stat().st_ino == (on_disk[man_a.id] / rel).stat().st_ino
               for rel in shared)
    assert same(read_checkpoint(dir_b, man_b), b)
    assert verify_checkpoint(dir_b, man_b) == []


def test_tiers_on_a_disk_and_a_memory_tier_in_memory(disk_dir: Path, memory_dir: Path) -> None:
    a, b = _states()
    with CheckpointStore.open(disk_dir / "store", warm=str(disk_dir / "warm"),
                              chunk_bytes=CHUNK) as store:
        tier = attach_memory_tier(store, 64 * 2**20, root=memory_dir)
        first = store.save("r", 1, a)
        second = store.save("r", 2, b)  # against the first: only the changed chunks
        hot, hot_first = (store.checkpoint_dir("r", ck.id) for ck in (second, first))
        assert filesystem(hot) not in _MEMORY_FS
        assert os.stat(hot).st_dev != os.stat(tier.path_for("r", second.id)).st_dev
        # The unchanged chunks are hard links to the first save's files, on the disk.
        manifest = read_manifest(hot)
        shared = [array.chunk_path(c.i) for array in manifest.arrays.values()
                  for c in array.chunks if c.src == first.id]
        assert len(shared) == 4
        assert all((hot / rel).stat().st_ino == (hot_first / rel).stat().st_ino
                   for rel in shared)
        hit, loaded = load_from_memory(store, store.get(second.id))
        assert hit and same(loaded, b)

        assert archive_checkpoints(store, tier="warm").ok
        for ck in (second, first):  # the reader of the first's chunks first
            assert delete_replica(store, store.get(ck.id), "hot") > 0
        restore_checkpoint(store, second.ref)  # the base first, then the delta, linked in
        assert all((hot / rel).stat().st_ino == (hot_first / rel).stat().st_ino
                   for rel in shared)
        assert verify_checkpoint(hot, manifest) == []
        assert same(store.load(second.ref), b) and same(store.load(first.ref), a)


def test_snapshots_in_memory_saved_durably_to_a_disk(disk_dir: Path, memory_dir: Path) -> None:
    w = torch.zeros(CHUNK // 4)
    with CheckpointStore.open(disk_dir / "store", memory_tier_dir=str(memory_dir)) as store:
        with CheckpointManager(store, "r", snapshot_interval=1, save_interval=3,
                               handle_sigterm=False, history=False) as mgr:
            for step in range(1, 5):
                w.add_(1)
                mgr.step(step, lambda step=step: {"w": w.clone(), "step": step})
        assert filesystem(snapshot_dir(store, "r")) in _MEMORY_FS
        (saved,) = store.list(run="r")
        assert saved.step == 3 and filesystem(store.checkpoint_dir("r", saved.id)) not in _MEMORY_FS
        loaded = store.load(saved.ref)
        assert same({"w": loaded["w"]}, {"w": torch.full((CHUNK // 4,), 3.0)})
        assert loaded["step"] == 3
        assert store.load("r@latest")["step"] == 4  # the newer snapshot, from memory
