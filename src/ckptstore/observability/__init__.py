"""Observability: operation metrics (Prometheus, TensorBoard, JSON logs) and tier health.

* :class:`Metrics` records each save/load/archive/prune/restore/convert/verify; the store
  owns one as ``store.metrics``. Prometheus export needs ``prometheus_client``
  (``ckptstore[metrics]``), TensorBoard needs ``tensorboard``; both are optional.
* :func:`configure_logging` turns ckptstore's logs into JSON lines (``CKPT_LOG_JSON=1``).
* :func:`tier_status` / :func:`probe_tier` check the configured tiers (``ckpt tiers``).

Importing this package imports neither prometheus_client, tensorboard nor prefect.
"""

from __future__ import annotations

from ckptstore.observability.jsonlog import JsonFormatter, configure_logging
from ckptstore.observability.memory import (
    cuda_fragmentation,
    fragmentation_sources,
    malloc_fragmentation,
)
from ckptstore.observability.metrics import OPS, Metrics, OpTotals, dedup_bytes
from ckptstore.observability.serving import MetricsServer
from ckptstore.observability.timing import OperationTimer, off_training_path

__all__ = [
    "OPS",
    "JsonFormatter",
    "Metrics",
    "MetricsServer",
    "OpTotals",
    "OperationTimer",
    "configure_logging",
    "cuda_fragmentation",
    "dedup_bytes",
    "fragmentation_sources",
    "malloc_fragmentation",
    "off_training_path",
]
