"""Memory tier: copies in /dev/shm that survive the training process, with budget eviction,
fallback to the hot tier, and a restart after SIGKILL that never reads a hot chunk."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path
from typing import Any

import torch

from ckptstore.ops.writing.memory import (
    MEMORY_TIER,
    MemoryLocation,
    attach_memory_tier,
    detach_memory_tier,
    load_from_memory,
    memory_copy,
    memory_tier_for,
    parse_memory_uri,
    stage_after_commit,
)
from ckptstore.records import ReplicaState
from ckptstore.store import CheckpointStore


def _state(seed: int, n: int = 4) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(seed)
    return {
        "model": {f"layer{i}.weight": torch.randn(64, 128, generator=gen) for i in range(n)},
        "half": torch.randn(100, generator=gen).to(torch.bfloat16),
        "step": seed,
        "note": f"seed {seed}",
    }


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    return bool(a == b)


def _save_staged(store: CheckpointStore, run: str, step: int, state: Any) -> Any:
    ck = store.save(run, step, state)
    return store.get(ck.id)


def test_staged_copy_is_an_unverified_memory_replica_and_loads(
    store: CheckpointStore, shm_root: Path
) -> None:
    tier = attach_memory_tier(store, 64 * 2**20, root=shm_root)
    state = _state(1)
    ck = _save_staged(store, "run-a", 1, state)
    replica = ck.replica(MEMORY_TIER)
    assert replica is not None and replica.state == ReplicaState.PRESENT
    # Never counts as a verified copy: tier moves and retention must not rely on it.
    assert replica.verified_at is None and ck.replica("hot") is not None
    location = parse_memory_uri(replica.uri)
    assert location is not None and location.path == tier.path_for("run-a", ck.id)
    assert location.host == tier.host and location.path.is_dir()
    assert parse_memory_uri(location.uri()) == location

    hit, loaded = load_from_memory(store, ck)
    assert hit and _equal(loaded, state)
    hit, part = load_from_memory(store, ck, keys=["model/layer1*"])
    assert hit and list(part["model"]) == ["layer1.weight"]
    live = {"model": {k: torch.zeros_like(v) for k, v in state["model"].items()}}
    target = live["model"]["layer0.weight"]
    hit, filled = load_from_memory(store, ck, into=live)
    assert hit and filled["model"]["layer0.weight"] is target
    assert torch.equal(target, state["model"]["layer0.weight"])


def test_restarted_process_loads_from_memory_without_any_hot_chunk(
    tmp_path: Path, shm_root: Path
) -> None:
    root = tmp_path / "store"
    common = textwrap.dedent(
        f"""
        import os, signal, sys, torch
        from ckptstore.store import CheckpointStore
        from ckptstore.ops.writing.memory import (
            attach_memory_tier, load_from_memory, stage_after_commit)
        store = CheckpointStore.open({str(root)!r})
        attach_memory_tier(store, 256 * 2**20, root={str(shm_root)!r})
        gen = torch.Generator().manual_seed(7)
        state = {{"w": torch.randn(512, 1024, generator=gen), "b": torch.arange(10)}}
        """
    )
    saver = common + textwrap.dedent(
        """
        ck = store.save("crash", 3, state)
        stage_after_commit(store, ck, state)
        print(ck.id, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
        """
    )
    out = subprocess.run([sys.executable, "-c", saver], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == -signal.SIGKILL, out.stderr
    ckpt_id = out.stdout.split()[-1]
    # Take every hot chunk away: a load that touched the hot tier would fail.
    hot_dir = root / "hot" / "crash" / ckpt_id
    chunk_dirs = [d for d in hot_dir.glob("*/c") if d.is_dir()]
    assert chunk_dirs
    for chunk_dir in chunk_dirs:
        chunk_dir.rename(chunk_dir.with_name("moved-away"))
    loader = common + textwrap.dedent(
        f"""
        ck = store.get({ckpt_id!r})
        hit, loaded = load_from_memory(store, ck)
        assert hit, "not loaded from the memory tier"
        assert torch.equal(loaded["w"], state["w"]) and torch.equal(loaded["b"], state["b"])
        print("ok from memory", flush=True)
        """
    )
    out = subprocess.run([sys.executable, "-c", loader], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0 and "ok from memory" in out.stdout, out.stderr


def test_vanished_copy_is_marked_deleted_and_the_hot_copy_is_used(
    store: CheckpointStore, shm_root: Path
) -> None:
    attach_memory_tier(store, 64 * 2**20, root=shm_root)
    state = _state(2)
    ck = _save_staged(store, "run-a", 2, state)
    shutil.rmtree(shm_root)  # what a reboot does to /dev/shm
    assert memory_copy(store, ck) is None
    assert store.get(ck.id).replica(MEMORY_TIER).state == ReplicaState.DELETED  # type: ignore[union-attr]
    assert _equal(store.load(ck.id), state)


def test_damaged_copy_is_marked_damaged_and_removed(
    store: CheckpointStore, shm_root: Path
) -> None:
    tier = attach_memory_tier(store, 64 * 2**20, root=shm_root)
    ck = _save_staged(store, "run-a", 3, _state(3))
    directory = tier.path_for("run-a", ck.id)
    chunk = next(p for p in directory.glob("float32/c/*") if p.is_file())
    data = bytearray(chunk.read_bytes())
    data[10] ^= 0xFF
    chunk.write_bytes(bytes(data))
    hit, _ = load_from_memory(store, ck)
    assert not hit
    assert store.get(ck.id).replica(MEMORY_TIER).state == ReplicaState.DAMAGED  # type: ignore[union-attr]
    assert not directory.exists()


def test_budget_evicts_the_oldest_copies(store: CheckpointStore, shm_root: Path) -> None:
    probe = attach_memory_tier(store, 2**30, root=shm_root / "probe")
    one = _save_staged(store, "probe", 0, _state(0))
    size = probe.usage()
    need = one.logical_bytes + one.logical_bytes // 100 + 2**20  # the tier's own estimate
    # Room for one copy plus the next one's estimate, and half a copy more: never three.
    budget = size + need + size // 2
    tier = attach_memory_tier(store, budget, root=shm_root)
    cks = [_save_staged(store, "run-b", step, _state(step)) for step in (1, 2, 3)]
    states = [store.get(ck.id).replica(MEMORY_TIER).state for ck in cks]  # type: ignore[union-attr]
    assert states == [ReplicaState.DELETED, ReplicaState.PRESENT, ReplicaState.PRESENT]
    assert [c.checkpoint_id for c in tier.copies()] == [cks[1].id, cks[2].id]
    assert tier.usage() <= budget
    assert not tier.path_for("run-b", cks[0].id).exists()
    # The evicted one still loads, from the hot tier.
    assert _equal(store.load(cks[0].id), _state(1))


def test_state_over_budget_is_not_staged(store: CheckpointStore, shm_root: Path) -> None:
    attach_memory_tier(store, 1024, root=shm_root)
    ck = _save_staged(store, "run-a", 1, _state(1))
    assert ck.replica(MEMORY_TIER) is None


def test_a_changed_state_is_refused(store: CheckpointStore, shm_root: Path) -> None:
    detach_memory_tier(store)  # save without staging; stage by hand below
    ck = store.save("run-a", 1, _state(1))
    tier = attach_memory_tier(store, 64 * 2**20, root=shm_root)
    stage_after_commit(store, ck, _state(2))  # logs, never raises
    assert store.get(ck.id).replica(MEMORY_TIER) is None
    assert tier.copies() == []


def test_sweep_removes_pruned_copies_and_dead_staging(
    store: CheckpointStore, shm_root: Path
) -> None:
    tier = attach_memory_tier(store, 64 * 2**20, root=shm_root)
    keep = _save_staged(store, "run-a", 1, _state(1))
    gone = _save_staged(store, "run-a", 2, _state(2))
    # What retention does to a pruned checkpoint's memory replica.
    store.catalog.set_replica(gone.id, MEMORY_TIER, state=ReplicaState.DELETED)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    staging = tier.root / "run-a" / f".staging-{uuid.uuid4()}-{dead.stdout.strip()}"
    staging.mkdir(parents=True)
    removed = tier.sweep()
    assert set(removed) == {tier.path_for("run-a", gone.id), staging}
    assert [c.checkpoint_id for c in tier.copies()] == [keep.id]


def test_copy_on_another_host_is_left_alone(store: CheckpointStore, shm_root: Path) -> None:
    ck = store.save("run-a", 1, _state(1))
    elsewhere = MemoryLocation("some-other-host", shm_root / "x" / ck.id, "0" * 64)
    store.catalog.set_replica(ck.id, MEMORY_TIER, uri=elsewhere.uri(),
                              state=ReplicaState.PRESENT)
    ck = store.get(ck.id)
    assert memory_copy(store, ck) is None
    assert ck.replica(MEMORY_TIER).state == ReplicaState.PRESENT  # type: ignore[union-attr]


def test_memory_tier_is_off_by_default(store: CheckpointStore) -> None:
    assert memory_tier_for(store) is None
    ck = store.save("run-a", 1, _state(1))
    assert ck.replica(MEMORY_TIER) is None


def test_store_wiring_stages_on_save_and_prefers_memory_on_load(
    tmp_path: Path, shm_root: Path
) -> None:
    with CheckpointStore.open(tmp_path / "s", memory_tier_bytes=64 * 2**20,
                              memory_tier_dir=str(shm_root)) as store:
        state = _state(4)
        handle = store.save_async("run-a", 4, state)
        ck = store.get(handle.result().id)
        assert ck.replica(MEMORY_TIER).state == ReplicaState.PRESENT  # type: ignore[union-attr]
        for chunk_dir in store.checkpoint_dir("run-a", ck.id).glob("*/c"):
            chunk_dir.rename(chunk_dir.with_name("moved-away"))
        assert _equal(store.load(ck.id), state)


def test_pid_file_of_this_process_is_not_swept(store: CheckpointStore, shm_root: Path) -> None:
    tier = attach_memory_tier(store, 64 * 2**20, root=shm_root)
    mine = tier.root / "run-a" / f".staging-{uuid.uuid4()}-{os.getpid()}"
    mine.mkdir(parents=True)
    assert tier.sweep() == []
    assert mine.exists()


def test_retention_prunes_checkpoints_with_memory_copies(
    tmp_path: Path, shm_root: Path
) -> None:
    from ckptstore.ops.tiering.retention import apply_retention
    from ckptstore.retention import RetentionPolicy

    with CheckpointStore.open(tmp_path / "s", memory_tier_bytes=64 * 2**20,
                              memory_tier_dir=str(shm_root)) as store:
        cks = [store.save("run-r", step, _state(step)) for step in (1, 2, 3)]
        assert all(ck.replica(MEMORY_TIER) is not None for ck in cks)
        report = apply_retention(store, run="run-r", tier="hot",
                                 policy=RetentionPolicy(keep_last=1))
        assert not report.failed
        tier = memory_tier_for(store)
        assert tier is not None
        for ck in cks[:2]:
            pruned = store.catalog.get_any(ck.id)
            assert pruned.replica(MEMORY_TIER).state == ReplicaState.DELETED  # type: ignore[union-attr]
            assert not tier.path_for("run-r", ck.id).exists()
        assert [c.checkpoint_id for c in tier.copies()] == [cks[2].id]
