"""Remotes (other stores, by config file) and the catalog side of checkpoints arriving from one.

A remote is a name for another store's config file (``ckpt remote add NAME --config FILE``);
the catalog keeps the list so every host sharing a PostgreSQL catalog sees the same remotes.
The push itself lives in :mod:`ckptstore.ops.sharing.push`.

A checkpoint arriving from another store keeps its id (signatures and lineage name ids), so a
failed arrival that gc or the pusher marked FAILED would block the id for good:
:meth:`RemotesMixin.forget_failed_arrival` removes such a row so the next push can begin it
again.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import delete, select

from ckptstore.catalog.checks import check_checkpoint_id
from ckptstore.catalog.core import CatalogCore
from ckptstore.catalog.models import CheckpointRow, RemoteRow, utcnow
from ckptstore.errors import RemoteError
from ckptstore.names import validate_name
from ckptstore.records import CheckpointState

__all__ = ["RemoteInfo", "RemotesMixin"]

_MAX_CONFIG = 4096


@dataclass(frozen=True)
class RemoteInfo:
    """One remote store.

    Attributes:
        name: The remote's name in this store.
        config: Absolute path of the config file that opens the remote store.
        created_at: When it was added.
    """

    name: str
    config: str
    created_at: datetime


class RemotesMixin(CatalogCore):
    """Remote methods of :class:`~ckptstore.catalog.Catalog`."""

    def add_remote(self, name: str, config: str) -> RemoteInfo:
        """Record remote ``name`` opened with the config file ``config``.

        Raises:
            InvalidNameError: If the name is not a valid name.
            RemoteError: If a remote of that name exists, or ``config`` is empty or too long.
        """
        validate_name(name, "remote name")
        if not isinstance(config, str) or not config or len(config) > _MAX_CONFIG:
            raise RemoteError(f"remote config must be a path of at most {_MAX_CONFIG} chars")
        with self._write() as s:
            found = s.scalar(select(RemoteRow.config).where(RemoteRow.name == name))
            if found is not None:
                raise RemoteError(
                    f"remote {name!r} already exists (config {found}); remove it first with "
                    f"`ckpt remote rm {name}` or choose another name"
                )
            s.add(RemoteRow(name=name, config=config, created_at=utcnow()))
            self._add_event(s, "remote_added", detail={"remote": name, "config": config})
        return self.remote(name)

    def remote(self, name: str) -> RemoteInfo:
        """The remote called ``name``.

        Raises:
            RemoteError: If there is none (the message lists the remotes there are).
        """
        validate_name(name, "remote name")
        with self._read() as s:
            row = s.get(RemoteRow, name)
            if row is None:
                known = list(s.scalars(select(RemoteRow.name).order_by(RemoteRow.name)))
                raise RemoteError(
                    f"no remote called {name!r} (remotes: {', '.join(known) or 'none'}); add "
                    f"it with `ckpt remote add {name} --config FILE`"
                )
            return RemoteInfo(row.name, row.config, row.created_at)

    def remotes(self) -> list[RemoteInfo]:
        """Every remote, by name."""
        with self._read() as s:
            rows = s.scalars(select(RemoteRow).order_by(RemoteRow.name))
            return [RemoteInfo(r.name, r.config, r.created_at) for r in rows]

    def remove_remote(self, name: str) -> None:
        """Forget remote ``name`` (checkpoints pushed or pulled stay).

        Raises:
            RemoteError: If there is no such remote.
        """
        self.remote(name)
        with self._write() as s:
            s.execute(delete(RemoteRow).where(RemoteRow.name == name))
            self._add_event(s, "remote_removed", detail={"remote": name})

    def forget_failed_arrival(self, ckpt_id: str) -> bool:
        """Delete checkpoint ``ckpt_id`` if it is FAILED (its rows cascade), so a push may
        begin it again under the same id.

        Returns:
            Whether a FAILED row was deleted.
        """
        cid = check_checkpoint_id(ckpt_id)
        with self._write() as s:
            result = s.execute(
                delete(CheckpointRow).where(CheckpointRow.id == cid,
                                            CheckpointRow.state == CheckpointState.FAILED)
            )
            return bool(getattr(result, "rowcount", 0))
