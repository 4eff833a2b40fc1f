"""A load racing retention: the hot copy it reads is taken away mid-load.

Loads take no lease, so retention may delete a hot copy (a verified warm copy stays) while a
load reads it. Each test pauses the load at one point (``read_manifest`` or the chunk reads,
wrapped to run the interleaving first) and lets retention act there: the load re-plans and
returns the exact state, or says the checkpoint was pruned; real damage is still an error.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import ckptstore.ops.reading.load as load_module
from ckptstore import CheckpointStore, ReplicaState
from ckptstore.errors import CheckpointNotFoundError, IntegrityError
from ckptstore.ops.tiering.archive import archive_checkpoints
from ckptstore.ops.tiering.retention import apply_retention
from ckptstore.retention import RetentionPolicy


@pytest.fixture
def store(tmp_path: Path) -> Iterator[CheckpointStore]:
    with CheckpointStore.open(tmp_path / "s", warm=str(tmp_path / "warm"),
                              chunk_bytes=64 * 1024) as opened:
        yield opened


def _state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(64 * 1024, generator=g), "b": torch.randn(7, generator=g)}


def _first_call_runs(monkeypatch: pytest.MonkeyPatch, name: str,
                     interleave: Callable[[], None]) -> list[int]:
    """Wrap ``ckptstore.ops.reading.load.<name>`` so its first call runs ``interleave`` first."""
    real = getattr(load_module, name)
    calls = [0]

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        if calls[0] == 1:
            interleave()
        return real(*args, **kwargs)

    monkeypatch.setattr(load_module, name, wrapped)
    return calls


@pytest.mark.parametrize("where", ["read_manifest", "read_checkpoint"])
def test_a_hot_copy_pruned_mid_load_is_read_from_the_copy_that_stays(
    store: CheckpointStore, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    old = store.save("r", 1, _state(1))
    store.save("r", 2, _state(2))
    archive_checkpoints(store, tier="warm")

    def prune_hot() -> None:
        report = apply_retention(store, tier="hot", policy=RetentionPolicy(keep_last=1))
        assert [a.checkpoint_id for a in report.executed] == [old.id]

    calls = _first_call_runs(monkeypatch, where, prune_hot)
    loaded = store.load(old.id)
    assert all(torch.equal(loaded[k], v) for k, v in _state(1).items())
    assert calls[0] == 2  # the first read failed on the vanished copy; the second succeeded
    # The load restored the hot copy from the warm one, verified, on its second plan.
    assert store.get(old.id).replica("hot").state == ReplicaState.PRESENT  # type: ignore[union-attr]


def test_a_checkpoint_pruned_whole_mid_load_is_not_found(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # No warm tier: hot retention then deletes whole checkpoints (it keeps unarchived ones
    # when a warm tier waits for them).
    store = CheckpointStore.open(tmp_path / "hot-only")
    old = store.save("r", 1, _state(1), delta=False)
    store.save("r", 2, _state(2), delta=False)  # not a delta of the first: it may go whole

    def prune_all() -> None:
        report = apply_retention(store, policy=RetentionPolicy(keep_last=1))
        assert [a.checkpoint_id for a in report.executed] == [old.id]

    _first_call_runs(monkeypatch, "read_checkpoint", prune_all)
    with store, pytest.raises(CheckpointNotFoundError,
                              match="pruned while it was being loaded"):
        store.load(old.id)


def test_damage_to_a_copy_nobody_touched_is_not_a_race(
    store: CheckpointStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    ck = store.save("r", 1, _state(1))
    chunk = next(store.checkpoint_dir("r", ck.id).rglob("c/0"))
    data = bytearray(chunk.read_bytes())
    data[3] ^= 0xFF
    chunk.write_bytes(bytes(data))
    calls = _first_call_runs(monkeypatch, "read_checkpoint", lambda: None)
    with pytest.raises(IntegrityError):
        store.load(ck.id)
    assert calls[0] == 1  # raised at once: no re-plan for damage
