"""Leases: a flow's time-limited claim on a checkpoint, so two flows never move or delete it
at the same time.

Acquiring is ONE statement on both backends::

    INSERT INTO leases ... ON CONFLICT (checkpoint_id, purpose)
    DO UPDATE SET owner = excluded.owner, expires_at = excluded.expires_at
    WHERE leases.owner = :owner OR leases.expires_at <= :now
    RETURNING owner

A row comes back exactly when the lease is now ours: it was free, already ours (renewed), or
expired (taken over). The database arbitrates, so there is no read-then-write window.
Expiry compares the clocks of the processes involved; keep hosts NTP-synchronised and TTLs
well above the expected skew.
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import timedelta
from typing import Any, cast

from sqlalchemy import CursorResult, delete, or_, select

from ckptstore.catalog.checks import check_checkpoint_id, check_positive
from ckptstore.catalog.core import CatalogCore, checkpoint_id_batches
from ckptstore.catalog.models import CheckpointRow, LeaseRow, utcnow
from ckptstore.errors import CheckpointNotFoundError, InvalidNameError
from ckptstore.records import Lease

__all__ = ["LeasesMixin"]


def _check_text(value: object, what: str, max_len: int) -> str:
    if not isinstance(value, str) or not value or len(value) > max_len:
        raise InvalidNameError(f"{what} must be a non-empty string of at most {max_len} chars")
    return value


class LeasesMixin(CatalogCore):
    """Lease methods of :class:`~ckptstore.catalog.Catalog`."""

    def acquire_lease(self, ckpt_id: str, purpose: str, owner: str, ttl_s: float) -> bool:
        """Try to take (or renew) the lease on a checkpoint for one purpose.

        Args:
            ckpt_id: The checkpoint id.
            purpose: What the lease is for, e.g. ``"archive"`` or ``"prune"``.
            owner: Who takes it (a flow run id); the same owner renews.
            ttl_s: Seconds until the lease expires unless renewed.

        Returns:
            True if the lease is now held by ``owner`` (newly, renewed, or taken over from an
            expired holder); False while another owner holds an unexpired lease.

        Raises:
            CheckpointNotFoundError: If no checkpoint has that id.
        """
        cid = check_checkpoint_id(ckpt_id)
        purpose = _check_text(purpose, "lease purpose", 64)
        owner = _check_text(owner, "lease owner", 300)
        ttl = check_positive(ttl_s, "ttl_s")
        now = utcnow()
        with self._write() as s:
            if s.scalar(select(CheckpointRow.id).where(CheckpointRow.id == cid)) is None:
                raise CheckpointNotFoundError(f"no checkpoint has id {cid}")
            stmt = self._insert(LeaseRow).values(
                checkpoint_id=cid,
                purpose=purpose,
                owner=owner,
                expires_at=now + timedelta(seconds=ttl),
            )
            stmt = stmt.on_conflict_do_update(
                index_elements=["checkpoint_id", "purpose"],
                set_={"owner": stmt.excluded.owner, "expires_at": stmt.excluded.expires_at},
                where=or_(LeaseRow.owner == owner, LeaseRow.expires_at <= now),
            )
            return s.execute(stmt.returning(LeaseRow.owner)).first() is not None

    def release_lease(self, ckpt_id: str, purpose: str, owner: str) -> bool:
        """Give a lease back. Only its owner can; releasing someone else's is a no-op.

        Returns:
            True if ``owner`` held the lease and it is now released.
        """
        cid = check_checkpoint_id(ckpt_id)
        with self._write() as s:
            result = cast(
                "CursorResult[Any]",
                s.execute(
                    delete(LeaseRow).where(
                        LeaseRow.checkpoint_id == cid,
                        LeaseRow.purpose == purpose,
                        LeaseRow.owner == owner,
                    )
                ),
            )
            return bool(result.rowcount)

    def leases(
        self,
        *,
        checkpoint_ids: Iterable[str] | None = None,
        purpose: str | None = None,
        include_expired: bool = False,
    ) -> list[Lease]:
        """The leases held now, optionally only on some checkpoints or for one purpose.

        Args:
            checkpoint_ids: Only leases on these checkpoints (any number; an empty collection
                gives an empty list). None: on every checkpoint.
            purpose: Only leases for this purpose (``retention``, ``archive:warm``...).
            include_expired: Also return leases past their expiry that nobody has taken over
                or released yet.

        Returns:
            The leases, ordered by checkpoint id, then purpose.

        Raises:
            InvalidNameError: If an id is not a uuid or ``purpose`` is not a valid purpose.
        """
        L = LeaseRow
        stmt = select(L.checkpoint_id, L.purpose, L.owner, L.expires_at)
        if purpose is not None:
            stmt = stmt.where(L.purpose == _check_text(purpose, "lease purpose", 64))
        if not include_expired:
            stmt = stmt.where(L.expires_at > utcnow())
        if checkpoint_ids is None:
            statements = [stmt]
        else:
            statements = [
                stmt.where(L.checkpoint_id.in_(batch))
                for batch in checkpoint_id_batches(checkpoint_ids)
            ]
        with self._read() as s:
            found = [
                Lease(checkpoint_id=cid, purpose=p, owner=owner, expires_at=expires)
                for statement in statements
                for cid, p, owner, expires in s.execute(statement)
            ]
        # Sorted here, not in SQL: PostgreSQL's collation may order text unlike SQLite's, and
        # batches are queried one after another.
        found.sort(key=lambda lease: (lease.checkpoint_id, lease.purpose))
        return found

    def lease_holder(self, ckpt_id: str, purpose: str) -> str | None:
        """Owner of the unexpired lease on the checkpoint for ``purpose``, or None."""
        cid = check_checkpoint_id(ckpt_id)
        with self._read() as s:
            return s.scalar(
                select(LeaseRow.owner).where(
                    LeaseRow.checkpoint_id == cid,
                    LeaseRow.purpose == purpose,
                    LeaseRow.expires_at > utcnow(),
                )
            )
