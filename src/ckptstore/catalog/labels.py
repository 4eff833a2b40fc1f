"""Aliases and pins: user labels that also mean "never prune this checkpoint".

Labelling and deleting lock the checkpoint row the same way (``FOR NO KEY UPDATE`` on
PostgreSQL, the write lock on SQLite), so a pin racing with :meth:`mark_deleting` either lands
first (and the deletion is refused) or finds the checkpoint already DELETING (and is refused).
"""

from __future__ import annotations

import uuid

from sqlalchemy import delete, exists, select, update
from sqlalchemy.orm import Session

from ckptstore.catalog.checks import check_checkpoint_id
from ckptstore.catalog.core import CatalogCore, names_hint
from ckptstore.catalog.loading import load_by_id
from ckptstore.catalog.models import AliasRow, CheckpointRow, utcnow
from ckptstore.catalog.resolve import ensure_committed, resolve
from ckptstore.errors import CheckpointNotFoundError, InvalidNameError
from ckptstore.names import validate_name
from ckptstore.records import Checkpoint, CheckpointState
from ckptstore.refs import Ref

__all__ = ["LabelsMixin"]

C = CheckpointRow


def _check_alias(name: object) -> str:
    alias = validate_name(name, "alias")
    try:
        uuid.UUID(alias)
    except ValueError:
        return alias
    # A uuid-shaped alias would be read back as a checkpoint id by parse_ref.
    raise InvalidNameError(f"alias {alias!r} looks like a checkpoint id; pick another name")


class LabelsMixin(CatalogCore):
    """Alias and pin methods of :class:`~ckptstore.catalog.Catalog`."""

    def alias(self, ref: str | Ref, name: str) -> Checkpoint:
        """Point alias ``name`` at a checkpoint, moving it if it already points elsewhere.

        An aliased checkpoint is never pruned. ``name`` then works as a reference anywhere.

        Args:
            ref: Reference of a COMMITTED checkpoint.
            name: Alias name (run-name rules; not uuid-shaped).

        Returns:
            The checkpoint, with its aliases.
        """
        alias = _check_alias(name)
        parsed = self._ref(ref)
        with self._write() as s:
            cid = self._lock_committed(s, resolve(s, parsed, attachments=False).id)
            stmt = self._insert(AliasRow).values(name=alias, checkpoint_id=cid, created_at=utcnow())
            s.execute(
                stmt.on_conflict_do_update(
                    index_elements=["name"],
                    set_={
                        "checkpoint_id": stmt.excluded.checkpoint_id,
                        "created_at": stmt.excluded.created_at,
                    },
                )
            )
            return self._reload(s, cid)

    def unalias(self, name: str) -> None:
        """Remove an alias (the checkpoint stays; it may become prunable).

        Raises:
            CheckpointNotFoundError: If there is no such alias.
        """
        alias = validate_name(name, "alias")
        with self._write() as s:
            if s.scalar(select(AliasRow.name).where(AliasRow.name == alias)) is None:
                known = names_hint(s, AliasRow.name, "aliases") or "no aliases are defined"
                raise CheckpointNotFoundError(f"no alias {alias!r}; {known}")
            s.execute(delete(AliasRow).where(AliasRow.name == alias))

    def pin(self, ref: str | Ref) -> Checkpoint:
        """Pin a checkpoint: retention never prunes it. Idempotent."""
        return self._set_pinned(ref, True)

    def unpin(self, ref: str | Ref) -> Checkpoint:
        """Remove a pin. Idempotent."""
        return self._set_pinned(ref, False)

    def is_protected(self, ckpt_id: str) -> bool:
        """True when the checkpoint is pinned or has an alias (never pruned)."""
        cid = check_checkpoint_id(ckpt_id)
        with self._read() as s:
            aliased = exists().where(AliasRow.checkpoint_id == cid)
            row = s.execute(select(C.pinned, aliased).where(C.id == cid)).first()
            if row is None:
                raise CheckpointNotFoundError(f"no checkpoint has id {cid}")
            return bool(row[0] or row[1])

    # ------------------------------------------------------------------ helpers
    def _set_pinned(self, ref: str | Ref, pinned: bool) -> Checkpoint:
        parsed = self._ref(ref)
        with self._write() as s:
            cid = self._lock_committed(s, resolve(s, parsed, attachments=False).id)
            s.execute(update(C).where(C.id == cid).values(pinned=pinned))
            return self._reload(s, cid)

    @staticmethod
    def _lock_committed(session: Session, cid: str) -> str:
        state = session.scalar(select(C.state).where(C.id == cid).with_for_update(key_share=True))
        if state != CheckpointState.COMMITTED:
            # Deleted between resolving and locking: report it the usual way.
            ck = load_by_id(session, cid)
            assert ck is not None
            ensure_committed(ck)
        return cid

    @staticmethod
    def _reload(session: Session, cid: str) -> Checkpoint:
        ck = load_by_id(session, cid)
        assert ck is not None
        return ck
