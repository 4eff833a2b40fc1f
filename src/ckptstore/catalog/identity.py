"""Which store a catalog belongs to: its store id and the hot tier it was opened with.

A catalog and a hot tier make one store only together: the catalog lists checkpoints whose
files are in that hot tier. Both record the same store id (the hot tier in its
``.ckptstore.json``, see :mod:`ckptstore.storage.marker`; the catalog in ``store_meta``), so
opening a catalog with another store's hot tier is refused instead of silently listing
checkpoints that are not there (see :meth:`ckptstore.core.StoreCore.open`).

Each host has a hot tier of its own (node-local disks, docs/MULTINODE.md), so the hot tier is
recorded per host (``hot_tier:<host>``): a new node opening its own empty disk is not "another
store's catalog" just because a neighbour's disk holds the marker. The plain ``hot_tier`` key
is the hot tier recorded last, on any host; catalogs from before per-host records have only
that one, and it then stands for every host.

Rows are only ever inserted if absent (``ON CONFLICT DO NOTHING``), then read back: two
processes opening a new store at once agree on the first id written.
"""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import exists, select

from ckptstore.catalog.checks import check_checkpoint_id
from ckptstore.catalog.core import CatalogCore
from ckptstore.catalog.models import RunRow, StoreMetaRow, utcnow
from ckptstore.errors import InvalidNameError

__all__ = ["StoreIdentity", "StoreIdentityMixin"]

_STORE_ID = "store_id"
_HOT_TIER = "hot_tier"
_HOST_PREFIX = "hot_tier:"


@dataclass(frozen=True)
class StoreIdentity:
    """The store a catalog belongs to.

    Attributes:
        store_id: The store's id (a uuid), also in the hot tier's marker.
        hot_tier: The hot tier (a local path) the store was last opened with on the host
            asked about; ``""`` when that host never opened it.
    """

    store_id: str
    hot_tier: str


def _check_hot(hot_tier: object) -> str:
    if not isinstance(hot_tier, str) or not hot_tier or len(hot_tier) > 4096:
        raise InvalidNameError(f"hot tier must be a non-empty path, got {hot_tier!r}")
    return hot_tier


class StoreIdentityMixin(CatalogCore):
    """Store identity methods of :class:`~ckptstore.catalog.Catalog`."""

    def store_identity(self, host: str = "") -> StoreIdentity | None:
        """The store this catalog belongs to, or None before the first open records it.

        Args:
            host: The host whose hot tier to report (``""``: the one recorded last).
        """
        with self._read() as s:
            rows = dict(s.execute(select(StoreMetaRow.key, StoreMetaRow.value)).tuples().all())
        if _STORE_ID not in rows:
            return None
        hot = rows.get(_HOST_PREFIX + host) if host else None
        if hot is None and (not host or not any(k.startswith(_HOST_PREFIX) for k in rows)):
            hot = rows.get(_HOT_TIER)  # before per-host records: the one hot tier of all
        return StoreIdentity(rows[_STORE_ID], hot or "")

    def claim_store_identity(self, store_id: str, hot_tier: str,
                             host: str = "") -> StoreIdentity:
        """Record ``store_id`` and ``hot_tier`` unless an identity is recorded already.

        Args:
            store_id: The id to record (a uuid).
            hot_tier: The hot tier's path.
            host: The host the hot tier is on (``""``: none recorded per host).

        Returns:
            The identity now recorded (with ``host``'s hot tier): this one, or the one
            another process recorded first.
        """
        sid = check_checkpoint_id(store_id)
        hot = _check_hot(hot_tier)
        now = utcnow()
        values = [(_STORE_ID, sid), (_HOT_TIER, hot)]
        if host:
            values.append((_HOST_PREFIX + host, hot))
        with self._write() as s:
            for key, value in values:
                s.execute(self._insert(StoreMetaRow).values(key=key, value=value, updated_at=now)
                          .on_conflict_do_nothing(index_elements=["key"]))
        found = self.store_identity(host)
        assert found is not None
        return found

    def set_store_hot_tier(self, hot_tier: str, host: str = "") -> None:
        """Record that ``host``'s hot tier is now at ``hot_tier`` (new, or moved).

        Args:
            hot_tier: The hot tier's path.
            host: The host it is on (``""``: the store-wide record only).
        """
        hot = _check_hot(hot_tier)
        keys = [_HOT_TIER, _HOST_PREFIX + host] if host else [_HOT_TIER]
        now = utcnow()
        with self._write() as s:
            for key in keys:
                s.execute(self._insert(StoreMetaRow).values(key=key, value=hot, updated_at=now)
                          .on_conflict_do_update(index_elements=["key"],
                                                 set_={"value": hot, "updated_at": now}))
            self._add_event(s, "store_moved", detail={"hot_tier": hot, "host": host or None})

    def is_empty(self) -> bool:
        """Whether the catalog holds no run at all (a new catalog)."""
        with self._read() as s:
            return not s.scalar(select(exists().where(RunRow.id.is_not(None))))
