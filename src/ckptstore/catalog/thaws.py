"""Thaws: restore requests for copies in an archival S3 storage class (GLACIER).

A load or prefetch of a checkpoint whose only copy is archival asks S3 to restore every
object of that copy (``ops/tiering/thaw.py``) and records it here, so that every process knows a
thaw is under way (and when it should be ready), a second load does not ask again, and
retention keeps the checkpoint's copies until the thaw is done.
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime

from sqlalchemy import select

from ckptstore.catalog.checks import check_checkpoint_id, check_tier
from ckptstore.catalog.core import CatalogCore, checkpoint_id_batches
from ckptstore.catalog.models import CheckpointRow, ThawRow, utcnow
from ckptstore.errors import CheckpointNotFoundError, InvalidNameError
from ckptstore.records import Thaw, ThawState

__all__ = ["ThawsMixin"]

_RETRIEVALS = frozenset({"Expedited", "Standard", "Bulk"})


def _record(row: ThawRow) -> Thaw:
    return Thaw(
        checkpoint_id=row.checkpoint_id,
        tier=row.tier,
        state=ThawState(row.state),
        retrieval=row.retrieval,
        objects=row.objects,
        requested_at=row.requested_at,
        expected_ready_at=row.expected_ready_at,
        updated_at=row.updated_at,
    )


class ThawsMixin(CatalogCore):
    """Thaw methods of :class:`~ckptstore.catalog.Catalog`."""

    def record_thaw(self, ckpt_id: str, tier: str, *, retrieval: str, objects: int,
                    expected_ready_at: datetime) -> Thaw:
        """Record (or renew) a PENDING thaw of the checkpoint's copy on ``tier``.

        Args:
            ckpt_id: The checkpoint.
            tier: The archival tier holding the copy.
            retrieval: The S3 retrieval tier asked for.
            objects: How many objects were asked to be restored.
            expected_ready_at: When they should be readable (UTC, timezone-aware).

        Raises:
            CheckpointNotFoundError: If no checkpoint has that id.
            InvalidNameError: For an unknown retrieval tier or a negative count.
        """
        cid = check_checkpoint_id(ckpt_id)
        tier = check_tier(tier)
        if retrieval not in _RETRIEVALS:
            raise InvalidNameError(
                f"retrieval tier {retrieval!r} is not one of {', '.join(sorted(_RETRIEVALS))}"
            )
        if isinstance(objects, bool) or not isinstance(objects, int) or objects < 0:
            raise InvalidNameError(f"objects must be a non-negative int, not {objects!r}")
        now = utcnow()
        with self._write() as s:
            if s.scalar(select(CheckpointRow.id).where(CheckpointRow.id == cid)) is None:
                raise CheckpointNotFoundError(f"no checkpoint has id {cid}")
            row = s.get(ThawRow, (cid, tier))
            if row is None:
                row = ThawRow(checkpoint_id=cid, tier=tier)
                s.add(row)
            row.state = ThawState.PENDING.value
            row.retrieval = retrieval
            row.objects = objects
            row.requested_at = now
            row.expected_ready_at = expected_ready_at
            row.updated_at = now
            s.flush()
            return _record(row)

    def finish_thaw(self, ckpt_id: str, tier: str) -> Thaw | None:
        """Mark the thaw of the copy on ``tier`` DONE (the copy is back on the hot tier, or,
        for a checkpoint saved across hosts, its parts are read in place from the thawed
        objects).

        Returns:
            The updated thaw, or None when none was recorded.
        """
        cid = check_checkpoint_id(ckpt_id)
        with self._write() as s:
            row = s.get(ThawRow, (cid, check_tier(tier)))
            if row is None:
                return None
            row.state = ThawState.DONE.value
            row.updated_at = utcnow()
            s.flush()
            return _record(row)

    def thaw_ready(self, ckpt_id: str, tier: str) -> Thaw | None:
        """Record that every object of a PENDING thaw is readable now (expected ready: now),
        so the next restore reads it at once instead of waiting for the expected time.

        Returns:
            The updated thaw, or None when no PENDING one was recorded.
        """
        cid = check_checkpoint_id(ckpt_id)
        with self._write() as s:
            row = s.get(ThawRow, (cid, check_tier(tier)))
            if row is None or row.state != ThawState.PENDING.value:
                return None
            row.expected_ready_at = row.updated_at = utcnow()
            s.flush()
            return _record(row)

    def get_thaw(self, ckpt_id: str, tier: str) -> Thaw | None:
        """The thaw recorded for the checkpoint's copy on ``tier``, if any."""
        cid = check_checkpoint_id(ckpt_id)
        with self._read() as s:
            row = s.get(ThawRow, (cid, check_tier(tier)))
            return None if row is None else _record(row)

    def thaws(self, *, checkpoint_ids: Iterable[str] | None = None,
              state: ThawState | None = None) -> list[Thaw]:
        """Recorded thaws, optionally of some checkpoints or in one state.

        Args:
            checkpoint_ids: Only these checkpoints (an empty collection gives ``[]``).
            state: Only thaws in this state (``ThawState.PENDING``: the ones retention must
                respect).

        Returns:
            The thaws, ordered by checkpoint id, then tier.
        """
        out: list[Thaw] = []
        if checkpoint_ids is None:
            batches: Iterable[list[str] | None] = [None]
        else:
            batches = checkpoint_id_batches(checkpoint_ids)
        with self._read() as s:
            for batch in batches:
                stmt = select(ThawRow)
                if batch is not None:
                    stmt = stmt.where(ThawRow.checkpoint_id.in_(batch))
                if state is not None:
                    stmt = stmt.where(ThawRow.state == ThawState(state).value)
                out.extend(_record(r) for r in s.scalars(stmt))
        return sorted(out, key=lambda t: (t.checkpoint_id, t.tier))
