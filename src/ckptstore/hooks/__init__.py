"""Training integration: async saves, save policies, CheckpointManager and LossMonitor.

Nothing here imports Prefect: archive flows are triggered through the store's ``trigger``
hook when it has one.
"""

from __future__ import annotations

from ckptstore.hooks.async_save import (
    AsyncSaver,
    SaveHandle,
    StagingPool,
    close_saver,
    save_async,
    saver_for,
    wait_async,
)
from ckptstore.hooks.loss_monitor import Anomaly, LossMonitor, spike_reason
from ckptstore.hooks.manager import CheckpointManager, PruneFn, StateFn
from ckptstore.hooks.memory_tier import MemoryTier, attach_memory_tier, memory_tier_for
from ckptstore.hooks.policies import AnyOf, EveryNSeconds, EveryNSteps, OnDemand, SavePolicy
from ckptstore.hooks.progressive import ProgressiveLoad, load_progressive

__all__ = [
    "Anomaly",
    "AnyOf",
    "AsyncSaver",
    "CheckpointManager",
    "EveryNSeconds",
    "EveryNSteps",
    "LossMonitor",
    "MemoryTier",
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
