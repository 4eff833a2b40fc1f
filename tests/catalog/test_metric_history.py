"""The metric history on both backends: bounded buckets, exact aggregates, events, reads."""

from __future__ import annotations

import itertools
import math

import pytest
from sqlalchemy import event, func, select

from ckptstore.catalog import Catalog
from ckptstore.catalog.metric_history import downsample
from ckptstore.catalog.models import MetricHistoryRow
from ckptstore.errors import CheckpointNotFoundError, InvalidNameError
from ckptstore.records import MetricPoint


def _rows(catalog: Catalog, name: str = "loss") -> int:
    with catalog.engine.connect() as conn:
        return int(conn.execute(
            select(func.count()).select_from(MetricHistoryRow).where(MetricHistoryRow.name == name)
        ).scalar_one())


def test_short_series_is_stored_exactly(catalog: Catalog) -> None:
    catalog.ensure_run("r")
    assert catalog.record_history("r", {"loss": [(0, 3.0), (1, 2.5), (2, 2.25)],
                                        "lr": [(0, 0.1)]}) == 4
    points = catalog.metric_history("r")
    assert [(p.step_first, p.step_last, p.count, p.mean) for p in points] == [
        (0, 0, 1, 3.0), (1, 1, 1, 2.5), (2, 2, 1, 2.25)
    ]
    assert catalog.metric_history_names("r") == ["loss", "lr"]
    assert catalog.metric_history("r", "nothing") == []
    catalog.ensure_run("other")
    catalog.record_history("other", {"lr": [(0, 0.2)]})
    assert catalog.metric_history_runs() == ["r"]
    assert catalog.metric_history_runs("lr") == ["other", "r"]


def test_a_long_series_stays_bounded_and_keeps_every_spike(catalog: Catalog) -> None:
    catalog.ensure_run("r")
    bound = 64
    steps = 20_000
    spike_at = 12_345
    total = 0.0
    # Appended in 40 batches, as a recorder flushing at each save would.
    for first in range(0, steps, 500):
        batch = []
        for step in range(first, first + 500):
            value = 10.0 if step == spike_at else 1.0 + 1.0 / (1 + step)
            total += value
            batch.append((step, value))
        catalog.record_history("r", {"loss": batch}, max_points=bound)
        assert _rows(catalog) <= bound
    points = catalog.metric_history("r")
    assert 2 <= len(points) <= bound
    # Buckets cover the steps in order without overlap, and nothing logged was lost.
    assert points[0].step_first == 0 and points[-1].step_last == steps - 1
    assert all(a.step_last < b.step_first for a, b in itertools.pairwise(points))
    assert sum(p.count for p in points) == steps
    assert math.isclose(sum(p.mean * p.count for p in points), total, rel_tol=1e-12)
    spike = [p for p in points if p.step_first <= spike_at <= p.step_last]
    assert len(spike) == 1 and spike[0].max == 10.0
    assert points[-1].last == 1.0 + 1.0 / steps
    # Display downsampling merges further, keeping the extremes.
    shown = catalog.metric_history("r", max_points=8)
    assert len(shown) <= 8 and max(p.max for p in shown) == 10.0
    assert sum(p.count for p in shown) == steps


def test_an_append_touches_only_its_buckets(catalog: Catalog) -> None:
    """Once the width has settled, appending a batch is a handful of statements, not a
    rewrite of the series."""
    catalog.ensure_run("r")
    catalog.record_history("r", {"loss": [(s, 1.0) for s in range(4000)]}, max_points=100)
    statements: list[str] = []

    def count(conn: object, cursor: object, statement: str, *args: object) -> None:
        statements.append(statement.split()[0].upper())

    event.listen(catalog.engine, "before_cursor_execute", count)
    try:
        catalog.record_history("r", {"loss": [(s, 2.0) for s in range(4000, 4010)]},
                               max_points=100)
    finally:
        event.remove(catalog.engine, "before_cursor_execute", count)
    assert statements.count("DELETE") == 0
    assert statements.count("INSERT") + statements.count("UPDATE") <= 2


def test_rewind_and_events(catalog: Catalog) -> None:
    catalog.ensure_run("r")
    catalog.record_history(
        "r", {"loss": [(s, float(s)) for s in range(10)]},
        events=[("loss-anomaly", {"step": 7, "loss": 7.0, "kind": "spike", "reason": "up"})],
    )
    alerts = catalog.events(run="r", kind="loss-anomaly")
    assert [(e.kind, e.detail["step"], e.run) for e in alerts] == [("loss-anomaly", 7, "r")]
    assert catalog.events(run="r", kind="pruned") == []
    assert catalog.truncate_history("r", 5) == 4
    assert catalog.metric_history("r")[-1].step_last == 5
    catalog.record_history("r", {"loss": [(6, 0.5)]})
    assert catalog.metric_history("r")[-1].mean == 0.5


def test_bad_input_is_refused_before_anything_is_written(catalog: Catalog) -> None:
    catalog.ensure_run("r")
    with pytest.raises(InvalidNameError, match="finite"):
        catalog.record_history("r", {"loss": [(1, 1.0), (2, float("nan"))]})
    with pytest.raises(InvalidNameError):
        catalog.record_history("r", {"loss": [(-1, 1.0)]})
    with pytest.raises(InvalidNameError):
        catalog.record_history("r", {"bad name": [(1, 1.0)]})
    with pytest.raises(InvalidNameError, match="max_points"):
        catalog.record_history("r", {"loss": [(1, 1.0)]}, max_points=1)
    with pytest.raises(InvalidNameError, match="JSON"):
        catalog.record_history("r", {}, events=[("loss-anomaly", {"loss": float("nan")})])
    with pytest.raises(CheckpointNotFoundError):
        catalog.record_history("missing", {"loss": [(1, 1.0)]})
    assert catalog.metric_history("r") == []


def test_downsample_merges_by_count() -> None:
    pts = [MetricPoint(i, i, 1, float(i), float(i), float(i), float(i)) for i in range(10)]
    assert downsample(pts, 20) == pts
    merged = downsample(pts, 3)
    assert [(p.step_first, p.step_last, p.count) for p in merged] == [(0, 3, 4), (4, 7, 4),
                                                                      (8, 9, 2)]
    assert merged[0].mean == 1.5 and merged[2].max == 9.0 and merged[2].last == 9.0
