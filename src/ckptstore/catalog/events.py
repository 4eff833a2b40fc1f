"""The audit log: who saved, archived, pruned, restored, converted or verified what, when."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from ckptstore.catalog.checks import check_checkpoint_id, check_count, check_json
from ckptstore.catalog.core import CatalogCore, default_actor
from ckptstore.catalog.models import EventRow, RunRow
from ckptstore.catalog.resolve import resolve, resolve_any
from ckptstore.errors import InvalidNameError
from ckptstore.names import validate_name
from ckptstore.records import Event
from ckptstore.refs import Ref

__all__ = ["EventsMixin"]


class EventsMixin(CatalogCore):
    """Audit-log methods of :class:`~ckptstore.catalog.Catalog`."""

    def record_event(
        self,
        kind: str,
        *,
        checkpoint_id: str | None = None,
        run: str | None = None,
        actor: str | None = None,
        detail: Mapping[str, Any] | None = None,
    ) -> Event:
        """Append an entry to the audit log.

        Args:
            kind: What happened: ``archived``, ``pruned``, ``restored``, ...
            checkpoint_id: The checkpoint concerned (any state); its run is recorded too.
            run: The run concerned, when no checkpoint is.
            actor: Who did it; ``user@host`` of this process by default.
            detail: JSON-serialisable details.

        Returns:
            The stored event.

        Raises:
            CheckpointNotFoundError: If the checkpoint or run does not exist.
            InvalidNameError: If the kind is empty or the detail is not JSON-serialisable.
        """
        if not isinstance(kind, str) or not kind or len(kind) > 64:
            raise InvalidNameError(
                f"event kind must be a non-empty string of <= 64 chars, not {kind!r}"
            )
        payload = check_json(detail, "event detail")
        cid = check_checkpoint_id(checkpoint_id) if checkpoint_id is not None else None
        if run is not None:
            validate_name(run)
        with self._write() as s:
            run_id = None
            if cid is not None:
                ck = resolve_any(s, cid, attachments=False)
                run_id = self._run_id(s, ck.run)
                if run is not None and run != ck.run:
                    raise InvalidNameError(
                        f"checkpoint {cid} belongs to run {ck.run!r}, not {run!r}"
                    )
            elif run is not None:
                run_id = self._run_id(s, run)
            who = actor or default_actor()
            at = self._add_event(
                s, kind, checkpoint_id=cid, run_id=run_id, actor=who, detail=payload
            )
            run_name = s.scalar(select(RunRow.name).where(RunRow.id == run_id)) if run_id else None
        return Event(kind=kind, at=at, checkpoint_id=cid, actor=who, detail=payload, run=run_name)

    def events(
        self,
        ref: str | Ref | None = None,
        *,
        run: str | None = None,
        kind: str | None = None,
        limit: int = 100,
    ) -> list[Event]:
        """Audit-log entries, newest first.

        Args:
            ref: Only events of this checkpoint. An id works in any state (the history of a
                pruned checkpoint stays readable); other references must resolve.
            run: Only events of this run (checkpoint events included).
            kind: Only events of this kind (``loss-anomaly``, ``pruned``, ...).
            limit: At most this many.

        Returns:
            The events.
        """
        limit = check_count(limit, "limit", 1)
        stmt = (
            select(
                EventRow.kind,
                EventRow.at,
                EventRow.checkpoint_id,
                EventRow.actor,
                EventRow.detail,
                RunRow.name.label("run_name"),
            )
            .outerjoin(RunRow, EventRow.run_id == RunRow.id)
            .order_by(EventRow.at.desc(), EventRow.id.desc())
            .limit(limit)
        )
        with self._read() as s:
            if ref is not None:
                stmt = stmt.where(EventRow.checkpoint_id == self._event_target(s, ref))
            if run is not None:
                stmt = stmt.where(EventRow.run_id == self._run_id(s, validate_name(run)))
            if kind is not None:
                stmt = stmt.where(EventRow.kind == kind)
            return [
                Event(
                    kind=r.kind,
                    at=r.at,
                    checkpoint_id=r.checkpoint_id,
                    actor=r.actor,
                    detail=dict(r.detail or {}),
                    run=r.run_name,
                )
                for r in s.execute(stmt)
            ]

    def _event_target(self, session: Session, ref: str | Ref) -> str:
        parsed = self._ref(ref)
        if parsed.kind == "id" and parsed.id is not None:
            return resolve_any(session, parsed.id, attachments=False).id
        return resolve(session, parsed, attachments=False).id
