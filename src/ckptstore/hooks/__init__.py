"""Training-loop side: CheckpointManager, LossMonitor and save policies.

Only this package's own names are exported here. What the manager works with that belongs to
the store's operations has its one home there: the async saver and ``SaveHandle``
(:mod:`ckptstore.ops.writing.async_save`), the memory tier
(:mod:`ckptstore.ops.writing.memory`), progressive restore
(:mod:`ckptstore.ops.reading.progressive`) and the metric-history recorder
(:mod:`ckptstore.ops.upkeep.history`); the package root (:mod:`ckptstore`) lists what a
training script imports. Nothing here imports Prefect: archive flows are started through
``store.trigger``.
"""

from __future__ import annotations

from ckptstore.hooks.loss_monitor import Anomaly, LossMonitor, spike_reason
from ckptstore.hooks.manager import CheckpointManager, PruneFn, StateFn
from ckptstore.hooks.policies import AnyOf, EveryNSeconds, EveryNSteps, OnDemand, SavePolicy

__all__ = [
    "Anomaly",
    "AnyOf",
    "CheckpointManager",
    "EveryNSeconds",
    "EveryNSteps",
    "LossMonitor",
    "OnDemand",
    "PruneFn",
    "SavePolicy",
    "StateFn",
    "spike_reason",
]
