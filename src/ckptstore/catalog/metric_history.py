"""Metric history: each run's training-metric series (the loss curve), bounded in size.

A series is stored as buckets of consecutive steps (``metric_history`` rows, see
:class:`~ckptstore.catalog.models.MetricHistoryRow`). All buckets of a series have the same
power-of-two width; a value logged at step ``s`` joins the bucket starting at
``s - s % width``. When appending would leave a series with more than ``max_points``
buckets, the width doubles (neighbouring buckets merge, pairwise) until it fits, so a
million logged steps cost at most ``max_points`` rows and an append touches only the
buckets it lands in, except for the rare doubling, which rewrites the series once.

Buckets keep count, sum, min, max and the last value: the mean draws the curve, min and max
keep every spike and dip visible at any resolution.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import delete, func, insert, select, update
from sqlalchemy.orm import Session

from ckptstore.catalog.checks import check_json, check_metric_value, check_step
from ckptstore.catalog.core import MAX_BOUND_IDS, CatalogCore
from ckptstore.catalog.models import MetricHistoryRow as H
from ckptstore.catalog.models import RunRow
from ckptstore.errors import InvalidNameError
from ckptstore.names import validate_metric_name, validate_name
from ckptstore.records import MetricPoint

__all__ = ["DEFAULT_HISTORY_POINTS", "HistoryMixin", "downsample"]

#: Buckets a series keeps by default (each a few dozen bytes).
DEFAULT_HISTORY_POINTS = 2000
#: Largest bound a caller may ask for; the smallest is 2 (a bucket pair can always merge).
_MAX_HISTORY_POINTS = 1_000_000


@dataclass
class _Bucket:
    """The aggregate of the values logged in one span of steps."""

    start: int
    first: int
    last_step: int
    count: int
    total: float
    vmin: float
    vmax: float
    last: float

    @classmethod
    def of(cls, start: int, step: int, value: float) -> _Bucket:
        return cls(start, step, step, 1, value, value, value, value)

    def merge(self, other: _Bucket) -> None:
        """Fold ``other`` in (a later value at the same last step wins)."""
        if other.last_step >= self.last_step:
            self.last_step, self.last = other.last_step, other.last
        self.first = min(self.first, other.first)
        self.count += other.count
        self.total += other.total
        self.vmin = min(self.vmin, other.vmin)
        self.vmax = max(self.vmax, other.vmax)

    def row(self, run_id: int, name: str, width: int) -> dict[str, Any]:
        return {
            "run_id": run_id, "name": name, "bucket_start": self.start, "width": width,
            "step_first": self.first, "step_last": self.last_step, "count": self.count,
            "total": self.total, "vmin": self.vmin, "vmax": self.vmax, "last": self.last,
        }

    def point(self) -> MetricPoint:
        return MetricPoint(
            step_first=self.first, step_last=self.last_step, count=self.count,
            mean=self.total / self.count, min=self.vmin, max=self.vmax, last=self.last,
        )


def _from_row(row: Any) -> _Bucket:
    return _Bucket(int(row.bucket_start), int(row.step_first), int(row.step_last),
                   int(row.count), float(row.total), float(row.vmin), float(row.vmax),
                   float(row.last))


def _rebucket(buckets: Iterable[_Bucket], width: int) -> dict[int, _Bucket]:
    """Merge buckets into buckets of ``width`` (a multiple of every width they have)."""
    out: dict[int, _Bucket] = {}
    for b in sorted(buckets, key=lambda b: (b.start, b.last_step)):
        start = b.start - b.start % width
        have = out.get(start)
        if have is None:
            out[start] = _Bucket(start, b.first, b.last_step, b.count, b.total, b.vmin,
                                 b.vmax, b.last)
        else:
            have.merge(b)
    return out


def downsample(points: Sequence[MetricPoint], max_points: int) -> list[MetricPoint]:
    """Merge consecutive points so that at most ``max_points`` remain (for display).

    Args:
        points: Points in step order.
        max_points: The most to return (>= 1).

    Returns:
        ``points`` itself when short enough, else groups of consecutive points merged into
        one each (count-weighted mean, overall min and max, the last group member's last).
    """
    if max_points < 1:
        raise InvalidNameError(f"max_points must be >= 1, got {max_points!r}")
    if len(points) <= max_points:
        return list(points)
    size = math.ceil(len(points) / max_points)
    out: list[MetricPoint] = []
    for i in range(0, len(points), size):
        group = points[i : i + size]
        count = sum(p.count for p in group)
        out.append(MetricPoint(
            step_first=group[0].step_first, step_last=group[-1].step_last, count=count,
            mean=sum(p.mean * p.count for p in group) / count,
            min=min(p.min for p in group), max=max(p.max for p in group), last=group[-1].last,
        ))
    return out


def _check_points(series: Mapping[str, Iterable[tuple[int, float]]]
                  ) -> dict[str, list[tuple[int, float]]]:
    if not isinstance(series, Mapping):
        raise InvalidNameError(f"series must be a mapping of name to points, not {series!r}")
    out: dict[str, list[tuple[int, float]]] = {}
    for name, points in series.items():
        metric = validate_metric_name(name)
        checked = [(check_step(step), check_metric_value(metric, value))
                   for step, value in points]
        if checked:
            out[metric] = checked
    return out


class HistoryMixin(CatalogCore):
    """Metric-history methods of :class:`~ckptstore.catalog.Catalog`."""

    def record_history(
        self,
        run: str,
        series: Mapping[str, Iterable[tuple[int, float]]],
        *,
        events: Sequence[tuple[str, Mapping[str, Any]]] = (),
        max_points: int = DEFAULT_HISTORY_POINTS,
    ) -> int:
        """Append logged values to a run's series, and audit-log events, in one transaction.

        Args:
            run: The run (must exist).
            series: Metric name → ``(step, value)`` pairs (finite values, steps >= 0).
            events: ``(kind, detail)`` audit-log entries of the run to record with them
                (loss-monitor alerts).
            max_points: The most buckets each series keeps (2 to 1,000,000).

        Returns:
            The number of values appended.

        Raises:
            CheckpointNotFoundError: If the run does not exist.
            InvalidNameError: For a bad metric name, step, value, event or bound.
        """
        validate_name(run)
        if isinstance(max_points, bool) or not isinstance(max_points, int) or not (
            2 <= max_points <= _MAX_HISTORY_POINTS
        ):
            raise InvalidNameError(
                f"max_points must be an int from 2 to {_MAX_HISTORY_POINTS}, got {max_points!r}"
            )
        checked = _check_points(series)
        entries = []
        for kind, detail in events:
            if not isinstance(kind, str) or not kind or len(kind) > 64:
                raise InvalidNameError(
                    f"event kind must be a non-empty string of <= 64 chars, not {kind!r}"
                )
            entries.append((kind, check_json(detail, "event detail")))
        if not checked and not entries:
            return 0
        with self._write() as s:
            # Locking the run row serialises two writers of one run's series on PostgreSQL
            # (SQLite's BEGIN IMMEDIATE already does).
            run_id = self._run_id(s, run, lock=True)
            for name, points in checked.items():
                self._append_series(s, run_id, name, points, max_points)
            for kind, detail in entries:
                self._add_event(s, kind, run_id=run_id, detail=detail)
        return sum(len(p) for p in checked.values())

    def _append_series(self, s: Session, run_id: int, name: str,
                       points: Sequence[tuple[int, float]], max_points: int) -> None:
        where = (H.run_id == run_id, H.name == name)
        existing, width = s.execute(select(func.count(), func.max(H.width)).where(*where)).one()
        width = int(width or 1)
        new: dict[int, _Bucket] = {}
        for step, value in points:
            start = step - step % width
            bucket = _Bucket.of(start, step, value)
            have = new.get(start)
            if have is None:
                new[start] = bucket
            else:
                have.merge(bucket)
        starts = sorted(new)
        touched: dict[int, _Bucket] = {}
        for i in range(0, len(starts), MAX_BOUND_IDS):
            batch = starts[i : i + MAX_BOUND_IDS]
            for row in s.execute(select(H).where(*where, H.bucket_start.in_(batch))).scalars():
                touched[int(row.bucket_start)] = _from_row(row)
        if int(existing) + len(new) - len(touched) <= max_points:
            fresh = []
            for start, bucket in new.items():
                have = touched.get(start)
                if have is None:
                    fresh.append(bucket.row(run_id, name, width))
                    continue
                have.merge(bucket)
                values = have.row(run_id, name, width)
                s.execute(update(H).where(*where, H.bucket_start == start).values(
                    {k: v for k, v in values.items() if k not in ("run_id", "name")}
                ))
            if fresh:
                s.execute(insert(H), fresh)
            return
        # Too many buckets: double the width until the whole series fits, then rewrite it.
        rows = [_from_row(r) for r in s.execute(select(H).where(*where)).scalars()]
        every = [*rows, *new.values()]
        merged = _rebucket(every, width)
        while len(merged) > max_points:
            width *= 2
            merged = _rebucket(merged.values(), width)
        s.execute(delete(H).where(*where))
        s.execute(insert(H), [b.row(run_id, name, width) for b in merged.values()])

    def truncate_history(self, run: str, after_step: int) -> int:
        """Forget a run's logged values after ``after_step`` (a resume rewound the run).

        A bucket that spans ``after_step`` keeps what it aggregated; buckets that start
        after it are removed, from every series of the run.

        Args:
            run: The run (must exist).
            after_step: The step the run resumed from.

        Returns:
            The number of buckets removed.

        Raises:
            CheckpointNotFoundError: If the run does not exist.
            InvalidNameError: For a bad step.
        """
        validate_name(run)
        step = check_step(after_step)
        with self._write() as s:
            run_id = self._run_id(s, run, lock=True)
            result = s.execute(delete(H).where(H.run_id == run_id, H.step_first > step))
            return int(getattr(result, "rowcount", 0) or 0)

    def metric_history(
        self, run: str, name: str = "loss", *, max_points: int | None = None
    ) -> list[MetricPoint]:
        """A run's series in step order, optionally merged down to ``max_points`` for display.

        Args:
            run: The run.
            name: The metric.
            max_points: At most this many points (see :func:`downsample`); None returns the
                stored buckets.

        Returns:
            The points; empty when nothing was logged under ``name``.

        Raises:
            CheckpointNotFoundError: If the run does not exist.
            InvalidNameError: For a bad name or bound.
        """
        validate_name(run)
        metric = validate_metric_name(name)
        with self._read() as s:
            run_id = self._run_id(s, run)
            rows = s.execute(
                select(H).where(H.run_id == run_id, H.name == metric).order_by(H.bucket_start)
            ).scalars()
            points = [_from_row(r).point() for r in rows]
        return points if max_points is None else downsample(points, max_points)

    def metric_history_runs(self, name: str = "loss") -> list[str]:
        """Names of the runs that recorded a series ``name``, sorted.

        Raises:
            InvalidNameError: For a bad metric name.
        """
        metric = validate_metric_name(name)
        with self._read() as s:
            rows = s.scalars(
                select(RunRow.name).join(H, H.run_id == RunRow.id).where(H.name == metric)
                .distinct()
            )
            return sorted(rows)

    def metric_history_names(self, run: str) -> list[str]:
        """Names of the run's recorded series, sorted.

        Raises:
            CheckpointNotFoundError: If the run does not exist.
        """
        validate_name(run)
        with self._read() as s:
            run_id = self._run_id(s, run)
            return sorted(s.scalars(select(H.name).where(H.run_id == run_id).distinct()))
