"""The :class:`Metrics` recorder: one call per checkpoint operation, several outputs.

Timing an operation is :mod:`ckptstore.observability.timing`; serving what was recorded over
HTTP or as a textfile is :mod:`ckptstore.observability.serving`.

An observation updates in-process totals (always), Prometheus instruments (when
``prometheus_client`` is installed), a TensorBoard event file (when attached and a step is
given) and emits one structured log record on the ``ckptstore.operations`` logger (a JSON
line with ``CKPT_LOG_JSON=1``). Without TensorBoard or a log handler it costs about
15-25 µs (measured on a busy 2-core box; the test bounds it at 50 µs), so it can sit on the
training path.

Example:
    >>> metrics = Metrics()
    >>> with metrics.timed("save", run="run-a", step=100) as op:   # doctest: +SKIP
    ...     manifest = write_checkpoint(...)
    ...     op.add(bytes_logical=manifest.logical_bytes, bytes_stored=manifest.stored_bytes)
    >>> server = metrics.serve_metrics(9108)                        # doctest: +SKIP
"""

from __future__ import annotations

import logging
import math
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ckptstore.errors import ConfigError, InvalidNameError
from ckptstore.extras import missing_extra
from ckptstore.observability.jsonlog import FIELDS_ATTR, configure_logging
from ckptstore.observability.memory import fragmentation_sources
from ckptstore.observability.serving import (
    MetricsServer,
    serve_registry,
    write_registry_textfile,
)
from ckptstore.observability.timing import OperationTimer

if TYPE_CHECKING:
    from ckptstore.observability.prom import PromInstruments
    from ckptstore.observability.tensorboard import TensorBoardSink

__all__ = ["OPS", "Metrics", "OpTotals", "dedup_bytes"]

logger = logging.getLogger(__name__)
# A logger of its own, outside this module's name: operators filter or route the
# per-operation records ("one JSON line per operation") independently of debug chatter.
ops_log = logging.getLogger("ckptstore.operations")

#: Operations the recorder knows; anything else is a programming error.
OPS = ("save", "load", "archive", "prune", "restore", "convert", "verify", "gc", "prefetch")
_OPS = frozenset(OPS)


@dataclass
class OpTotals:
    """Running totals of one operation kind in this process."""

    count: int = 0
    failures: int = 0
    seconds: float = 0.0
    blocked_seconds: float = 0.0
    bytes_logical: int = 0
    bytes_stored: int = 0
    bytes_transferred: int = 0
    bytes_deduplicated: int = 0
    last_seconds: float | None = None
    errors: dict[str, int] = field(default_factory=dict)


def dedup_bytes(manifest: Any) -> int:
    """Bytes of chunk files a checkpoint reuses from other checkpoints instead of writing.

    Args:
        manifest: A :class:`~ckptstore.format.Manifest`.

    Returns:
        Sum of ``nbytes`` over chunks whose ``src`` names another checkpoint.
    """
    total = 0
    for array in manifest.arrays.values():
        for chunk in array.chunks:
            if chunk.src is not None:
                total += int(chunk.nbytes)
    return total


def _finite(value: float) -> float:
    number = float(value)
    # Metrics must never break the caller: a clock glitch or NaN becomes 0, not an error.
    return number if math.isfinite(number) and number > 0 else 0.0


