"""Planted symlinks in a hot checkpoint: deletes unlink them and finish, reads refuse them.

A chunk file replaced by a symlink used to make every ``ckpt prune`` fail (``... is a
symlink``) and leave the checkpoint DELETING for good, while doctor promised that prune would
finish it. A symlinked chunk *directory* was worse: loads, verify and doctor read through it
silently. And a manifest whose tensors overlap in one array was accepted.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from ckptstore import CheckpointStore
from ckptstore.cli.app import main
from ckptstore.errors import IntegrityError
from ckptstore.format import Manifest
from ckptstore.format.layout import chunk_span
from ckptstore.format.manifest import manifest_digest
from ckptstore.ops.upkeep.doctor import doctor
from ckptstore.records import Checkpoint, CheckpointState


@pytest.fixture
def store(tmp_path: Path) -> Iterator[CheckpointStore]:
    with CheckpointStore.open(tmp_path / "store", chunk_bytes=64 * 1024) as opened:
        yield opened


def _save(store: CheckpointStore, n: int) -> list[Checkpoint]:
    # Distinct contents: no chunk is shared (dedup) between the versions.
    return [store.save("r", i, {"w": torch.arange(40_000.0) + i * 1000}) for i in range(n)]


@pytest.fixture
def outside(tmp_path: Path) -> Path:
    """Files outside the store a planted link points at; they must survive every delete."""
    target = tmp_path / "outside"
    target.mkdir()
    (target / "precious").write_bytes(b"do not delete")
    (target / "0").write_bytes(b"x" * 100)
    return target


def _snapshot(path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in path.rglob("*") if p.is_file()}


def _plant(directory: Path, where: str, outside: Path) -> None:
    if where == "chunk-file":
        victim = directory / "float32" / "c" / "0"
        victim.unlink()
        victim.symlink_to(outside / "precious")
    elif where == "chunk-directory":
        victim = directory / "float32" / "c"
        shutil.rmtree(victim)
        victim.symlink_to(outside, target_is_directory=True)
    elif where == "marker":
        (directory / "COMMITTED").unlink()
        (directory / "COMMITTED").symlink_to(outside / "precious")
    elif where == "checkpoint-directory":
        shutil.rmtree(directory)
        directory.symlink_to(outside, target_is_directory=True)
    else:
        raise AssertionError(where)


@pytest.mark.parametrize("where", ["chunk-file", "chunk-directory", "marker",
                                   "checkpoint-directory"])
def test_prune_unlinks_planted_symlinks_and_finishes(
    store: CheckpointStore, outside: Path, where: str, capsys: pytest.CaptureFixture[str]
) -> None:
    first, *_ = _save(store, 3)
    directory = store.checkpoint_dir(first.run, first.id)
    _plant(directory, where, outside)
    before = _snapshot(outside)
    code = main(["--store", str(store.settings.root), "prune", "--keep-last", "1"])
    out, err = capsys.readouterr()
    # The planted checkpoint is deleted in the first run. Where the link hid its manifest
    # (marker, whole directory), deleting the others waited for that: what it read from
    # them could not be known while it was live. The next run finishes those.
    assert code == 0 or where in ("marker", "checkpoint-directory"), out + err
    assert store.catalog.get_any(first.id).state == CheckpointState.DELETED, out + err
    assert not directory.exists() and not directory.is_symlink()
    assert _snapshot(outside) == before  # the links were removed, never followed
    code = main(["--store", str(store.settings.root), "prune", "--keep-last", "1"])
    out, err = capsys.readouterr()
    assert code == 0, out + err
    assert [c.version for c in store.list()] == [3]
    report = doctor(store, grace_s=0)
    assert report.ok, report.render()


def test_deleting_a_replica_unlinks_a_symlinked_chunk_directory(
    store: CheckpointStore, outside: Path
) -> None:
    from ckptstore.ops.tiering.replicas import delete_replica

    first, _ = _save(store, 2)
    directory = store.checkpoint_dir(first.run, first.id)
    _plant(directory, "chunk-directory", outside)
    before = _snapshot(outside)
    delete_replica(store, first, "hot", force=True)
    assert not directory.exists() and _snapshot(outside) == before
    assert store.catalog.get_any(first.id).replica("hot").state.name == "DELETED"  # type: ignore[union-attr]


def _copy_behind_link(directory: Path, rel: str, elsewhere: Path) -> None:
    """Replace ``rel`` by a symlink to an identical copy: reads through it would succeed."""
    src = directory / rel
    if src.is_dir():
        shutil.copytree(src, elsewhere)
        shutil.rmtree(src)
        src.symlink_to(elsewhere, target_is_directory=True)
    else:
        shutil.copyfile(src, elsewhere)
        src.unlink()
        src.symlink_to(elsewhere)


@pytest.mark.parametrize("rel", ["float32/c", "float32", "float32/c/1"])
def test_reads_verify_and_doctor_refuse_symlinked_chunk_paths(
    store: CheckpointStore, tmp_path: Path, rel: str
) -> None:
    ck, = _save(store, 1)
    directory = store.checkpoint_dir(ck.run, ck.id)
    _copy_behind_link(directory, rel, tmp_path / "copy")
    with pytest.raises(IntegrityError, match=ck.id) as caught:
        store.load(ck.ref)
    assert "float32" in str(caught.value) and "symlink" in str(caught.value)
    for deep in (True, False):
        problems = store.verify(ck.ref, deep=deep)
        assert any("symlink" in p for p in problems), (deep, problems)
        report = doctor(store, deep=deep, grace_s=0)
        found = report.of_kind("damaged-replica")
        assert [f.subject for f in found] == [ck.id], report.render()
        assert "symlink" in found[0].detail


def test_a_symlinked_checkpoint_directory_is_flagged(store: CheckpointStore,
                                                     tmp_path: Path) -> None:
    ck, = _save(store, 1)
    directory = store.checkpoint_dir(ck.run, ck.id)
    shutil.copytree(directory, tmp_path / "copy")
    shutil.rmtree(directory)
    directory.symlink_to(tmp_path / "copy", target_is_directory=True)
    assert any("symlink" in p for p in store.verify(ck.ref))
    assert [f.subject for f in doctor(store, grace_s=0).of_kind("damaged-replica")] == [ck.id]


def test_manifests_with_overlapping_tensors_are_refused(store: CheckpointStore) -> None:
    ck = store.save("r", 1, {"a": torch.arange(20_000.0), "b": torch.arange(20_000.0) + 1})
    directory = store.checkpoint_dir(ck.run, ck.id)
    doc = json.loads((directory / "manifest.json").read_bytes())
    a, b = sorted(doc["tensors"], key=lambda t: t["offset"])
    assert a["array"] == b["array"]
    chunk_len = doc["arrays"][a["array"]]["chunk_len"]
    for offset in (a["offset"] + 1, a["offset"] + a["numel"] - 1, a["offset"]):
        b["offset"] = offset  # inside a's elements: the two tensors would share bytes
        b["chunk_start"], b["chunk_stop"] = chunk_span(offset, b["numel"], chunk_len)
        data = json.dumps(doc).encode()
        with pytest.raises(IntegrityError, match="overlap"):
            Manifest.from_json(data)
    # Written into the checkpoint (with a matching marker), verify and doctor flag it.
    (directory / "manifest.json").write_bytes(data)
    (directory / "COMMITTED").write_text(manifest_digest(data) + "\n")
    with pytest.raises(IntegrityError):
        store.load(ck.ref)
    assert doctor(store, grace_s=0).of_kind("damaged-replica")
    # Adjacent tensors (end of one == start of the next) and empty ones are fine.
    b["offset"] = a["offset"] + a["numel"]
    b["chunk_start"], b["chunk_stop"] = chunk_span(b["offset"], b["numel"], chunk_len)
    Manifest.from_json(json.dumps(doc).encode())
