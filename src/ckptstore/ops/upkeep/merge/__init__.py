"""Merging checkpoints: weighted averages (model soups, federated averaging) with lineage.

A merge streams: every chunk of the output is computed from the same chunks of the inputs
while it is written, so memory holds one chunk per input per writer thread, never a state
(:mod:`~ckptstore.ops.upkeep.merge.source`). The rules (methods, weights, accumulation, what
is averaged and what is copied) are pure (:mod:`~ckptstore.ops.upkeep.merge.spec`); the
operation resolves, checks, saves and records the lineage
(:mod:`~ckptstore.ops.upkeep.merge.run`).
"""

from __future__ import annotations

from ckptstore.ops.upkeep.merge.run import merge_checkpoints
from ckptstore.ops.upkeep.merge.spec import ACCUMULATE, METHODS, MergeSpec, merge_spec

__all__ = ["ACCUMULATE", "METHODS", "MergeSpec", "merge_checkpoints", "merge_spec"]
