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
  :mod:`~ckptstore.format.dcp.read`: what DCP sees, verified chunk reads, full loads and
  verification.
"""

from __future__ import annotations

from ckptstore.format.dcp.layout import is_dcp_manifest
from ckptstore.format.dcp.read import index_of, load_full, verify_dcp

__all__ = ["index_of", "is_dcp_manifest", "load_full", "verify_dcp"]
