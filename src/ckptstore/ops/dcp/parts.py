"""The save's side of checkpoints saved across hosts: what ranks and the coordinator tell
each other, and the sink that uploads a rank's files to a hot tier in object storage.

Everything else about such checkpoints (their manifest, reading their parts, this host's
parts on disk) is :mod:`ckptstore.ops.tiering.parts`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from ckptstore.errors import ConflictError
from ckptstore.format.dcp.plan import RankTask
from ckptstore.storage import Tier

__all__ = ["PartTask", "RankInfo", "TierSink"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RankInfo:
    """What a rank tells the coordinator about itself (in its local plan's ``storage_data``).

    Attributes:
        host: Its host (``CKPT_HOST`` or the hostname).
        remote: Its hot tier is object storage (``hot = "s3://..."``).
    """

    host: str
    remote: bool


@dataclass(frozen=True)
class PartTask:
    """The coordinator's answer to one rank (in its final plan's ``storage_data``).

    Attributes:
        task: What to write (the format's :class:`~ckptstore.format.dcp.plan.RankTask`).
        parted: The save is parted: the rank writes to its own host's hot tier.
        leader: This rank is its host's lowest rank: it gives the host's part its manifest
            and commit marker, and sends the part to a peer (``replicas = 2``).
        remote: The hot tier is object storage: the rank uploads its files.
        hosts: The host of every rank, in rank order.
    """

    task: RankTask
    parted: bool
    leader: bool
    remote: bool
    hosts: tuple[str, ...] = field(default=())


class TierSink:
    """Puts a rank's files straight into a tier (a hot tier in object storage).

    Args:
        tier: The tier.
        run: The checkpoint's run.
        ckpt_id: Its id.
    """

    def __init__(self, tier: Tier, run: str, ckpt_id: str) -> None:
        self.tier = tier
        self.run = run
        self.ckpt_id = ckpt_id

    def put(self, rel: str, data: bytes) -> None:
        """Create ``rel`` of the checkpoint on the tier (write-once).

        Raises:
            ConflictError: If the object exists with other bytes.
            StorageError: If the tier fails.
        """
        key = self.tier.key_for(self.run, self.ckpt_id, rel)
        try:
            self.tier.put_bytes(key, data)
        except ConflictError:
            # A request S3 applied and then answered 503 was retried: the object is there.
            if self.tier.get_bytes(key) != data:
                raise
