"""The layout of checkpoints saved through ``torch.distributed.checkpoint`` (DCP).

Every rank writes its own shards as Zarr v3 arrays inside one checkpoint directory; the
coordinator writes the index (where every shard and non-tensor item lives), the group
documents, the manifest and the commit marker.

* :mod:`~ckptstore.format.dcp.layout`: names and geometry of the layout (the index records
  are :mod:`ckptstore.format.manifest.dcpindex`, re-exported there);
* :mod:`~ckptstore.format.dcp.plan`: which array every shard of a save goes to;
* :mod:`~ckptstore.format.dcp.write`: one rank's chunk files;
* :mod:`~ckptstore.format.dcp.commit`: the coordinator's index, manifest and marker;
* :mod:`~ckptstore.format.dcp.zarrdocs`: the ``zarr.json`` documents;
* :mod:`~ckptstore.format.dcp.boxes`, :mod:`~ckptstore.format.dcp.chunks`,
  :mod:`~ckptstore.format.dcp.requests`, :mod:`~ckptstore.format.dcp.read`,
  :mod:`~ckptstore.format.dcp.verify`: what DCP sees, verified chunk reads, their copies
  into tensors, full loads, and the index with the check of every file.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ckptstore.lazy import lazy_attributes

if TYPE_CHECKING:
    from ckptstore.format.dcp.layout import is_dcp_manifest
    from ckptstore.format.dcp.read import load_full
    from ckptstore.format.dcp.verify import index_of, verify_dcp

# Loaded on first use: the reader imports torch (ckptstore/lazy.py).
__getattr__ = lazy_attributes(__name__, {
    "is_dcp_manifest": "ckptstore.format.dcp.layout",
    "index_of": "ckptstore.format.dcp.verify",
    "load_full": "ckptstore.format.dcp.read",
    "verify_dcp": "ckptstore.format.dcp.verify",
})

__all__ = ["index_of", "is_dcp_manifest", "load_full", "verify_dcp"]
