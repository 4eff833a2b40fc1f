"""Prefetch and evaluation sweeps against a real moto S3 warm tier and a real catalog."""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from ckptstore import CheckpointStore
from ckptstore.errors import (
    CheckpointNotFoundError,
    ConfigError,
    InvalidNameError,
    StorageError,
)
from ckptstore.ops.reading.prefetch import prefetch_purpose, send_prefetch
from ckptstore.ops.reading.sweep import LOAD_THREAD_NAME, THREAD_NAME
from ckptstore.ops.tiering.archive import archive_checkpoints
from ckptstore.ops.tiering.replicas import delete_replica
from ckptstore.ops.tiering.retention import apply_retention
from ckptstore.records import Checkpoint, ReplicaState
from ckptstore.retention import RetentionPolicy


def _state(i: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(i)
    return {"w": torch.randn(64, 16, generator=gen), "b": torch.arange(8, dtype=torch.int64) + i}


def _warm_only(store: CheckpointStore, run: str, steps: range) -> list[Checkpoint]:
    """Save, archive to warm, drop the hot copies: the checkpoints live on warm only."""
    cks = [store.save(run, step, _state(step)) for step in steps]
    archive_checkpoints(store, run=run, tier="warm")
    for ck in cks:
        delete_replica(store, store.catalog.get(ck.id), "hot")
    return [store.catalog.get(ck.id) for ck in cks]


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _sweep_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name in (THREAD_NAME, LOAD_THREAD_NAME)]


@pytest.fixture
def warm_store(tiered_store: CheckpointStore) -> Iterator[CheckpointStore]:
    yield tiered_store
    assert not _sweep_threads()


def test_prefetch_brings_to_hot_verified_and_leased(warm_store: CheckpointStore) -> None:
    (ck,) = _warm_only(warm_store, "pf", range(1, 2))
    assert ck.replica("hot").state == ReplicaState.DELETED  # type: ignore[union-attr]

    result = warm_store.prefetch(ck.id)

    now = warm_store.catalog.get(ck.id)
    hot = now.replica("hot")
    assert hot is not None and hot.state == ReplicaState.PRESENT and hot.verified_at
    assert result.path == warm_store.checkpoint_dir(ck.run, ck.id) and result.path.is_dir()
    assert result.bytes_moved == ck.stored_bytes > 0
    leases = warm_store.catalog.leases(checkpoint_ids=[ck.id])
    assert [(x.purpose, x.owner) for x in leases] == [(prefetch_purpose(), result.lease_owner)]
    assert warm_store.metrics.totals()["prefetch"].bytes_transferred == ck.stored_bytes
    assert warm_store.catalog.events(ck.id, kind="prefetched")
    # Prefetching again moves nothing and keeps one lease.
    assert warm_store.prefetch(ck.id).bytes_moved == 0
    assert len(warm_store.catalog.leases(checkpoint_ids=[ck.id])) == 1


def test_prefetch_lease_blocks_retention_until_the_load(warm_store: CheckpointStore) -> None:
    old, _new = _warm_only(warm_store, "ret", range(1, 3))
    warm_store.prefetch(old.id)
    keep_one = RetentionPolicy(keep_last=1)

    report = apply_retention(warm_store, tier="hot", policy=keep_one)
    assert old.id not in {a.checkpoint_id for a in report.plan.actions}
    assert warm_store.catalog.get(old.id).replica("hot").state == ReplicaState.PRESENT  # type: ignore[union-attr]

    assert _equal(warm_store.load(old.id), _state(1))
    assert warm_store.metrics.prefetch_counts() == {"hit": 1, "miss": 0}
    assert not warm_store.catalog.leases(checkpoint_ids=[old.id])  # used: given back
    if warm_store.metrics.prom is not None:
        text = warm_store.metrics.exposition().decode()
        assert 'ckptstore_prefetch_total{outcome="hit"} 1.0' in text
        assert 'ckptstore_bytes_total{kind="transferred",op="prefetch"}' in text

    apply_retention(warm_store, tier="hot", policy=keep_one)
    assert warm_store.catalog.get(old.id).replica("hot").state == ReplicaState.DELETED  # type: ignore[union-attr]


def test_load_without_prefetch_counts_a_miss(warm_store: CheckpointStore) -> None:
    (ck,) = _warm_only(warm_store, "miss", range(5, 6))
    assert _equal(warm_store.load(ck.id), _state(5))
    assert warm_store.metrics.prefetch_counts() == {"hit": 0, "miss": 1}
    warm_store.load(ck.id)  # hot now, never prefetched: neither
    assert warm_store.metrics.prefetch_counts() == {"hit": 0, "miss": 1}


