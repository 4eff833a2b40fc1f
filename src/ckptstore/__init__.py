"""ckptstore: a managed checkpoint store for PyTorch training.

Save training state as chunked, checksummed Zarr v3 checkpoints, find them through a SQL
catalog (versions, lineage, metrics, tiers) and let background flows archive, prune, convert,
restore and verify them.

Example:
    >>> from ckptstore import CheckpointStore                       # doctest: +SKIP
    >>> store = CheckpointStore.open("./ckpt")                      # doctest: +SKIP
    >>> store.save("run-a", step=100, state=model.state_dict())     # doctest: +SKIP
    >>> state = store.load("run-a@latest")                          # doctest: +SKIP

Importing this package never imports Prefect: flows live in ``ckptstore.flows``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ckptstore.config import Settings, load_settings
from ckptstore.errors import (
    CheckpointNotFoundError,
    CkptError,
    ConfigError,
    ConflictError,
    IncompleteCheckpointError,
    IntegrityError,
    InvalidNameError,
    LeaseHeldError,
    MissingBaseError,
    StorageError,
    StoreNotFoundError,
    UnsafeObjectError,
)
from ckptstore.lazy import lazy_attributes
from ckptstore.records import (
    Checkpoint,
    CheckpointState,
    Event,
    Replica,
    ReplicaState,
    RunInfo,
    UsageRow,
)
from ckptstore.refs import Ref, parse_ref
from ckptstore.save_options import SaveOptions

if TYPE_CHECKING:
    from ckptstore.hooks import (
        AnyOf,
        CheckpointManager,
        EveryNSeconds,
        EveryNSteps,
        LossMonitor,
        OnDemand,
        SavePolicy,
    )
    from ckptstore.ops.reading.prefetch import PrefetchResult
    from ckptstore.ops.reading.progressive import ProgressiveLoad
    from ckptstore.ops.reading.sweep import CheckpointSweep
    from ckptstore.ops.tiering.gc import GcReport
    from ckptstore.ops.writing.async_save import SaveHandle
    from ckptstore.ops.writing.snapshot_peer import SnapshotReplicaServer
    from ckptstore.store import CheckpointStore

__version__ = "0.1.0"

# What users import, by the module that is each name's one home: the store, the training
# loop's manager and policies, and what the store's methods hand back.
_LAZY = {
    "CheckpointStore": "ckptstore.store",
    "CheckpointManager": "ckptstore.hooks",
    "LossMonitor": "ckptstore.hooks",
    "SavePolicy": "ckptstore.hooks",
    "AnyOf": "ckptstore.hooks",
    "EveryNSteps": "ckptstore.hooks",
    "EveryNSeconds": "ckptstore.hooks",
    "OnDemand": "ckptstore.hooks",
    "SaveHandle": "ckptstore.ops.writing.async_save",
    "GcReport": "ckptstore.ops.tiering.gc",
    "ProgressiveLoad": "ckptstore.ops.reading.progressive",
    "PrefetchResult": "ckptstore.ops.reading.prefetch",
    "CheckpointSweep": "ckptstore.ops.reading.sweep",
    "SnapshotReplicaServer": "ckptstore.ops.writing.snapshot_peer",
}


# The store pulls in zarr, SQLAlchemy and the format layer; loading it on first use keeps
# `import ckptstore.errors` (and the CLI's --help) cheap.
__getattr__ = lazy_attributes(__name__, _LAZY)

__all__ = [
    "AnyOf",
    "Checkpoint",
    "CheckpointManager",
    "CheckpointNotFoundError",
    "CheckpointState",
    "CheckpointStore",
    "CheckpointSweep",
    "CkptError",
    "ConfigError",
    "ConflictError",
    "Event",
    "EveryNSeconds",
    "EveryNSteps",
    "GcReport",
    "IncompleteCheckpointError",
    "IntegrityError",
    "InvalidNameError",
    "LeaseHeldError",
    "LossMonitor",
    "MissingBaseError",
    "OnDemand",
    "PrefetchResult",
    "ProgressiveLoad",
    "Ref",
    "Replica",
    "ReplicaState",
    "RunInfo",
    "SaveHandle",
    "SaveOptions",
    "SavePolicy",
    "Settings",
    "SnapshotReplicaServer",
    "StorageError",
    "StoreNotFoundError",
    "UnsafeObjectError",
    "UsageRow",
    "__version__",
    "load_settings",
    "parse_ref",
]
