"""The training curve in the catalog: the manager and LossMonitor record it in batches."""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch
from sqlalchemy import event

from ckptstore.errors import ConfigError
from ckptstore.hooks.loss_monitor import LossMonitor
from ckptstore.hooks.manager import CheckpointManager
from ckptstore.ops.upkeep.history import ALERT_EVENT, MetricHistory
from ckptstore.store import CheckpointStore


def loss_at(step: int) -> float:
    """A smooth decaying loss with a little deterministic wiggle."""
    return 2.0 / math.sqrt(1 + step) + 0.01 * math.sin(step)


def _state() -> dict[str, torch.Tensor]:
    return {"w": torch.ones(16)}


@contextmanager
def history_writes(store: CheckpointStore) -> Iterator[list[str]]:
    """Every SQL statement that writes ``metric_history``, as it runs."""
    seen: list[str] = []

    def listen(conn: object, cursor: object, statement: str, *args: object) -> None:
        head = " ".join(statement.split()[:3]).upper()
        if "METRIC_HISTORY" in head and not head.startswith("SELECT"):
            seen.append(head)

    event.listen(store.catalog.engine, "before_cursor_execute", listen)
    try:
        yield seen
    finally:
        event.remove(store.catalog.engine, "before_cursor_execute", listen)


@pytest.mark.parametrize("async_save", [True, False])
def test_the_curve_is_written_in_batches_at_save_time(
    store: CheckpointStore, async_save: bool
) -> None:
    steps, interval, bound = 5000, 500, 100
    with (
        history_writes(store) as writes,
        CheckpointManager(store, "curve", save_interval=interval, async_save=async_save,
                          handle_sigterm=False, history_points=bound) as mgr,
    ):
        for step in range(1, steps + 1):
            mgr.step(step, _state, metrics={"loss": loss_at(step), "lr": 1e-3})
        recorder = mgr.history
        assert recorder is not None
    # One catalog transaction per save (10) and one on close at most: never one per step.
    assert recorder.writes <= steps // interval + 1
    assert len(writes) <= 4 * recorder.writes  # a few statements each (insert/update/rewrite)
    points = store.catalog.metric_history("curve")
    assert len(points) <= bound
    assert sum(p.count for p in points) == steps
    assert points[0].step_first == 1 and points[-1].step_last == steps
    assert points[-1].last == loss_at(steps)
    assert store.catalog.metric_history_names("curve") == ["loss", "lr"]


def test_recording_a_step_touches_neither_catalog_nor_files(store: CheckpointStore) -> None:
    # A step is an append in memory (~1-2 us); a catalog write costs ~1000x more. Checked by
    # what the steps do, not by a clock (which measures the machine's load).
    from audit_support import io_events

    store.run("fast")
    recorder = MetricHistory(store, "fast", flush_every=1_000_000)
    n = 20_000
    with io_events() as events:
        for step in range(n):
            recorder.add(step, loss_at(step))
    assert events == [], events[:5]
    assert recorder.writes == 0  # nothing touched the catalog yet
    assert recorder.flush() == n and recorder.writes == 1


def test_a_full_buffer_is_flushed_off_the_training_thread(store: CheckpointStore) -> None:
    store.run("buffered")
    recorder = MetricHistory(store, "buffered", flush_every=1000)
    for step in range(2500):
        recorder.add(step, 1.0)
    deadline = time.monotonic() + 20
    while recorder.writes < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert recorder.writes >= 2
    recorder.close()
    assert sum(p.count for p in store.catalog.metric_history("buffered")) == 2500


