"""Deleting a copy that is already gone completes, says so, and doctor calls such a copy lost.

Before: retention on a catalog whose hot directories were removed by hand failed every delete
(``failed 49``, CheckpointNotFoundError): deleting one copy first collects which chunk files
the other live copies read, and a copy with no file left could not tell.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from ckptstore import CheckpointStore
from ckptstore.cli.app import main
from ckptstore.ops.tiering.archive import archive_checkpoints
from ckptstore.ops.tiering.replicas import delete_replica
from ckptstore.ops.tiering.retention import apply_retention
from ckptstore.ops.upkeep.doctor import doctor
from ckptstore.records import CheckpointState, ReplicaState
from ckptstore.retention import RetentionPolicy


@pytest.fixture
def store(tmp_path: Path) -> Iterator[CheckpointStore]:
    with CheckpointStore.open(tmp_path / "store", chunk_bytes=64 * 1024) as opened:
        yield opened


@pytest.fixture
def tiered(tmp_path: Path) -> Iterator[CheckpointStore]:
    with CheckpointStore.open(tmp_path / "tiered", warm=str(tmp_path / "warm"),
                              chunk_bytes=64 * 1024) as opened:
        yield opened


def _save(store: CheckpointStore, n: int) -> list[str]:
    return [store.save("r", i, {"w": torch.full((64,), float(i))}).id for i in range(n)]


def _gone_events(store: CheckpointStore, ckpt_id: str) -> list[dict[str, object]]:
    return [e.detail for e in store.events(ckpt_id)
            if e.kind == "replica_deleted" and e.detail.get("already_gone")]


def test_retention_completes_when_hot_directories_were_removed_by_hand(
    store: CheckpointStore, capsys: pytest.CaptureFixture[str]
) -> None:
    ids = _save(store, 50)
    shutil.rmtree(store.hot / "r")
    report = doctor(store, grace_s=0)
    lost = report.of_kind("missing-replica")
    assert len(lost) == 50 and all("lost" in f.detail for f in lost), report.render()

    result = apply_retention(store, policy=RetentionPolicy(keep_last=1))
    assert result.failed == [] and len(result.executed) == 49
    for ckpt_id in ids[:-1]:
        ck = store.catalog.get_any(ckpt_id)
        assert ck.state == CheckpointState.DELETED
        assert ck.replica("hot").state == ReplicaState.DELETED  # type: ignore[union-attr]
        (detail,) = _gone_events(store, ckpt_id)
        assert detail["tier"] == "hot" and detail["was"] == "PRESENT"
    # The newest is kept; it is still recorded PRESENT and doctor says it is lost.
    report = doctor(store, grace_s=0)
    assert [f.subject for f in report.of_kind("missing-replica")] == [ids[-1]]
    assert "lost" in report.of_kind("missing-replica")[0].detail
    # The CLI agrees, and a second run has nothing to do.
    assert main(["--store", str(store.settings.root), "prune", "--keep-last", "1"]) == 0
    assert "failed 0" in capsys.readouterr().out


def test_prune_works_around_some_lost_copies(store: CheckpointStore) -> None:
    ids = _save(store, 5)
    for gone in (ids[1], ids[3]):
        shutil.rmtree(store.checkpoint_dir("r", gone))
    result = apply_retention(store, policy=RetentionPolicy(keep_last=1))
    assert result.failed == [] and len(result.executed) == 4
    assert [c.id for c in store.list()] == [ids[-1]]
    assert _gone_events(store, ids[1]) and not _gone_events(store, ids[0])
    assert not store.checkpoint_dir("r", ids[0]).exists()


def test_deleting_a_gone_copy_is_idempotent(tiered: CheckpointStore, tmp_path: Path) -> None:
    store = tiered
    first, second = _save(store, 2)
    archive_checkpoints(store, tier="warm", threads=1)
    shutil.rmtree(tmp_path / "warm" / "r" / first)
    ck = store.catalog.get_any(first)
    assert delete_replica(store, ck, "warm") == 0
    assert store.catalog.get_any(first).replica("warm").state == ReplicaState.DELETED  # type: ignore[union-attr]
    assert _gone_events(store, first)[0]["tier"] == "warm"
    assert delete_replica(store, ck, "warm") == 0  # and again
    # A copy that still has files is deleted as before (no already_gone).
    delete_replica(store, store.catalog.get_any(second), "warm")
    assert not _gone_events(store, second)
    assert not (tmp_path / "warm" / "r" / second).exists()
