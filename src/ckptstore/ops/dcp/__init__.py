"""Distributed checkpoints through ``torch.distributed.checkpoint`` (DCP).

Many ranks save one catalogued checkpoint in parallel, and it loads back on any number of
ranks with any placement, through the DCP API users already run::

    writer = store.dcp_writer("run-a", step=100)          # on every rank
    dcp.save(state, storage_writer=writer)                 # DTensor / FSDP2 / ShardedTensor
    dcp.load(state, storage_reader=store.dcp_reader("run-a@latest"))   # any world size

or the store's own calls: ``store.save(..., distributed=True)`` /
``store.load(ref, into=state)``. A plain ``store.load(ref)`` (no process group needed)
returns full tensors.

The layout on disk is :mod:`ckptstore.format.dcp`. Here, the torch side:

* :mod:`~ckptstore.ops.dcp.writer`: :class:`ZarrStorageWriter` (how a save runs);
* :mod:`~ckptstore.ops.dcp.reader`: :class:`ZarrStorageReader`, :class:`SafeLoadPlanner`;
* :mod:`~ckptstore.ops.dcp.distributed`: the store's entry points (save_distributed,
  load_dcp) and the mapping of DCP's failures onto our errors;
* :mod:`~ckptstore.ops.dcp.stage`: bounded staging buffers for ``dcp.async_save``;
* :mod:`~ckptstore.ops.dcp.parts`: what ranks and the coordinator of a save across hosts
  tell each other (the rest of such checkpoints: :mod:`ckptstore.ops.tiering.parts`);
* :mod:`~ckptstore.ops.dcp.peers`: keeping each host's part on a neighbour too
  (``replicas = 2``).

Non-tensor items: DCP's planner hands us ``torch.save`` bytes; we store them as they are
(never pickling anything ourselves). On load they go back to DCP's planner, which applies
DCP's own rules (its default planner uses ``torch.load(weights_only=False)``);
``store.load`` uses :class:`SafeLoadPlanner` (``weights_only=True``) instead, and the
full load without a process group does the same.
"""

from __future__ import annotations

from ckptstore.format.dcp.layout import is_dcp_manifest
from ckptstore.format.dcp.read import load_full
from ckptstore.format.dcp.verify import verify_dcp
from ckptstore.ops.dcp.distributed import load_dcp, load_parted, needs_dcp, save_distributed
from ckptstore.ops.dcp.reader import SafeLoadPlanner, ZarrStorageReader, dcp_reader
from ckptstore.ops.dcp.writer import PACK_BELOW, ZarrStorageWriter, dcp_writer

__all__ = [
    "PACK_BELOW",
    "SafeLoadPlanner",
    "ZarrStorageReader",
    "ZarrStorageWriter",
    "dcp_reader",
    "dcp_writer",
    "is_dcp_manifest",
    "load_dcp",
    "load_full",
    "load_parted",
    "needs_dcp",
    "save_distributed",
    "verify_dcp",
]
