"""``torch.distributed.checkpoint`` (DCP) adapter: the public names for FSDP/DTensor users.

The storage writer and reader are operations of the store (:mod:`ckptstore.ops.dcp`); this
module is where a training script imports them from, next to the Lightning and Hugging Face
adapters.

Example:
    >>> writer = store.dcp_writer("run-a", step=100)        # doctest: +SKIP
    >>> dcp.save(state, storage_writer=writer)               # doctest: +SKIP
"""

from __future__ import annotations

from ckptstore.ops.dcp import (
    SafeLoadPlanner,
    ZarrStorageReader,
    ZarrStorageWriter,
    dcp_reader,
    dcp_writer,
    load_dcp,
    needs_dcp,
    save_distributed,
)

__all__ = [
    "SafeLoadPlanner",
    "ZarrStorageReader",
    "ZarrStorageWriter",
    "dcp_reader",
    "dcp_writer",
    "load_dcp",
    "needs_dcp",
    "save_distributed",
]
