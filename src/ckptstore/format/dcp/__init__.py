"""The layout of checkpoints saved through ``torch.distributed.checkpoint`` (DCP).

Every rank writes its own shards as Zarr v3 arrays inside one checkpoint directory; the
coordinator writes the index (where every shard and non-tensor item lives), the group
documents, the manifest and the commit marker. See docs/FORMAT.md.
"""

from __future__ import annotations

from ckptstore.format.dcp.layout import is_dcp_manifest
from ckptstore.format.dcp.read import index_of, load_full, verify_dcp

__all__ = ["index_of", "is_dcp_manifest", "load_full", "verify_dcp"]