def test_iter_checkpoints_yields_bit_exact_states_oldest_first(
        warm_store: CheckpointStore) -> None:
    cks = _warm_only(warm_store, "sweep", range(10, 15))
    seen = []
    for ck, state in warm_store.iter_checkpoints("sweep", prefetch=2):
        assert _equal(state, _state(ck.step))
        seen.append(ck.id)
    assert seen == [ck.id for ck in cks]
    assert not _sweep_threads()
    assert not warm_store.catalog.leases(checkpoint_ids=seen)
    counts = warm_store.metrics.prefetch_counts()
    assert counts["hit"] + counts["miss"] == 5 and counts["hit"] >= 1


def test_abandoned_sweep_leaves_no_thread_and_no_lease(warm_store: CheckpointStore) -> None:
    cks = _warm_only(warm_store, "stop", range(1, 6))
    sweep = warm_store.iter_checkpoints("stop", prefetch=2)
    ck, state = next(sweep)
    assert ck.id == cks[0].id and _equal(state, _state(1))
    del sweep, state
    gc.collect()
    assert not _sweep_threads()
    assert not warm_store.catalog.leases(checkpoint_ids=[c.id for c in cks])


def test_sweep_close_and_context_manager(warm_store: CheckpointStore) -> None:
    _warm_only(warm_store, "ctx", range(1, 4))
    with warm_store.iter_checkpoints("ctx", prefetch=1) as sweep:
        assert len(sweep.checkpoints) == 3
        next(sweep)
    assert not _sweep_threads()
    with pytest.raises(StopIteration):
        next(sweep)
    # prefetch=0: plain sequential loads, no thread at all.
    steps = [ck.step for ck, _ in warm_store.iter_checkpoints("ctx", prefetch=0)]
    assert steps == [1, 2, 3]


def _spy_loads(monkeypatch: pytest.MonkeyPatch, fail_on_load_thread: bool = False
               ) -> list[tuple[str, str]]:
    """Record (thread name, checkpoint id) of every load the sweep makes (the real load)."""
    import ckptstore.ops.reading.sweep as sweep_mod

    calls: list[tuple[str, str]] = []
    real = sweep_mod.load_checkpoint

    def load(core: Any, ckpt_id: str, **kwargs: Any) -> Any:
        name = threading.current_thread().name
        calls.append((name, ckpt_id))
        if fail_on_load_thread and name == LOAD_THREAD_NAME:
            raise StorageError(f"injected failure loading {ckpt_id} ahead")
        return real(core, ckpt_id, **kwargs)

    monkeypatch.setattr(sweep_mod, "load_checkpoint", load)
    return calls


def test_sweep_preloads_the_next_state_while_the_caller_holds_the_current(
        warm_store: CheckpointStore, monkeypatch: pytest.MonkeyPatch) -> None:
    cks = _warm_only(warm_store, "pre", range(1, 5))
    calls = _spy_loads(monkeypatch)
    for ck, state in warm_store.iter_checkpoints("pre", prefetch=2):
        assert _equal(state, _state(ck.step))
    # The first is loaded on demand, every later one ahead, each exactly once.
    assert calls == [(threading.current_thread().name, cks[0].id),
                     *[(LOAD_THREAD_NAME, ck.id) for ck in cks[1:]]]
    assert not warm_store.catalog.leases(checkpoint_ids=[ck.id for ck in cks])


def test_sweep_without_preload_loads_on_demand(
        warm_store: CheckpointStore, monkeypatch: pytest.MonkeyPatch) -> None:
    cks = _warm_only(warm_store, "nopre", range(1, 4))
    calls = _spy_loads(monkeypatch)
    steps = [ck.step for ck, _ in warm_store.iter_checkpoints("nopre", prefetch=2,
                                                               preload=False)]
    assert steps == [1, 2, 3]
    assert calls == [(threading.current_thread().name, ck.id) for ck in cks]


def test_a_failed_preload_is_loaded_again_by_the_caller(
        warm_store: CheckpointStore, monkeypatch: pytest.MonkeyPatch) -> None:
    _warm_only(warm_store, "prefail", range(1, 4))
    calls = _spy_loads(monkeypatch, fail_on_load_thread=True)
    got = {ck.step: state for ck, state in warm_store.iter_checkpoints("prefail", prefetch=1)}
    assert all(_equal(got[step], _state(step)) for step in (1, 2, 3))
    mine = threading.current_thread().name
    assert [name for name, _ in calls] == [mine, LOAD_THREAD_NAME, mine,
                                           LOAD_THREAD_NAME, mine]


