"""Lineage: ancestors and descendants through ``parent_id``, derivation edges, reproduction.

Walks are ONE recursive CTE each, whatever the depth: a 1,000-deep fine-tuning chain costs
one query (plus the one that loads tags, aliases and replicas), not a query per hop. The CTE
carries a depth counter, which orders the result nearest-first and bounds the walk at
:data:`MAX_DEPTH` as a guard against a cycle written by hand into the database.

``parent_id`` is the lineage (resumed-from / fine-tuned-from). Derived artefacts recorded with
:meth:`add_edge` (converted-from, merged-from, extra parents) are returned by :meth:`edges` and
by :meth:`run_record`; they are not followed by :meth:`lineage`.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from sqlalchemy import Integer, Select, bindparam, literal, or_, select
from sqlalchemy.orm import Session

from ckptstore.catalog.checks import check_edge_kind
from ckptstore.catalog.core import CatalogCore, checkpoint_id_batches
from ckptstore.catalog.loading import ROW_COLUMNS, checkpoint_query_from, load_checkpoints
from ckptstore.catalog.models import CheckpointRow, LineageEdgeRow, RunRow, utcnow
from ckptstore.catalog.resolve import resolve, resolve_any
from ckptstore.errors import InvalidNameError
from ckptstore.records import Checkpoint
from ckptstore.refs import Ref

__all__ = ["MAX_DEPTH", "LineageMixin"]

#: Longest chain a walk follows.
MAX_DEPTH = 100_000

C = CheckpointRow

# Walks carry whole rows: each step's single index probe fetches everything the record
# needs, instead of walking ids and probing every row a second time to load it.
_WALKED = (*ROW_COLUMNS, C.run_id)


def _ancestors_query() -> Select[Any]:
    parent_of_start = select(C.parent_id).where(C.id == bindparam("start")).scalar_subquery()
    first = select(*_WALKED, literal(1, Integer).label("depth")).where(C.id == parent_of_start)
    walk = first.cte("ancestors", recursive=True)
    walk = walk.union_all(
        select(*_WALKED, walk.c.depth + 1)
        .select_from(C)
        .join(walk, C.id == walk.c.parent_id)
        .where(walk.c.depth < MAX_DEPTH)
    )
    return checkpoint_query_from(walk).order_by(walk.c.depth)


def _descendants_query() -> Select[Any]:
    first = select(*_WALKED, literal(1, Integer).label("depth")).where(
        C.parent_id == bindparam("start")
    )
    walk = first.cte("descendants", recursive=True)
    walk = walk.union_all(
        select(*_WALKED, walk.c.depth + 1)
        .select_from(C)
        .join(walk, C.parent_id == walk.c.id)
        .where(walk.c.depth < MAX_DEPTH)
    )
    return checkpoint_query_from(walk).order_by(walk.c.depth, walk.c.run_id, walk.c.version)


# Built once, executed with the start id bound.
_ANCESTORS = _ancestors_query()
_DESCENDANTS = _descendants_query()


class LineageMixin(CatalogCore):
    """Lineage methods of :class:`~ckptstore.catalog.Catalog`."""

    def lineage(self, ref: str | Ref) -> list[Checkpoint]:
        """Ancestors of a checkpoint through ``parent_id``, nearest first, across runs.

        Ancestors are returned in whatever state they are now (a pruned ancestor is still
        part of the history; check ``.state``).

        Args:
            ref: Reference of a COMMITTED checkpoint.

        Returns:
            Parent, grandparent, ...; empty for a checkpoint trained from scratch.
        """
        parsed = self._ref(ref)
        with self._read() as s:
            return self._ancestors(s, resolve(s, parsed, attachments=False).id)

    def descendants(self, ref: str | Ref) -> list[Checkpoint]:
        """Checkpoints resumed or fine-tuned from this one, transitively, nearest first.

        Every state is included (a PENDING child is a save in flight; check ``.state``).
        """
        parsed = self._ref(ref)
        with self._read() as s:
            start = resolve(s, parsed, attachments=False).id
            return load_checkpoints(s, _DESCENDANTS, {"start": start})

    def add_edge(self, src_id: str | Ref, dst_id: str | Ref, kind: str) -> None:
        """Record that ``dst`` was derived from ``src`` (idempotent).

        Args:
            src_id: The source checkpoint (id or reference).
            dst_id: The derived checkpoint (id or reference).
            kind: ``resumed-from``, ``fine-tuned-from``, ``converted-from`` or ``merged-from``.

        Raises:
            InvalidNameError: Unknown kind, or an edge from a checkpoint to itself.
            CheckpointNotFoundError: If either end does not exist.
        """
        kind = check_edge_kind(kind)
        with self._write() as s:
            src = self._endpoint(s, src_id)
            dst = self._endpoint(s, dst_id)
            if src == dst:
                raise InvalidNameError(f"a checkpoint cannot be derived from itself ({src})")
            s.execute(
                self._insert(LineageEdgeRow)
                .values(src_id=src, dst_id=dst, kind=kind, created_at=utcnow())
                .on_conflict_do_nothing(index_elements=["src_id", "dst_id", "kind"])
            )

    def edges(self, ckpt_id: str | Ref) -> list[tuple[str, str, str]]:
        """Derivation edges touching a checkpoint, as ``(src_id, dst_id, kind)``, oldest first."""
        with self._read() as s:
            cid = self._endpoint(s, ckpt_id)
            return self._edges(s, cid)

    def edges_among(self, ids: Iterable[str]) -> list[tuple[str, str, str]]:
        """Derivation edges whose both ends are in ``ids``, as ``(src_id, dst_id, kind)``.

        For drawing a graph of many checkpoints at once: one query for up to
        :data:`~ckptstore.catalog.core.MAX_BOUND_IDS` ids (one per that many beyond), instead
        of one :meth:`edges` call per checkpoint. Ids of checkpoints in any state are taken;
        ids that name no checkpoint simply match no edge.

        Args:
            ids: Checkpoint ids (a list, set or any iterable of uuid strings).

        Returns:
            The edges, oldest first (the order of :meth:`edges`).

        Raises:
            InvalidNameError: If an id is not a uuid (or ``ids`` is a single string).
        """
        batches = checkpoint_id_batches(ids)
        wanted = {cid for batch in batches for cid in batch}
        E = LineageEdgeRow
        rows: list[Any] = []
        with self._read() as s:
            for batch in batches:
                stmt = select(E.src_id, E.dst_id, E.kind, E.created_at).where(E.src_id.in_(batch))
                if len(batches) == 1:
                    # Every id fits in one statement: the database filters both ends.
                    stmt = stmt.where(E.dst_id.in_(batch))
                rows.extend(s.execute(stmt))
        rows = [r for r in rows if r.dst_id in wanted]
        rows.sort(key=lambda r: (r.created_at, r.src_id, r.dst_id, r.kind))
        return [(r.src_id, r.dst_id, r.kind) for r in rows]

    def run_record(self, ref: str | Ref) -> dict[str, Any]:
        """Everything needed to reproduce a checkpoint, as JSON-ready data.

        Returns:
            ``{"checkpoint": {...}, "run": {...}, "parents": [refs nearest first],
            "metrics": {...}, "tags": [...], "replicas": [...], "edges": [...]}`` where
            timestamps are ISO 8601 strings.
        """
        parsed = self._ref(ref)
        with self._read() as s:
            target = resolve(s, parsed)
            parents = self._ancestors(s, target.id)
            run = s.execute(
                select(
                    RunRow.name,
                    RunRow.config,
                    RunRow.code_version,
                    RunRow.data_version,
                    RunRow.host,
                    RunRow.status,
                    RunRow.created_at,
                ).where(RunRow.name == target.run)
            ).one()
            edges = self._edges(s, target.id)
        return {
            "checkpoint": {
                "id": target.id,
                "ref": target.ref,
                "run": target.run,
                "experiment": target.experiment,
                "step": target.step,
                "version": target.version,
                "kind": target.kind,
                "base_id": target.base_id,
                "parent_id": target.parent_id,
                "codec": target.codec,
                "lossy": target.lossy,
                "error_bound": target.error_bound,
                "manifest_digest": target.manifest_digest,
                "logical_bytes": target.logical_bytes,
                "stored_bytes": target.stored_bytes,
                "created_at": target.created_at.isoformat(),
                "committed_at": target.committed_at.isoformat() if target.committed_at else None,
            },
            "run": {
                "name": run.name,
                "experiment": target.experiment,
                "config": dict(run.config or {}),
                "code_version": run.code_version,
                "data_version": run.data_version,
                "host": run.host,
                "status": run.status,
                "created_at": run.created_at.isoformat(),
            },
            "parents": [{"id": p.id, "ref": p.ref, "state": p.state.value} for p in parents],
            "metrics": dict(target.metrics),
            "tags": list(target.tags),
            "aliases": list(target.aliases),
            "replicas": [
                {
                    "tier": r.tier,
                    "uri": r.uri,
                    "state": r.state.value,
                    "bytes": r.bytes,
                    "verified_at": r.verified_at.isoformat() if r.verified_at else None,
                }
                for r in target.replicas
            ],
            "edges": [{"src": a, "dst": b, "kind": k} for a, b, k in edges],
        }

    # ------------------------------------------------------------------ helpers
    @staticmethod
    def _ancestors(session: Session, start: str) -> list[Checkpoint]:
        return load_checkpoints(session, _ANCESTORS, {"start": start})

    @staticmethod
    def _edges(session: Session, cid: str) -> list[tuple[str, str, str]]:
        E = LineageEdgeRow
        rows = session.execute(
            select(E.src_id, E.dst_id, E.kind)
            .where(or_(E.src_id == cid, E.dst_id == cid))
            .order_by(E.created_at, E.src_id, E.dst_id, E.kind)
        )
        return [(a, b, k) for a, b, k in rows]

    def _endpoint(self, session: Session, ref: str | Ref) -> str:
        # Ids are taken in any state (edges and history outlive pruning); other references
        # must resolve to a COMMITTED checkpoint.
        parsed = self._ref(ref)
        if parsed.kind == "id" and parsed.id is not None:
            return resolve_any(session, parsed.id, attachments=False).id
        return resolve(session, parsed, attachments=False).id
