"""Which store a catalog belongs to: its store id and the hot tier it was opened with.

A catalog and a hot tier make one store only together: the catalog lists checkpoints whose
files are in that hot tier. Both record the same store id (the hot tier in its
``.ckptstore.json``, see :mod:`ckptstore.storage.marker`; the catalog in ``store_meta``), so
opening a catalog with another store's hot tier is refused instead of silently listing
checkpoints that are not there (see :meth:`ckptstore.core.StoreCore.open`).

Rows are only ever inserted if absent (``ON CONFLICT DO NOTHING``), then read back: two
processes opening a new store at once agree on the first id written.
"""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import exists, select, update

from ckptstore.catalog.checks import check_checkpoint_id
from ckptstore.catalog.core import CatalogCore
from ckptstore.catalog.models import RunRow, StoreMetaRow, utcnow
from ckptstore.errors import InvalidNameError

__all__ = ["StoreIdentity", "StoreIdentityMixin"]

_STORE_ID = "store_id"
_HOT_TIER = "hot_tier"


@dataclass(frozen=True)
class StoreIdentity:
    """The store a catalog belongs to.

    Attributes:
        store_id: The store's id (a uuid), also in the hot tier's marker.
        hot_tier: The hot tier (a local path) the store was last opened with.
    """

    store_id: str
    hot_tier: str


def _check_hot(hot_tier: object) -> str:
    if not isinstance(hot_tier, str) or not hot_tier or len(hot_tier) > 4096:
        raise InvalidNameError(f"hot tier must be a non-empty path, got {hot_tier!r}")
    return hot_tier


class StoreIdentityMixin(CatalogCore):
    """Store identity methods of :class:`~ckptstore.catalog.Catalog`."""

    def store_identity(self) -> StoreIdentity | None:
        """The store this catalog belongs to, or None before the first open records it."""
        with self._read() as s:
            rows = dict(s.execute(select(StoreMetaRow.key, StoreMetaRow.value)).tuples().all())
        if _STORE_ID not in rows:
            return None
        return StoreIdentity(rows[_STORE_ID], rows.get(_HOT_TIER, ""))

    def claim_store_identity(self, store_id: str, hot_tier: str) -> StoreIdentity:
        """Record ``store_id`` and ``hot_tier`` unless an identity is recorded already.

        Args:
            store_id: The id to record (a uuid).
            hot_tier: The hot tier's path.

        Returns:
            The identity now recorded: this one, or the one another process recorded first.
        """
        sid = check_checkpoint_id(store_id)
        hot = _check_hot(hot_tier)
        now = utcnow()
        with self._write() as s:
            for key, value in ((_STORE_ID, sid), (_HOT_TIER, hot)):
                s.execute(self._insert(StoreMetaRow).values(key=key, value=value, updated_at=now)
                          .on_conflict_do_nothing(index_elements=["key"]))
        found = self.store_identity()
        assert found is not None
        return found

    def set_store_hot_tier(self, hot_tier: str) -> None:
        """Record that the store's hot tier is now at ``hot_tier`` (it was moved)."""
        hot = _check_hot(hot_tier)
        with self._write() as s:
            s.execute(update(StoreMetaRow).where(StoreMetaRow.key == _HOT_TIER)
                      .values(value=hot, updated_at=utcnow()))
            self._add_event(s, "store_moved", detail={"hot_tier": hot})

    def is_empty(self) -> bool:
        """Whether the catalog holds no run at all (a new catalog)."""
        with self._read() as s:
            return not s.scalar(select(exists().where(RunRow.id.is_not(None))))