def test_bad_inputs_raise_our_errors(store: CheckpointStore, tmp_path: Path) -> None:
    ck = store.save("bad", 1, _state(1))
    with pytest.raises(InvalidNameError):
        store.prefetch(ck.id, to="disk")
    for hold in (0, -1.0, float("nan"), float("inf")):
        with pytest.raises(InvalidNameError):
            store.prefetch(ck.id, hold_s=hold)
    with pytest.raises(ConfigError, match="memory_tier_bytes"):
        store.prefetch(ck.id, to="memory")
    with pytest.raises(CheckpointNotFoundError):
        store.prefetch("nope@latest")
    with pytest.raises(InvalidNameError):
        store.iter_checkpoints("bad", prefetch=-1)
    with pytest.raises(InvalidNameError):
        store.iter_checkpoints("bad", prefetch=True)
    with pytest.raises(InvalidNameError, match="preload"):
        store.iter_checkpoints("bad", preload="yes")  # type: ignore[arg-type]
    with pytest.raises(CheckpointNotFoundError):
        store.iter_checkpoints("no-such-run")
    with pytest.raises(InvalidNameError):
        send_prefetch(store, ck.id, "two words")
    assert not store.catalog.leases()


def test_prefetch_to_memory(tmp_path: Path, tiered_store: CheckpointStore) -> None:
    from ckptstore.ops.writing.memory import attach_memory_tier, memory_replica_here

    (ck,) = _warm_only(tiered_store, "mem", range(1, 2))
    attach_memory_tier(tiered_store, 8 * 1024 * 1024, root=tmp_path / "shm")
    result = tiered_store.prefetch(ck.id, to="memory")
    assert result.to == "memory"
    assert memory_replica_here(tiered_store.catalog.get(ck.id))
    assert _equal(tiered_store.load(ck.id), _state(1))
    assert tiered_store.metrics.prefetch_counts()["hit"] == 1


def test_hits_misses_and_bytes_ahead_per_host_in_the_catalog_and_the_ui(
    warm_store: CheckpointStore,
) -> None:
    """Hits and misses are catalog events (any process's UI sees them), summed per host
    with the bytes moved ahead of need, and the tiers page shows them."""
    import urllib.request

    from ckptstore.identity import host
    from ckptstore.ops.reading.prefetch import PREFETCH_EVENTS, prefetch_by_host
    from ckptstore.ui.app import start_background

    fetched, cold = _warm_only(warm_store, "ui", range(1, 3))
    moved = warm_store.prefetch(fetched.id).bytes_moved
    warm_store.load(fetched.id)  # hit
    warm_store.load(cold.id)  # miss: fetched on demand
    assert [e.kind for e in warm_store.catalog.events(cold.id, kind="prefetch_miss")] == [
        "prefetch_miss"]
    events = [e for kind in PREFETCH_EVENTS for e in warm_store.catalog.events(kind=kind)]
    (mine,) = prefetch_by_host(events)
    assert (mine.host, mine.prefetched, mine.bytes_ahead, mine.hits, mine.misses) == (
        host(), 1, moved, 1, 1)
    assert mine.hit_rate == 0.5 and moved > 0

    ui = start_background(warm_store)
    try:
        with urllib.request.urlopen(ui.url + "tiers", timeout=20) as resp:
            body = resp.read().decode()
    finally:
        ui.close()
    row = body[body.index(f'<tr class="prefetch-host" data-host="{host()}">'):]
    row = row[:row.index("</tr>")]
    assert '<td class="num hits">1</td>' in row and '<td class="num misses">1</td>' in row
    assert "50 %" in row


def test_prefetch_by_host_counts_each_kind_and_ignores_others() -> None:
    from datetime import UTC, datetime

    from ckptstore.ops.reading.prefetch import prefetch_by_host
    from ckptstore.records import Event

    now = datetime.now(UTC)
    events = [
        Event("prefetched", now, "a", detail={"host": "n1", "bytes": 100}),
        Event("prefetched", now, "b", detail={"host": "n1", "bytes": "lots"}),  # not counted
        Event("prefetch_hit", now, "a", detail={"host": "n1"}),
        Event("prefetch_miss", now, "c", detail={"host": "n2"}),
        Event("pruned", now, "a", detail={"host": "n1"}),
    ]
    rows = {r.host: r for r in prefetch_by_host(events)}
    assert (rows["n1"].prefetched, rows["n1"].bytes_ahead, rows["n1"].hits) == (2, 100, 1)
    assert (rows["n2"].misses, rows["n2"].hit_rate) == (1, 0.0)
    assert prefetch_by_host([]) == []