def test_loss_monitor_records_the_loss_and_its_alerts(store: CheckpointStore) -> None:
    spike, nan = 300, 420
    with CheckpointManager(store, "monitored", save_interval=200, async_save=False,
                           handle_sigterm=False) as mgr:
        monitor = LossMonitor(window_size=50, threshold=0.2, manager=mgr)
        assert monitor.history is mgr.history
        for step in range(1, 501):
            loss = 50.0 if step == spike else float("nan") if step == nan else loss_at(step)
            monitor.update(step, loss)
            # The same value through the manager is not recorded twice.
            mgr.step(step, _state, metrics={"loss": loss} if step != nan else None)
    alerts = store.events(run="monitored", kind=ALERT_EVENT)
    by_step = {e.detail["step"]: e.detail for e in alerts}
    assert set(by_step) == {spike, nan}
    assert by_step[spike]["kind"] == "spike" and by_step[spike]["loss"] == 50.0
    assert by_step[nan]["kind"] == "nonfinite" and by_step[nan]["loss"] == "nan"
    points = store.catalog.metric_history("monitored")
    assert sum(p.count for p in points) == 499  # every finite step once, NaN left out
    assert max(p.max for p in points) == 50.0
    # The anomaly saves are there too, tagged and pinned.
    assert {c.step for c in store.list(run="monitored", tag="anomaly")} == {spike, nan}


def test_standalone_monitor_records_through_its_own_recorder(store: CheckpointStore) -> None:
    monitor = LossMonitor(window_size=20, threshold=0.2, action="alert", store=store,
                          run="alone")
    for step in range(100):
        monitor.update(step, 10.0 if step == 60 else 1.0 + 0.001 * (step % 3))
    monitor.close()
    assert sum(p.count for p in store.catalog.metric_history("alone")) == 100
    assert [e.detail["step"] for e in store.events(run="alone", kind=ALERT_EVENT)] == [60]


def test_resume_rewinds_the_curve(store: CheckpointStore) -> None:
    with CheckpointManager(store, "rewound", save_interval=100, async_save=False,
                           handle_sigterm=False) as mgr:
        for step in range(1, 251):
            mgr.step(step, _state, metrics={"loss": 1.0})
    # "Crash" at 250: the next attempt resumes from step 200 and logs other values.
    with CheckpointManager(store, "rewound", save_interval=100, async_save=False,
                           handle_sigterm=False) as mgr:
        mgr.restore_latest()
        assert mgr.resumed_from is not None and mgr.resumed_from.step == 200
        for step in range(201, 301):
            mgr.step(step, _state, metrics={"loss": 0.5})
    points = store.catalog.metric_history("rewound")
    assert sum(p.count for p in points) == 300
    assert [p.mean for p in points if p.step_first > 200] == [0.5] * 100


def test_without_history_nothing_is_recorded(store: CheckpointStore) -> None:
    with CheckpointManager(store, "quiet", save_interval=10, handle_sigterm=False,
                           history=False) as mgr:
        assert mgr.history is None
        for step in range(1, 21):
            mgr.step(step, _state, metrics={"loss": 1.0})
    assert store.catalog.metric_history("quiet") == []
    with pytest.raises(ConfigError, match="max_points"):
        CheckpointManager(store, "quiet", handle_sigterm=False, history_points=1)


def test_tensor_values_are_read_at_flush_time_as_they_were(store: CheckpointStore) -> None:
    """A tensor loss is not read on the training thread (for CUDA that would wait for the
    device every step): it is copied and read at the flush, with the value of its step even
    when the caller's tensor changes in place afterwards."""
    store.run("tensors")
    recorder = MetricHistory(store, "tensors")
    running = torch.zeros(())
    for step in range(1, 6):
        running.fill_(float(step) / 10)
        assert recorder.add(step, running)  # the same tensor object, changed in place
    assert not recorder.add(6, torch.ones(2))  # not a scalar
    assert recorder.add(7, torch.tensor(float("inf")))  # only known to be bad at the flush
    assert recorder.add(8, torch.tensor(0.8, dtype=torch.float64))
    assert recorder.flush() == 6
    points = store.catalog.metric_history("tensors")
    as_float32 = [float(torch.tensor(step / 10)) for step in range(1, 6)]
    assert [(p.step_last, p.last) for p in points] == [
        *zip(range(1, 6), as_float32, strict=True), (8, 0.8)
    ]
    assert recorder.dropped == 2
