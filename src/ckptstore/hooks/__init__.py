"""Training-loop side: CheckpointManager, LossMonitor and save policies.

The async saver, the memory tier, progressive restore and the metric-history recorder are
operations of the store (:mod:`ckptstore.ops`); they are re-exported here because a training
script reaches for them together with the manager. Nothing here imports Prefect: archive
flows are started through ``store.trigger``.
"""

from __future__ import annotations

from ckptstore.hooks.loss_monitor import Anomaly, LossMonitor, spike_reason
from ckptstore.hooks.manager import CheckpointManager, PruneFn, StateFn
from ckptstore.hooks.policies import AnyOf, EveryNSeconds, EveryNSteps, OnDemand, SavePolicy
from ckptstore.ops.reading.progressive import ProgressiveLoad, load_progressive
from ckptstore.ops.upkeep.history import MetricHistory
from ckptstore.ops.writing.async_save import (
    AsyncSaver,
    SaveHandle,
    close_saver,
    save_async,
    saver_for,
    wait_async,
)
from ckptstore.ops.writing.memory import MemoryTier, attach_memory_tier, memory_tier_for
from ckptstore.ops.writing.staging import StagingPool

__all__ = [
    "Anomaly",
    "AnyOf",
    "AsyncSaver",
    "CheckpointManager",
    "EveryNSeconds",
    "EveryNSteps",
    "LossMonitor",
    "MemoryTier",
    "MetricHistory",
    "OnDemand",
    "ProgressiveLoad",
    "PruneFn",
    "SaveHandle",
    "SavePolicy",
    "StagingPool",
    "StateFn",
    "attach_memory_tier",
    "close_saver",
    "load_progressive",
    "memory_tier_for",
    "save_async",
    "saver_for",
    "spike_reason",
    "wait_async",
]
