"""``store.metrics``: save, load and async saves recorded by a real store."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from ckptstore import CheckpointStore


@pytest.fixture
def store(tmp_path: Path) -> Any:
    opened = CheckpointStore.open(tmp_path / "store")
    try:
        yield opened
    finally:
        opened.close()


def _samples(store: Any) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = store.metrics.exposition().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_save_and_load_are_recorded(store: Any) -> None:
    state = {"w": torch.arange(4096, dtype=torch.float32), "step": 3}
    ck = store.save("run-m", 3, state)
    store.load(ck.ref)
    with pytest.raises(LookupError):
        store.load("run-m@v9")  # never resolves: not an operation, nothing recorded
    totals = store.metrics.totals()
    assert totals["save"].count == 1 and totals["load"].count == 1
    assert totals["save"].bytes_logical == ck.logical_bytes == 4096 * 4
    assert totals["save"].bytes_stored == ck.stored_bytes
    assert totals["save"].blocked_seconds == pytest.approx(totals["save"].seconds)
    samples = _samples(store)
    assert samples[("ckptstore_save_seconds_count", (("run", "run-m"),))] == 1
    assert samples[("ckptstore_bytes_total", (("kind", "logical"), ("op", "load")))] == 4096 * 4
    assert samples[("checkpoint_save_time", ())] > 0


def test_failed_save_is_counted(store: Any) -> None:
    class Opaque:
        pass

    with pytest.raises(TypeError):
        store.save("run-m", 1, {"x": Opaque()})  # refused before anything is written
    store.save("run-m", 2, {"w": torch.ones(2)})
    assert store.metrics.totals()["save"].failures == 0  # refusal is not a storage failure


def test_async_save_blocks_only_for_staging(store: Any) -> None:
    handle = store.save_async("run-a", 1, {"w": torch.ones(1 << 16)})
    handle.result(timeout=60)
    store.wait()
    totals = store.metrics.totals()["save"]
    assert totals.count == 1
    # Blocked time is the staging copy, far less than the background write.
    assert totals.blocked_seconds == pytest.approx(handle.blocked_s, rel=1e-6, abs=1e-9)
