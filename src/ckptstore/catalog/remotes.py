"""Remotes (other stores, by config file) and the catalog side of checkpoints arriving from one.

A remote is a name for another store's config file (``ckpt remote add NAME --config FILE``);
the catalog keeps the list so every host sharing a PostgreSQL catalog sees the same remotes.
The push itself lives in :mod:`ckptstore.ops.sharing.push`.

A checkpoint arriving from another store keeps its id (signatures and lineage name ids), so a
failed arrival that gc or the pusher marked FAILED would block the id for good:
:meth:`RemotesMixin.forget_failed_arrival` removes such a row so the next push can begin it
again. A DELETED row (the checkpoint arrived once and was pruned here) is history, not a
conflict: :meth:`RemotesMixin.revive_arrival` makes it PENDING again when the same content
(same manifest digest) arrives again, with a ``revived`` event, and
:meth:`RemotesMixin.bury_arrival` returns it to DELETED if that arrival fails.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import delete, null, select, update

from ckptstore.catalog.checks import check_checkpoint_id, check_tier
from ckptstore.catalog.core import CatalogCore, default_writer
from ckptstore.catalog.loading import load_by_id
from ckptstore.catalog.models import CheckpointRow, RemoteRow, ReplicaRow, RunRow, utcnow
from ckptstore.errors import ConflictError, InvalidNameError, RemoteError
from ckptstore.names import validate_name
from ckptstore.records import Checkpoint, CheckpointState, ReplicaState

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

    def revive_arrival(
        self,
        ckpt_id: str,
        manifest_digest: str,
        *,
        kind: str,
        base_id: str | None,
        tier: str,
        uri: str,
        detail: dict[str, Any] | None = None,
    ) -> Checkpoint | None:
        """Make a DELETED checkpoint PENDING again, because its content arrives again.

        The row keeps its id, run, version, metrics, tags and history; it gets this process
        as its writer, the arrival's time as ``created_at`` (a dead-writer check must not
        judge the arrival by the first one's age), the copy's ``kind`` and ``base_id``, and
        a COPYING replica on ``tier``. A ``revived`` event records it.

        Returns:
            The PENDING checkpoint, or None when the row is not DELETED.

        Raises:
            ConflictError: If the DELETED row had another manifest digest (another
                checkpoint under the same id), or ``base_id`` is not COMMITTED.
        """
        cid = check_checkpoint_id(ckpt_id)
        tier = check_tier(tier)
        if kind not in ("full", "delta") or (kind == "delta") != (base_id is not None):
            raise InvalidNameError(f"kind {kind!r} with base {base_id!r} is not a valid pair")
        now = utcnow()
        with self._write() as s:
            row = s.execute(select(CheckpointRow.state, CheckpointRow.manifest_digest,
                                   CheckpointRow.run_id)
                            .where(CheckpointRow.id == cid).with_for_update()).first()
            if row is None or row.state != CheckpointState.DELETED:
                return None
            if row.manifest_digest != manifest_digest:
                raise ConflictError(
                    f"checkpoint id {cid} was another checkpoint here (manifest "
                    f"{row.manifest_digest}), pruned since; refusing to revive it with other "
                    "content"
                )
            if base_id is not None and s.scalar(select(CheckpointRow.state).where(
                    CheckpointRow.id == check_checkpoint_id(base_id))) != \
                    CheckpointState.COMMITTED:
                raise ConflictError(f"base checkpoint {base_id} of {cid} is not committed "
                                    "here; send it first")
            s.execute(update(CheckpointRow).where(CheckpointRow.id == cid).values(
                state=CheckpointState.PENDING, kind=kind, base_id=base_id,
                writer=default_writer(), created_at=now, committed_at=null()))
            values: dict[str, Any] = {"checkpoint_id": cid, "tier": tier, "uri": uri,
                                      "state": ReplicaState.COPYING, "bytes": 0,
                                      "updated_at": now}
            stmt = self._insert(ReplicaRow).values(**values)
            s.execute(stmt.on_conflict_do_update(
                index_elements=["checkpoint_id", "tier"],
                set_={"uri": stmt.excluded.uri, "state": stmt.excluded.state, "bytes": 0,
                      "updated_at": now, "verified_at": null(), "manifest_digest": null()}))
            self._add_event(s, "revived", checkpoint_id=cid, run_id=row.run_id,
                            detail=dict(detail or {}))
            found = load_by_id(s, cid)
            assert found is not None
            return found

    def bury_arrival(self, ckpt_id: str, reason: str) -> None:
        """Return a revived checkpoint whose arrival failed to DELETED (PENDING → DELETED,
        every replica DELETED), with a ``revive_failed`` event. Idempotent."""
        cid = check_checkpoint_id(ckpt_id)
        with self._write() as s:
            run_id = s.scalar(select(CheckpointRow.run_id).where(
                CheckpointRow.id == cid, CheckpointRow.state == CheckpointState.PENDING))
            if run_id is None:
                return
            s.execute(update(CheckpointRow).where(CheckpointRow.id == cid)
                      .values(state=CheckpointState.DELETED))
            s.execute(update(ReplicaRow).where(ReplicaRow.checkpoint_id == cid)
                      .values(state=ReplicaState.DELETED, bytes=0, updated_at=utcnow()))
            self._add_event(s, "revive_failed", checkpoint_id=cid, run_id=run_id,
                            detail={"reason": str(reason)[:500]})

    def forget_empty_run(self, run: str) -> bool:
        """Delete run ``run`` if no checkpoint (in any state) belongs to it: what a failed
        arrival that created the run leaves. Returns whether it was deleted."""
        name = validate_name(run)
        with self._write() as s:
            run_id = s.scalar(select(RunRow.id).where(RunRow.name == name))
            if run_id is None or s.scalar(select(CheckpointRow.id).where(
                    CheckpointRow.run_id == run_id).limit(1)) is not None:
                return False
            s.execute(delete(RunRow).where(RunRow.id == run_id))
            return True
