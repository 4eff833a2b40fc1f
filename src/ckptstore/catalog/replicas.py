"""Replicas: where the copies of a checkpoint live, per tier, and in what state."""

from __future__ import annotations

from types import EllipsisType
from typing import Any

from sqlalchemy import select

from ckptstore.catalog.checks import check_checkpoint_id, check_replica_state, check_tier
from ckptstore.catalog.core import CatalogCore
from ckptstore.catalog.models import CheckpointRow, ReplicaRow, utcnow
from ckptstore.catalog.resolve import resolve_any
from ckptstore.errors import CheckpointNotFoundError, InvalidNameError
from ckptstore.numeric import MAX_INT64
from ckptstore.records import Replica, ReplicaState

__all__ = ["ReplicasMixin"]


def _check_digest(value: object) -> str:
    if not isinstance(value, str) or not 0 < len(value) <= 128:
        raise InvalidNameError(
            f"replica manifest_digest must be a non-empty string of at most 128 characters, "
            f"got {value!r}"
        )
    return value


class ReplicasMixin(CatalogCore):
    """Replica methods of :class:`~ckptstore.catalog.Catalog`."""

    def replicas(self, ckpt_id: str) -> list[Replica]:
        """The checkpoint's replicas (any state), fastest tier first.

        Raises:
            CheckpointNotFoundError: If no checkpoint has that id.
        """
        cid = check_checkpoint_id(ckpt_id)
        with self._read() as s:
            return list(resolve_any(s, cid).replicas)

    def set_replica(
        self,
        ckpt_id: str,
        tier: str,
        *,
        uri: str | None = None,
        state: ReplicaState | str,
        bytes: int | None = None,
        verified: bool = False,
        manifest_digest: str | EllipsisType | None = ...,
    ) -> Replica:
        """Create or update the checkpoint's replica on ``tier`` (one atomic upsert).

        Fields passed as None keep their stored value (or default to ``""`` / 0 on creation).

        Args:
            ckpt_id: The checkpoint id (any state: flows update replicas of DELETING rows).
            tier: Tier name.
            uri: Where the copy lives.
            state: New replica state.
            bytes: Size of the copy.
            verified: Set ``verified_at`` to now (the copy was just checked).
            manifest_digest: Digest of the manifest the copy holds when it is not the
                checkpoint's own (a re-encoded copy); None: the checkpoint's own manifest;
                ``...`` (the default): keep the stored value (None on creation).

        Returns:
            The replica as stored.

        Raises:
            CheckpointNotFoundError: If no checkpoint has that id.
            InvalidNameError: If the tier, state or size is invalid.
        """
        cid = check_checkpoint_id(ckpt_id)
        tier = check_tier(tier)
        new_state = check_replica_state(state)
        if bytes is not None and (
            isinstance(bytes, bool) or not isinstance(bytes, int) or not 0 <= bytes <= MAX_INT64
        ):
            raise InvalidNameError(
                f"replica bytes must be an int between 0 and {MAX_INT64}, got {bytes!r}"[:200]
            )
        if uri is not None and not isinstance(uri, str):
            raise InvalidNameError(f"replica uri must be a string, got {type(uri).__name__}")
        digest = (
            None if manifest_digest is ... or manifest_digest is None
            else _check_digest(manifest_digest)
        )
        now = utcnow()
        with self._write() as s:
            if s.scalar(select(CheckpointRow.id).where(CheckpointRow.id == cid)) is None:
                raise CheckpointNotFoundError(f"no checkpoint has id {cid}")
            values: dict[str, Any] = {
                "checkpoint_id": cid,
                "tier": tier,
                "uri": uri or "",
                "state": new_state,
                "bytes": bytes or 0,
                "verified_at": now if verified else None,
                "updated_at": now,
                "manifest_digest": digest,
            }
            stmt = self._insert(ReplicaRow).values(**values)
            changes: dict[str, Any] = {
                "state": stmt.excluded.state,
                "updated_at": stmt.excluded.updated_at,
            }
            if uri is not None:
                changes["uri"] = stmt.excluded.uri
            if bytes is not None:
                changes["bytes"] = stmt.excluded.bytes
            if verified:
                changes["verified_at"] = stmt.excluded.verified_at
            if manifest_digest is not ...:
                changes["manifest_digest"] = stmt.excluded.manifest_digest
            s.execute(
                stmt.on_conflict_do_update(index_elements=["checkpoint_id", "tier"], set_=changes)
            )
            row = s.execute(
                select(
                    ReplicaRow.tier,
                    ReplicaRow.uri,
                    ReplicaRow.state,
                    ReplicaRow.bytes,
                    ReplicaRow.verified_at,
                    ReplicaRow.manifest_digest,
                ).where(ReplicaRow.checkpoint_id == cid, ReplicaRow.tier == tier)
            ).one()
            return Replica(
                tier=row.tier,
                uri=row.uri,
                state=row.state,
                bytes=row.bytes,
                verified_at=row.verified_at,
                manifest_digest=row.manifest_digest,
            )