class Metrics:
    """Records checkpoint operations; exports to Prometheus, TensorBoard and JSON logs.

    Lifecycle: create (one per store) → :meth:`observe` / :meth:`timed` from any thread →
    optionally :meth:`serve_metrics`, :meth:`write_textfile`, :meth:`attach_tensorboard`
    → :meth:`close` stops servers and flushes TensorBoard.

    Args:
        prometheus: Build Prometheus instruments; None (default) when ``prometheus_client``
            is installed, False never, True requires it.
        tensorboard_dir: Attach a TensorBoard sink writing there.

    Raises:
        ConfigError: If ``prometheus=True`` and ``prometheus_client`` is missing, or
            TensorBoard was requested without the ``tensorboard`` package.
    """

    def __init__(
        self,
        *,
        prometheus: bool | None = None,
        tensorboard_dir: str | os.PathLike[str] | None = None,
    ) -> None:
        self._lock = threading.Lock()
        self._totals: dict[str, OpTotals] = {}
        self._prefetch = {"hit": 0, "miss": 0}
        self._staging: Callable[[], float | None] = lambda: None
        self._queue_depth: Callable[[], float | None] = lambda: None
        self._servers: list[MetricsServer] = []
        self._tensorboard: TensorBoardSink | None = None
        self.prom: PromInstruments | None = None
        if prometheus is not False:
            self.prom = self._build_prometheus(required=prometheus is True)
        if tensorboard_dir is not None:
            self.attach_tensorboard(tensorboard_dir)
        # CKPT_LOG_JSON=1 must work without code changes in the training script; the store
        # creates a recorder on open, so this is where the switch is honoured.
        configure_logging()

    # ------------------------------------------------------------------ setup
    def _build_prometheus(self, *, required: bool) -> PromInstruments | None:
        try:
            from prometheus_client import CollectorRegistry

            from ckptstore.observability.prom import PromInstruments
        except ImportError as exc:
            if required:
                raise missing_extra("prometheus_client", "Prometheus metrics") from exc
            logger.debug("prometheus_client not installed; Prometheus export disabled")
            return None
        return PromInstruments(
            CollectorRegistry(auto_describe=True),
            staging=lambda: self._staging(),
            queue_depth=lambda: self._queue_depth(),
            fragmentation=fragmentation_sources,
        )

    def attach_tensorboard(self, log_dir: str | os.PathLike[str]) -> TensorBoardSink:
        """Log every observation that carries a step to TensorBoard under ``log_dir``.

        Args:
            log_dir: Event file directory.

        Returns:
            The sink (already attached; a previous one is closed).

        Raises:
            ConfigError: If the ``tensorboard`` package is missing.
        """
        from ckptstore.observability.tensorboard import TensorBoardSink

        sink = TensorBoardSink(log_dir)
        old, self._tensorboard = self._tensorboard, sink
        if old is not None:
            old.close()
        return sink

    def detach_tensorboard(self, sink: TensorBoardSink) -> None:
        """Flush and close ``sink``; stop logging to it if it is the attached one.

        A sink that was already replaced by a later :meth:`attach_tensorboard` is closed
        there; closing it again is a no-op, so callers need not know who replaced it.

        Args:
            sink: A sink returned by :meth:`attach_tensorboard`.
        """
        if self._tensorboard is sink:
            self._tensorboard = None
        sink.close()

    @property
    def tensorboard(self) -> TensorBoardSink | None:
        """The attached TensorBoard sink, if any."""
        return self._tensorboard

    def bind_gauges(
        self,
        *,
        staging_bytes: Callable[[], float | None] | None = None,
        queue_depth: Callable[[], float | None] | None = None,
    ) -> None:
        """Read live gauges from callbacks at scrape time (nothing runs per operation).

        Args:
            staging_bytes: Returns the async-save staging bytes in use, e.g.
                ``lambda: saver.pool.in_use_bytes``.
            queue_depth: Returns the flows queued or running, e.g. ``runner.pending``.
        """
        if staging_bytes is not None:
            self._staging = staging_bytes
        if queue_depth is not None:
            self._queue_depth = queue_depth

    # ------------------------------------------------------------------ recording
    def observe(
        self,
        op: str,
        *,
        seconds: float,
        blocked_seconds: float | None = None,
        bytes_logical: int = 0,
        bytes_stored: int = 0,
        bytes_transferred: int = 0,
        bytes_deduplicated: int = 0,
        run: str | None = None,
        tier: str | None = None,
        step: int | None = None,
        ok: bool = True,
        error_type: str | None = None,
    ) -> None:
        """Record one finished operation.

        Args:
            op: One of :data:`OPS`.
            seconds: Wall time of the operation.
            blocked_seconds: Time the caller's (training) thread was blocked; None when the
                operation ran off the training path (flows). A synchronous ``save`` blocks
                for all of ``seconds``; an async save only while staging.
            bytes_logical: Tensor bytes (uncompressed) the operation covered.
            bytes_stored: Bytes written at rest (after compression and dedup).
            bytes_transferred: Bytes moved between tiers or over the network.
            bytes_deduplicated: Chunk bytes not written because they already existed.
            run: The run, for per-run series and logs.
            tier: The tier involved, for logs.
            step: Training step; needed for TensorBoard.
            ok: False when the operation failed.
            error_type: Exception class name of a failure (default ``unknown``).

        Raises:
            InvalidNameError: If ``op`` is not a known operation.
        """
        if op not in _OPS:
            raise InvalidNameError(
                f"unknown metrics operation {op!r}; use one of {', '.join(OPS)}"
            )
        secs = _finite(seconds)
        blocked = None if blocked_seconds is None else _finite(blocked_seconds)
        err = "" if ok else (error_type or "unknown")
        moved = bytes_transferred or bytes_stored
        throughput = moved / secs if ok and moved > 0 and secs > 0 else None
        compression = dedup = None
        with self._lock:
            totals = self._totals.get(op)
            if totals is None:
                totals = self._totals[op] = OpTotals()
            totals.count += 1
            totals.seconds += secs
            totals.last_seconds = secs
            if blocked is not None:
                totals.blocked_seconds += blocked
            totals.bytes_logical += bytes_logical
            totals.bytes_stored += bytes_stored
            totals.bytes_transferred += bytes_transferred
            totals.bytes_deduplicated += bytes_deduplicated
            if not ok:
                totals.failures += 1
                totals.errors[err] = totals.errors.get(err, 0) + 1
            if op == "save" and ok:
                if totals.bytes_stored > 0:
                    compression = totals.bytes_logical / totals.bytes_stored
                written = totals.bytes_stored + totals.bytes_deduplicated
                if written > 0:
                    dedup = totals.bytes_deduplicated / written
        if self.prom is not None:
            self.prom.record(
                op,
                seconds=secs,
                blocked_seconds=blocked,
                byte_counts=(
                    ("logical", bytes_logical),
                    ("stored", bytes_stored),
                    ("transferred", bytes_transferred),
                    ("deduplicated", bytes_deduplicated),
                ),
                run=run or "",
                ok=ok,
                error_type=err,
                throughput=throughput,
            )
            if compression is not None or dedup is not None:
                self.prom.set_ratios(compression, dedup)
        sink = self._tensorboard
        if sink is not None and step is not None:
            values = {"seconds": secs, "bytes_stored": float(bytes_stored)}
            if blocked is not None:
                values["blocked_seconds"] = blocked
            if throughput is not None:
                values["throughput_bytes_per_s"] = throughput
            if op == "save" and ok and bytes_stored > 0:
                values["compression_ratio"] = bytes_logical / bytes_stored
            if not ok:
                values["failed"] = 1.0
            sink.log(step, op, values)
        if ops_log.isEnabledFor(logging.INFO):
            fields = {
                "event": "ckpt.operation",
                "op": op,
                "ok": ok,
                "seconds": round(secs, 6),
                "blocked_seconds": None if blocked is None else round(blocked, 6),
                "bytes_logical": bytes_logical,
                "bytes_stored": bytes_stored,
                "bytes_transferred": bytes_transferred,
                "bytes_deduplicated": bytes_deduplicated,
                "run": run,
                "tier": tier,
                "step": step,
                "error_type": err or None,
            }
            ops_log.log(
                logging.INFO if ok else logging.WARNING,
                "%s %s in %.3fs (run=%s step=%s tier=%s, %s bytes stored)",
                op, "ok" if ok else f"failed ({err})", secs, run, step, tier, bytes_stored,
                extra={FIELDS_ATTR: fields},
            )

    def observe_blocked(
        self, op: str, seconds: float, *, run: str | None = None, step: int | None = None
    ) -> None:
        """Record only the time the caller was blocked (an async save's staging).

        The operation itself is recorded later by :meth:`observe` / :meth:`timed` on the
        background thread, so it is not counted twice.

        Args:
            op: One of :data:`OPS`.
            seconds: Blocked wall time.
            run: The run (for TensorBoard and logs only).
            step: Training step (TensorBoard).

        Raises:
            InvalidNameError: If ``op`` is not a known operation.
        """
        if op not in _OPS:
            raise InvalidNameError(
                f"unknown metrics operation {op!r}; use one of {', '.join(OPS)}"
            )
        secs = _finite(seconds)
        with self._lock:
            totals = self._totals.get(op)
            if totals is None:
                totals = self._totals[op] = OpTotals()
            totals.blocked_seconds += secs
        if self.prom is not None:
            self.prom.record_blocked(op, secs)
        sink = self._tensorboard
        if sink is not None and step is not None:
            sink.log(step, op, {"blocked_seconds": secs})
        logger.debug("%s of %s blocked the caller for %.4fs", op, run, secs)

    def timed(
        self,
        op: str,
        *,
        run: str | None = None,
        tier: str | None = None,
        step: int | None = None,
        blocking: bool = False,
    ) -> OperationTimer:
        """A context manager timing one operation and observing it on exit (also on error).

        Args:
            op: One of :data:`OPS`.
            run: The run.
            tier: The tier.
            step: The training step.
            blocking: The caller's thread waits for the whole operation, so its wall time
                is also recorded as blocked time (a synchronous ``save`` or ``load``).

        Returns:
            An :class:`OperationTimer`; call its :meth:`~OperationTimer.add` with byte
            counts before the block ends.

        Raises:
            InvalidNameError: If ``op`` is not a known operation.
        """
        if op not in _OPS:
            raise InvalidNameError(
                f"unknown metrics operation {op!r}; use one of {', '.join(OPS)}"
            )
        return OperationTimer(self, op, run=run, tier=tier, step=step, blocking=blocking)

    # ------------------------------------------------------------------ reading
    def prefetch_outcome(self, *, hit: bool, run: str | None = None) -> None:
        """Count a load of a prefetched checkpoint (hit) or one that fetched on demand (miss).

        Bytes moved ahead of need are the ``prefetch`` operation's transferred bytes
        (:meth:`observe`); see ``ops/reading/prefetch.py``.
        """
        outcome = "hit" if hit else "miss"
        with self._lock:
            self._prefetch[outcome] += 1
        if self.prom is not None:
            self.prom.record_prefetch(outcome)
        logger.debug("prefetch %s (run=%s)", outcome, run)

    def prefetch_counts(self) -> dict[str, int]:
        """``{"hit": n, "miss": m}`` over this process's loads."""
        with self._lock:
            return dict(self._prefetch)

    def totals(self) -> dict[str, OpTotals]:
        """A copy of the running totals per operation."""
        with self._lock:
            return {
                op: OpTotals(**{**t.__dict__, "errors": dict(t.errors)})
                for op, t in self._totals.items()
            }

    def exposition(self) -> bytes:
        """The Prometheus text exposition of every series (what ``/metrics`` serves).

        Raises:
            ConfigError: If Prometheus export is disabled or unavailable.
        """
        from prometheus_client import generate_latest

        return bytes(generate_latest(self._registry()))

    def _registry(self) -> Any:
        if self.prom is None:
            raise ConfigError(
                "Prometheus export is not available: pip install 'ckptstore[metrics]' "
                "(prometheus_client) and create Metrics() without prometheus=False"
            )
        return self.prom.registry

    def serve_metrics(self, port: int, addr: str = "127.0.0.1") -> MetricsServer:
        """Serve ``/metrics`` over HTTP in a daemon thread.

        Args:
            port: TCP port; 0 picks a free one (read it from the result).
            addr: Address to bind. The default keeps it on this machine; pass ``0.0.0.0``
                deliberately to let a Prometheus server elsewhere scrape it.

        Returns:
            The running :class:`MetricsServer`.

        Raises:
            ConfigError: If Prometheus export is unavailable.
            StorageError: If the port cannot be bound.
        """
        handle = serve_registry(self._registry(), port, addr)
        self._servers.append(handle)
        return handle

    def stop_server(self, server: MetricsServer) -> None:
        """Stop one endpoint started by :meth:`serve_metrics` and release its port (idempotent).

        Args:
            server: The handle :meth:`serve_metrics` returned.
        """
        if server in self._servers:
            self._servers.remove(server)
            server.close()

    def write_textfile(self, path: str | os.PathLike[str]) -> None:
        """Write the exposition for node_exporter's textfile collector (atomic rename).

        Args:
            path: Target file, conventionally ``<collector dir>/ckptstore.prom``.

        Raises:
            ConfigError: If Prometheus export is unavailable.
            StorageError: If the file cannot be written.
        """
        write_registry_textfile(self._registry(), path)

    def close(self) -> None:
        """Stop metrics servers and flush/close TensorBoard (idempotent)."""
        servers, self._servers = self._servers, []
        for server in servers:
            server.close()
        sink, self._tensorboard = self._tensorboard, None
        if sink is not None:
            sink.close()
