"""The embedded runner: flows off the caller's thread, our own schedule timer, trigger_flow."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
from audit_support import io_events

from ckptstore import CheckpointStore
from ckptstore.errors import ConfigError
from ckptstore.flows.embedded import EmbeddedRunner, deployment_name, shutdown_runners, trigger_flow
from ckptstore.flows.schedules import CronSchedule, IntervalSchedule, parse_schedule
from ckptstore.records import CheckpointState


def _save_some(store: CheckpointStore, n: int) -> list[str]:
    return [store.save("r", i, {"w": torch.full((8,), float(i))}).id for i in range(n)]


@pytest.mark.prefect
def test_submit_is_cheap_and_runs_retention(flow_store: CheckpointStore) -> None:
    ids = _save_some(flow_store, 4)
    with EmbeddedRunner(flow_store.settings.root) as runner:
        # The trainer creates the runner at start-up; by the first checkpoint it is warm.
        runner.start()
        assert runner.ready.wait(120)
        # Cheap: the calling thread only enqueues (no file, socket or import on its way);
        # a clock would measure the machine's load, not this.
        with io_events() as events:
            assert runner.submit("retention", keep_last=1)
        assert events == [], events
        assert runner.wait_idle(timeout=120)
        result = runner.results[-1]
        assert result.ok, result.error
        assert result.flow == "retention" and not result.scheduled
        assert len(result.result["executed"]) == 3
    states = [flow_store.catalog.get_any(i).state for i in ids]
    assert states == [CheckpointState.DELETED] * 3 + [CheckpointState.COMMITTED]


@pytest.mark.prefect
def test_schedule_fires_and_failures_are_kept(flow_store: CheckpointStore) -> None:
    _save_some(flow_store, 1)
    orphan = flow_store.hot / "r" / "00000000-0000-4000-8000-000000000001"
    orphan.mkdir(parents=True)
    runner = EmbeddedRunner(flow_store.settings.root, schedules={"gc": "every 1s"})
    try:
        runner.start()
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline and not any(r.scheduled for r in runner.results):
            time.sleep(0.2)
        fired = [r for r in runner.results if r.scheduled]
        assert fired and fired[0].flow == "gc" and fired[0].ok, fired
        assert not orphan.exists()
        # A failing flow is recorded and the worker keeps going.
        runner.submit("restore", ref="missing@latest")
        runner.submit("gc", dry_run=True)
        assert runner.wait_idle(timeout=60)
        mine = [r for r in runner.results if not r.scheduled]
        assert [(r.flow, r.ok) for r in mine] == [("restore", False), ("gc", True)]
        assert mine[0].error is not None
    finally:
        assert runner.close(wait=True, timeout=60)


@pytest.mark.prefect
def test_trigger_flow_embedded(flow_store: CheckpointStore) -> None:
    ids = _save_some(flow_store, 3)
    root = str(flow_store.settings.root)
    try:
        trigger_flow(root, "retention", {"keep_last": 2})
        # The same idempotency key (verify:<id>) while the first is still queued: dropped.
        trigger_flow(root, "verify", {"ref": ids[-1], "tier": "hot"})
        trigger_flow(root, "verify", {"ref": ids[-1], "tier": "hot"})
    finally:
        shutdown_runners(wait=True, timeout=120)
    assert flow_store.catalog.get_any(ids[0]).state == CheckpointState.DELETED
    verified = [e for e in flow_store.events(ids[-1]) if e.kind == "verified"]
    assert len(verified) == 1


def test_submit_validates(tmp_path: Path) -> None:
    runner = EmbeddedRunner(tmp_path, warm=False, mode="embedded")
    with pytest.raises(ConfigError, match="unknown flow"):
        runner.submit("nope")
    assert runner.close() is True  # never started: nothing to wait for
    with pytest.raises(ConfigError, match="closed"):
        runner.submit("gc")
    assert runner.pending() == 0
    with pytest.raises(ConfigError, match="mode"):
        EmbeddedRunner(mode="cluster")  # type: ignore[arg-type]


def test_embedded_worker_runs_only_its_own_hosts_work(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A trigger for another host's part (a checkpoint saved across hosts) is that host's
    to run: an embedded worker drops it; its own host's run is queued."""
    monkeypatch.setenv("CKPT_HOST", "node-a")
    runner = EmbeddedRunner(tmp_path / "store", mode="embedded", warm=False)
    try:
        assert runner.submit("gc", work_queue="node-b") is False
        assert runner.pending() == 0 and runner._thread is None  # nothing started
        assert runner.submit("gc", work_queue="node-a") is True
        assert runner.wait_idle(120)
        assert [r.ok for r in runner.results] == [True]
    finally:
        runner.close(wait=True, timeout=60)


def test_schedule_parsing() -> None:
    assert parse_schedule("every 30s") == IntervalSchedule("every 30s", 30.0)
    assert parse_schedule("@every 2 minutes").seconds == 120.0
    assert parse_schedule("every 1.5h").seconds == 5400.0
    cron = parse_schedule("0 3 * * *")
    assert isinstance(cron, CronSchedule)
    from datetime import UTC, datetime

    assert cron.next_after(datetime(2026, 1, 1, 4, 0, tzinfo=UTC)) == datetime(
        2026, 1, 2, 3, 0, tzinfo=UTC
    )
    for bad in ("every 0s", "every 3 fortnights", "61 * * * *", "whenever"):
        with pytest.raises(ConfigError):
            parse_schedule(bad)
    with pytest.raises(ConfigError, match="cannot be scheduled"):
        EmbeddedRunner(schedules={"restore": "every 1s"})
    with pytest.raises(ConfigError, match="unknown flow"):
        EmbeddedRunner(schedules={"backup": "every 1s"})
    assert deployment_name("archive") == "ckpt-archive/ckptstore"


@pytest.mark.slow
def test_isolated_runner_runs_flows_in_one_sidecar(flow_store: CheckpointStore) -> None:
    """What a training process without Prefect gets: the flows run in one sidecar process
    (its own temporary server), results and failures come back as on the thread, and the
    sidecar stops with the runner."""
    ids = _save_some(flow_store, 3)
    runner = EmbeddedRunner(flow_store.settings.root, mode="embedded", isolate=True)
    try:
        runner.submit("retention", keep_last=1)
        runner.submit("restore", ref="missing@latest")
        assert runner.wait_idle(timeout=240)
        sidecar = runner._sidecar
        assert sidecar is not None and sidecar.alive
        assert [(r.flow, r.ok) for r in runner.results] == [("retention", True), ("restore", False)]
        assert len(runner.results[0].result["executed"]) == 2
        # The flow's own error, as the thread would have reported it.
        assert str(runner.results[1].error).startswith("CheckpointNotFoundError: ")
    finally:
        assert runner.close(wait=True, timeout=120)
    assert sidecar.proc.poll() is not None  # nothing left behind
    states = [flow_store.catalog.get_any(i).state for i in ids]
    assert states == [CheckpointState.DELETED] * 2 + [CheckpointState.COMMITTED]
    # Prefect's lines went to the store's log (the suite logs Prefect at WARNING).
    assert "Failed" in (flow_store.settings.root / "logs" / "flows.log").read_text()
