"""Prometheus instruments of one :class:`~ckptstore.observability.Metrics` recorder.

Only imported when ``prometheus_client`` is installed (``pip install 'ckptstore[metrics]'``).
Each recorder owns a ``CollectorRegistry``, so two stores in one process (or a test and the
store it checks) never share counters.

Exposed series:

==================================  ==========  ==========================================
name                                type        meaning
==================================  ==========  ==========================================
ckptstore_save_seconds{run}         histogram   wall time of ``save`` calls
ckptstore_operation_seconds{op}     histogram   wall time of every operation
ckptstore_blocked_seconds{op}       histogram   time the training loop was blocked
ckptstore_bytes_total{op,kind}      counter     bytes by kind: logical/stored/transferred/
                                                deduplicated
ckptstore_failures_total{op,...}    counter     failed operations by exception type
ckptstore_prefetch_total{outcome}   counter     loads of prefetched checkpoints (hit) and
                                                loads that fetched a copy first (miss)
ckptstore_staging_bytes_in_use      gauge       host memory held by async-save staging
ckptstore_flow_queue_depth          gauge       flows queued or running in the embedded runner
ckptstore_compression_ratio         gauge       logical / stored bytes over this process's saves
ckptstore_dedup_ratio               gauge       deduplicated / (stored + deduplicated) bytes
checkpoint_save_time                gauge       seconds the last save took
io_throughput{op}                   gauge       bytes/s of the last operation
memory_fragmentation{source}        gauge       free share of allocator memory
==================================  ==========  ==========================================

The last three keep their short names without the ``ckptstore_`` prefix: renaming a metric
breaks every dashboard and alert that queries it.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

__all__ = ["PromInstruments"]

logger = logging.getLogger(__name__)

# Seconds: checkpoint operations range from milliseconds (small loads) to many minutes
# (multi-GB archives), so the buckets span 5 ms .. 30 min.
_SECONDS_BUCKETS = (
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0,
    300.0, 600.0, 1800.0, math.inf,
)
_BLOCKED_BUCKETS = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
    30.0, 60.0, math.inf,
)


class _LiveGauges(Collector):
    """Gauges read at scrape time from callbacks (no cost on the training path)."""

    def __init__(
        self,
        staging: Callable[[], float | None],
        queue_depth: Callable[[], float | None],
        fragmentation: Callable[[], dict[str, float]],
    ) -> None:
        self._staging = staging
        self._queue_depth = queue_depth
        self._fragmentation = fragmentation

    def describe(self) -> list[Any]:
        # Returning no descriptions keeps registration from calling collect() eagerly.
        return []

    def collect(self) -> Iterator[GaugeMetricFamily]:
        staging = GaugeMetricFamily(
            "ckptstore_staging_bytes_in_use",
            "Host memory bytes held by async-save staging buffers of unfinished saves.",
        )
        value = _safe(self._staging)
        if value is not None:
            staging.add_metric([], value)
        yield staging
        depth = GaugeMetricFamily(
            "ckptstore_flow_queue_depth",
            "Flows queued or running in the embedded flow runner.",
        )
        value = _safe(self._queue_depth)
        if value is not None:
            depth.add_metric([], value)
        yield depth
        frag = GaugeMetricFamily(
            "memory_fragmentation",
            "Share of allocator memory held but unused. source=glibc_malloc: "
            "(arena - in_use)/arena from mallinfo2 (CPU heap); source=cuda:N: "
            "(reserved - allocated)/reserved from torch.cuda.memory_stats.",
            labels=["source"],
        )
        try:
            figures = self._fragmentation()
        except Exception:  # a scrape must answer even if one source breaks
            logger.debug("fragmentation figures unavailable", exc_info=True)
            figures = {}
        for source, fraction in sorted(figures.items()):
            frag.add_metric([source], fraction)
        yield frag


def _safe(func: Callable[[], float | None]) -> float | None:
    try:
        value = func()
    except Exception:
        logger.debug("gauge callback failed", exc_info=True)
        return None
    return None if value is None else float(value)


class PromInstruments:
    """The metric objects of one recorder, with label children cached for speed.

    ``labels()`` validates and stringifies its arguments under a lock on every call; caching
    the children by label tuple keeps an observation at a few microseconds.
    """

    def __init__(
        self,
        registry: CollectorRegistry,
        *,
        staging: Callable[[], float | None],
        queue_depth: Callable[[], float | None],
        fragmentation: Callable[[], dict[str, float]],
    ) -> None:
        """Create and register every instrument in ``registry``.

        Args:
            registry: The recorder's registry.
            staging: Returns the staging bytes in use (None: unknown).
            queue_depth: Returns the flow queue depth (None: unknown).
            fragmentation: Returns fragmentation figures by source.
        """
        self.registry = registry
        kw: dict[str, Any] = {"registry": registry}
        self.save_seconds = Histogram(
            "ckptstore_save_seconds", "Wall time of save calls, by run.", ["run"],
            buckets=_SECONDS_BUCKETS, **kw,
        )
        self.operation_seconds = Histogram(
            "ckptstore_operation_seconds",
            "Wall time of checkpoint operations (save, load, archive, prune, restore, "
            "convert, verify).",
            ["op"], buckets=_SECONDS_BUCKETS, **kw,
        )
        self.blocked_seconds = Histogram(
            "ckptstore_blocked_seconds",
            "Seconds the calling (training) thread was blocked by an operation.",
            ["op"], buckets=_BLOCKED_BUCKETS, **kw,
        )
        self.bytes_total = Counter(
            "ckptstore_bytes",
            "Bytes handled by operations; kind is logical (tensor bytes), stored (bytes "
            "written at rest), transferred (bytes moved between tiers) or deduplicated "
            "(chunk bytes not written because an identical chunk existed).",
            ["op", "kind"], **kw,
        )
        self.failures_total = Counter(
            "ckptstore_failures",
            "Failed operations by exception type.",
            ["op", "error_type"], **kw,
        )
        self.prefetch_total = Counter(
            "ckptstore_prefetch",
            "Loads of a checkpoint a prefetch had brought to this host (outcome=hit) and "
            "loads that had to fetch a copy from a slower tier first (outcome=miss).",
            ["outcome"], **kw,
        )
        self.compression_ratio = Gauge(
            "ckptstore_compression_ratio",
            "Logical bytes / stored bytes over the saves of this process.",
            **kw,
        )
        self.dedup_ratio = Gauge(
            "ckptstore_dedup_ratio",
            "Deduplicated / (stored + deduplicated) chunk bytes over the saves of this process.",
            **kw,
        )
        self.checkpoint_save_time = Gauge(
            "checkpoint_save_time", "Seconds the most recent save took.", **kw
        )
        self.io_throughput = Gauge(
            "io_throughput",
            "Bytes per second of the most recent operation of each kind "
            "(transferred bytes, else stored bytes, over its wall time).",
            ["op"], **kw,
        )
        registry.register(_LiveGauges(staging, queue_depth, fragmentation))
        self._children: dict[tuple[Any, ...], Any] = {}

    def _child(self, metric: Any, *labels: str) -> Any:
        key = (id(metric), *labels)
        child = self._children.get(key)
        if child is None:
            child = metric.labels(*labels)
            self._children[key] = child
        return child

    def record(
        self,
        op: str,
        *,
        seconds: float,
        blocked_seconds: float | None,
        byte_counts: tuple[tuple[str, int], ...],
        run: str,
        ok: bool,
        error_type: str,
        throughput: float | None,
    ) -> None:
        """Record one operation (see :meth:`Metrics.observe` for the meaning)."""
        self._child(self.operation_seconds, op).observe(seconds)
        if op == "save":
            self._child(self.save_seconds, run).observe(seconds)
            if ok:
                self.checkpoint_save_time.set(seconds)
        if blocked_seconds is not None:
            self._child(self.blocked_seconds, op).observe(blocked_seconds)
        for kind, count in byte_counts:
            if count:
                self._child(self.bytes_total, op, kind).inc(count)
        if not ok:
            self._child(self.failures_total, op, error_type).inc()
        if throughput is not None:
            self._child(self.io_throughput, op).set(throughput)

    def record_prefetch(self, outcome: str) -> None:
        """Count one prefetch ``hit`` or ``miss``."""
        self._child(self.prefetch_total, outcome).inc()

    def record_blocked(self, op: str, seconds: float) -> None:
        """Record blocked time alone (the operation is recorded separately)."""
        self._child(self.blocked_seconds, op).observe(seconds)

    def set_ratios(self, compression: float | None, dedup: float | None) -> None:
        """Update the compression and dedup ratio gauges (None leaves one unchanged)."""
        if compression is not None:
            self.compression_ratio.set(compression)
        if dedup is not None:
            self.dedup_ratio.set(dedup)
