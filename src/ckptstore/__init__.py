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
    UnsafeObjectError,
)
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

if TYPE_CHECKING:
    from ckptstore.hooks import CheckpointManager, LossMonitor, SaveHandle
    from ckptstore.store import CheckpointStore, GcReport

__version__ = "0.1.0"

_LAZY = {
    "CheckpointStore": "ckptstore.store",
    "GcReport": "ckptstore.store",
    "CheckpointManager": "ckptstore.hooks",
    "LossMonitor": "ckptstore.hooks",
    "SaveHandle": "ckptstore.hooks",
}


def __getattr__(name: str) -> object:
    # The store pulls in zarr, SQLAlchemy and the format layer; loading it on first use keeps
    # `import ckptstore.errors` (and the CLI's --help) cheap.
    module_name = _LAZY.get(name)
    if module_name is None:
        raise AttributeError(f"module 'ckptstore' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module_name), name)
    globals()[name] = value
    return value

__all__ = [
    "Checkpoint",
    "CheckpointManager",
    "CheckpointNotFoundError",
    "CheckpointState",
    "CheckpointStore",
    "CkptError",
    "ConfigError",
    "ConflictError",
    "Event",
    "GcReport",
    "IncompleteCheckpointError",
    "IntegrityError",
    "InvalidNameError",
    "LeaseHeldError",
    "LossMonitor",
    "MissingBaseError",
    "Ref",
    "Replica",
    "ReplicaState",
    "RunInfo",
    "SaveHandle",
    "Settings",
    "StorageError",
    "UnsafeObjectError",
    "UsageRow",
    "__version__",
    "load_settings",
    "parse_ref",
]
