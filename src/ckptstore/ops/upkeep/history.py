"""Recording a run's training-metric series (the loss curve) without slowing the loop.

:class:`MetricHistory` takes one value per step and metric on the training thread (an
append to an in-memory list under a lock, about a microsecond) and writes what accumulated to
the catalog in one transaction per :meth:`~MetricHistory.flush`: the
:class:`~ckptstore.hooks.CheckpointManager` flushes after each committed save (on the
background save thread for async saves) and on close, and a full buffer is flushed by a
short-lived background thread, so a long stretch without saves still costs one transaction
per ``flush_every`` values, never one per step. The catalog keeps each series bounded
(``catalog/metric_history.py``: buckets that merge as the series grows).

Loss-monitor alerts travel the same way (:meth:`~MetricHistory.alert`), as ``loss-anomaly``
events of the run, written with the next flush (which an alert schedules at once).
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

import torch

from ckptstore.catalog.metric_history import DEFAULT_HISTORY_POINTS
from ckptstore.core import StoreCore
from ckptstore.errors import CkptError, ConfigError
from ckptstore.names import validate_metric_name

__all__ = ["ALERT_EVENT", "DEFAULT_HISTORY_POINTS", "MetricHistory"]

logger = logging.getLogger(__name__)

#: Event kind of a loss-monitor alert in the audit log.
ALERT_EVENT = "loss-anomaly"


class MetricHistory:
    """Buffer one run's per-step metric values and alerts; write them to the catalog in batches.

    One value per step and metric is kept: a second value for a step already recorded (the
    loss monitor and the manager both seeing the same loss) is ignored, and so are
    non-finite values (the alert records those). Thread-safe.

    Attributes:
        run: The run the series belong to.
        max_points: The most buckets the catalog keeps per series.
        writes: Catalog transactions this recorder made (one per non-empty flush).
        dropped: Values refused (non-finite) or dropped (buffer full while the catalog
            could not be written).
    """

    def __init__(
        self,
        store: StoreCore,
        run: str,
        *,
        max_points: int = DEFAULT_HISTORY_POINTS,
        flush_every: int = 10_000,
    ) -> None:
        """Create a recorder for an existing run.

        Args:
            store: The open store.
            run: The run (already in the catalog).
            max_points: Buckets the catalog keeps per series (2 or more).
            flush_every: Buffered values that trigger a background flush.

        Raises:
            ConfigError: For a bound or batch size below 2 / 1.
        """
        if isinstance(max_points, bool) or not isinstance(max_points, int) or max_points < 2:
            raise ConfigError(f"history max_points must be an int >= 2, got {max_points!r}")
        if isinstance(flush_every, bool) or not isinstance(flush_every, int) or flush_every < 1:
            raise ConfigError(f"history flush_every must be an int >= 1, got {flush_every!r}")
        self.store = store
        self.run = run
        self.max_points = max_points
        self.flush_every = flush_every
        self.writes = 0
        self.dropped = 0
        self._points: dict[str, list[tuple[int, float | torch.Tensor]]] = {}
        self._events: list[tuple[str, dict[str, Any]]] = []
        self._buffered = 0
        self._last: dict[str, int] = {}
        self._lock = threading.Lock()
        # Held for a whole flush, so batches reach the catalog in the order they were taken.
        self._write_lock = threading.Lock()
        self._flusher: threading.Thread | None = None
        self._closed = False

    # ------------------------------------------------------------------ the training path
    def add(self, step: int, value: Any, name: str = "loss") -> bool:
        """Buffer ``value`` of metric ``name`` at ``step`` (cheap; never touches the catalog).

        A one-element tensor is copied where it lives (detached; the copy is queued on the
        device, nothing waits) and read at the next flush, off this thread: reading a CUDA
        loss here would wait for the device at every step. The copy keeps the value of this
        step even if the caller's tensor is updated in place later.

        Args:
            step: Training step (>= 0).
            value: A number or a one-element tensor.
            name: Metric name.

        Returns:
            True when the value was kept; False for a non-finite value (one known now), a
            step already recorded for that metric, or a tensor of more than one element.
        """
        number: float | torch.Tensor
        if isinstance(value, torch.Tensor):
            if value.numel() != 1:
                self.dropped += 1
                return False
            number = value.detach().clone()
        else:
            number = float(value)
        if step < 0 or (isinstance(number, float) and not math.isfinite(number)):
            self.dropped += 1
            return False
        with self._lock:
            if self._closed:
                return False
            last = self._last.get(name)
            if last is not None and step <= last:
                return False
            if last is None:
                validate_metric_name(name)
            self._last[name] = step
            self._points.setdefault(name, []).append((int(step), number))
            self._buffered += 1
            due = self._buffered >= self.flush_every
        if due:
            self._flush_in_background()
        return True

    def add_many(self, step: int, metrics: Mapping[str, Any]) -> None:
        """:meth:`add` every number of ``metrics`` (others are skipped)."""
        for name, value in metrics.items():
            try:
                self.add(step, value, name)
            except (TypeError, ValueError):
                logger.debug("metric %s=%r is not a number; not recorded", name, value)

    def alert(self, step: int, value: float, kind: str, reason: str, name: str = "loss"
              ) -> None:
        """Record a loss-monitor alert as a ``loss-anomaly`` event of the run (soon, off
        this thread).

        Args:
            step: The step that fired.
            value: The value that fired (NaN/inf are recorded as text).
            kind: ``spike`` or ``nonfinite``.
            reason: The monitor's explanation.
            name: The series the alert belongs to.
        """
        number = float(value)
        detail = {
            "step": int(step),
            "loss": number if math.isfinite(number) else str(number),
            "kind": kind,
            "reason": reason,
            "metric": name,
            "time": datetime.now(UTC).isoformat(),
        }
        with self._lock:
            if self._closed:
                return
            self._events.append((ALERT_EVENT, detail))
        self._flush_in_background()

    # ------------------------------------------------------------------ writing
    def flush(self) -> int:
        """Write everything buffered to the catalog in one transaction.

        Returns:
            The number of values written.

        Raises:
            CkptError: If the catalog refused the batch (it stays buffered for the next
                flush, up to ``10 * flush_every`` values).
        """
        with self._write_lock:
            with self._lock:
                points, self._points = self._points, {}
                events, self._events = self._events, []
                self._buffered = 0
            if not points and not events:
                return 0
            try:
                written = self.store.catalog.record_history(
                    self.run, self._resolved(points), events=events,
                    max_points=self.max_points,
                )
            except CkptError:
                self._put_back(points, events)
                raise
            self.writes += 1
            return written

    def _resolved(self, points: dict[str, list[tuple[int, float | torch.Tensor]]]
                  ) -> dict[str, list[tuple[int, float]]]:
        """Plain finite floats: device tensors read (one transfer per series), NaN/inf dropped."""
        out: dict[str, list[tuple[int, float]]] = {}
        for name, values in points.items():
            read = iter(_read([v for _, v in values if isinstance(v, torch.Tensor)]))
            kept = []
            for step, value in values:
                number = float(next(read)) if isinstance(value, torch.Tensor) else value
                if math.isfinite(number):
                    kept.append((step, number))
                else:
                    self.dropped += 1
            out[name] = kept
        return out

    def _put_back(self, points: dict[str, list[tuple[int, float | torch.Tensor]]],
                  events: list[tuple[str, dict[str, Any]]]) -> None:
        with self._lock:
            for name, values in points.items():
                merged = values + self._points.get(name, [])
                cap = 10 * self.flush_every
                if len(merged) > cap:
                    # Bounded memory while the catalog is down: the oldest values go first.
                    self.dropped += len(merged) - cap
                    merged = merged[-cap:]
                self._points[name] = merged
            self._buffered = sum(len(v) for v in self._points.values())
            self._events = events + self._events

    def _flush_quietly(self) -> bool:
        try:
            self.flush()
        except CkptError:
            logger.warning("could not record the metric history of %s; retrying at the next "
                           "flush", self.run, exc_info=True)
            return False
        return True

    def _background(self) -> None:
        # Values and alerts that arrived while this thread was writing found it alive and
        # did not start another one: keep going while a full batch or an alert is waiting.
        for _ in range(1000):  # bounded; a later add() starts a new thread anyway
            ok = self._flush_quietly()
            with self._lock:
                again = self._buffered >= self.flush_every or bool(self._events)
                # After a failure, wait for the next trigger instead of retrying at once.
                if not ok or not again or self._closed:
                    self._flusher = None
                    return
        with self._lock:
            self._flusher = None

    def _flush_in_background(self) -> None:
        with self._lock:
            running = self._flusher
            if self._closed or (running is not None and running.is_alive()):
                return
            thread = threading.Thread(target=self._background, name="ckpt-history",
                                      daemon=True)
            self._flusher = thread
        thread.start()

    def rewind(self, step: int) -> None:
        """Forget values after ``step`` (the run resumed from a checkpoint at ``step``),
        buffered and catalogued.

        Raises:
            CkptError: If the catalog cannot be written.
        """
        with self._write_lock, self._lock:
            for name, values in self._points.items():
                self._points[name] = [(s, v) for s, v in values if s <= step]
            self._buffered = sum(len(v) for v in self._points.values())
            self._last = {n: min(s, step) for n, s in self._last.items()}
        self.store.catalog.truncate_history(self.run, step)

    def close(self) -> None:
        """Write what is buffered and stop taking values (idempotent; errors are logged)."""
        with self._lock:
            if self._closed:
                return
            flusher = self._flusher
        if flusher is not None:
            flusher.join()
        self._flush_quietly()
        with self._lock:
            self._closed = True


def _read(tensors: list[torch.Tensor]) -> list[float]:
    """The values of one-element tensors, in one device-to-host transfer when they share a
    device."""
    if not tensors:
        return []
    try:
        return [float(v) for v in torch.stack([t.reshape(()).double() for t in tensors]).cpu()]
    except RuntimeError:  # tensors on different devices
        return [float(t) for t in tensors]
