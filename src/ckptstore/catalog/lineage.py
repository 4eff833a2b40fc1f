"""Lineage: ancestors and descendants through ``parent_id``, derivation edges, reproduction.

Walks are ONE recursive CTE each, whatever the depth: a 1,000-deep fine-tuning chain costs
one query (plus the one that loads tags, aliases and replicas), not a query per hop. The CTE
carries a depth counter, which orders the result nearest-first and bounds the walk at
:data:`MAX_DEPTH` as a guard against a cycle written by hand into the database.

``parent_id`` is the lineage (resumed-from / fine-tuned-from). Derived artefacts recorded with
:meth:`add_edge` (converted-from, merged-from, extra parents) are returned by :meth:`edges` and
by :meth:`run_record`; they are not followed by :meth:`lineage`.

A merged checkpoint has several parents: one ``merged-from`` edge from each input, carrying
the input's normalised weight and its position among the inputs (:meth:`record_merge`, in
one transaction with the ``merged`` event). :meth:`lineage_graph` walks both kinds of
parents, ``parent_id`` and ``merged-from``, in one recursive CTE: the ancestry (or the
descendants) as a DAG.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Integer, Select, bindparam, func, literal, or_, select, union_all
from sqlalchemy.orm import Session

from ckptstore.catalog.checks import check_edge_kind, check_json
from ckptstore.catalog.core import CatalogCore, checkpoint_id_batches
from ckptstore.catalog.loading import (
    ROW_COLUMNS,
    Reader,
    checkpoint_query,
    checkpoint_query_from,
    load_checkpoints,
)
from ckptstore.catalog.models import CheckpointRow, LineageEdgeRow, RunRow, utcnow
from ckptstore.catalog.resolve import resolve, resolve_any
from ckptstore.errors import InvalidNameError
from ckptstore.records import Checkpoint
from ckptstore.refs import Ref

__all__ = ["MAX_DEPTH", "MERGED_FROM", "MERGE_EVENT", "LineageGraph", "LineageLink",
           "LineageMixin"]

#: Longest chain a walk follows.
MAX_DEPTH = 100_000

#: The edge kind from each input of a merge to the merged checkpoint.
MERGED_FROM = "merged-from"
#: Kind of the audit-log event recording a merge (method, weights, keys, ...).
MERGE_EVENT = "merged"


@dataclass(frozen=True)
class LineageLink:
    """One arrow of the lineage: ``dst`` derives from ``src``.

    Attributes:
        src: The parent (source) checkpoint id.
        dst: The derived checkpoint id.
        kind: ``parent`` (the ``parent_id`` link: resumed / fine-tuned from) or an edge
            kind (``converted-from``, ``merged-from``, ...).
        weight: A merged-from edge's normalised share of the merge; None otherwise.
        position: A merged-from edge's place among the merge's inputs (0 first); None
            otherwise.
    """

    src: str
    dst: str
    kind: str
    weight: float | None = None
    position: int | None = None


@dataclass(frozen=True)
class LineageGraph:
    """A checkpoint's ancestry (or descendants) with every parent, as a DAG.

    Attributes:
        root: The checkpoint asked about.
        nodes: The others, nearest first (by shortest distance), in any state.
        links: The parent links and merged-from edges among ``root`` and ``nodes``.
    """

    root: Checkpoint
    nodes: list[Checkpoint]
    links: list[LineageLink]

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


def _graph_query(descendants: bool) -> Select[Any]:
    """Every checkpoint reachable through ``parent_id`` and merged-from edges, nearest first.

    One recursive CTE over the union of both kinds of parent link. ``UNION`` (not ``ALL``)
    keeps each (node, depth) once, so a DAG whose paths meet again (an input merged into
    several checkpoints that are merged again) is walked once per distinct depth, not once
    per path.
    """
    E = LineageEdgeRow
    links = union_all(
        select(C.id.label("child"), C.parent_id.label("parent")).where(C.parent_id.is_not(None)),
        select(E.dst_id.label("child"), E.src_id.label("parent")).where(E.kind == MERGED_FROM),
    ).subquery("links")
    near, far = (links.c.parent, links.c.child) if descendants else (links.c.child, links.c.parent)
    first = select(far.label("id"), literal(1, Integer).label("depth")).where(
        near == bindparam("start")
    )
    walk = first.cte("graph", recursive=True)
    walk = walk.union(
        select(far, walk.c.depth + 1)
        .select_from(links)
        .join(walk, near == walk.c.id)
        .where(walk.c.depth < MAX_DEPTH)
    )
    nearest = (
        select(walk.c.id, func.min(walk.c.depth).label("depth"))
        .group_by(walk.c.id)
        .subquery("nearest")
    )
    return (
        checkpoint_query()
        .join(nearest, C.id == nearest.c.id)
        .where(C.id != bindparam("start"))
        .order_by(nearest.c.depth, C.run_id, C.version)
    )


# Built once, executed with the start id bound.
_ANCESTORS = _ancestors_query()
_DESCENDANTS = _descendants_query()
_GRAPH_UP = _graph_query(descendants=False)
_GRAPH_DOWN = _graph_query(descendants=True)


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
        return self._reading(
            lambda conn: self._ancestors(conn, resolve(conn, parsed, attachments=False).id)
        )

    def descendants(self, ref: str | Ref) -> list[Checkpoint]:
        """Checkpoints resumed or fine-tuned from this one, transitively, nearest first.

        Every state is included (a PENDING child is a save in flight; check ``.state``).
        """
        parsed = self._ref(ref)
        with self._read() as s:
            start = resolve(s, parsed, attachments=False).id
            return load_checkpoints(s, _DESCENDANTS, {"start": start})

    def add_edge(
        self,
        src_id: str | Ref,
        dst_id: str | Ref,
        kind: str,
        *,
        weight: float | None = None,
        position: int | None = None,
    ) -> None:
        """Record that ``dst`` was derived from ``src`` (idempotent).

        Args:
            src_id: The source checkpoint (id or reference).
            dst_id: The derived checkpoint (id or reference).
            kind: ``resumed-from``, ``fine-tuned-from``, ``converted-from`` or ``merged-from``.
            weight: A merged-from edge's normalised weight (a copy of another store's edge;
                merges record theirs with :meth:`record_merge`).
            position: A merged-from edge's place among the inputs.

        Raises:
            InvalidNameError: Unknown kind, an edge from a checkpoint to itself, or a weight
                or position on another kind of edge, or out of range.
            CheckpointNotFoundError: If either end does not exist.
        """
        kind = check_edge_kind(kind)
        _check_share(kind, weight, position)
        with self._write() as s:
            src = self._endpoint(s, src_id)
            dst = self._endpoint(s, dst_id)
            if src == dst:
                raise InvalidNameError(f"a checkpoint cannot be derived from itself ({src})")
            s.execute(
                self._insert(LineageEdgeRow)
                .values(src_id=src, dst_id=dst, kind=kind, created_at=utcnow(),
                        weight=weight, position=position)
                .on_conflict_do_nothing(index_elements=["src_id", "dst_id", "kind"])
            )

    def record_merge(
        self,
        dst_id: str,
        parents: Sequence[tuple[str, float]],
        detail: dict[str, Any],
    ) -> None:
        """Record a merge: a merged-from edge from every input, and a ``merged`` event.

        One transaction: a merged checkpoint's parents are all recorded or none is.
        Idempotent for the same inputs.

        Args:
            dst_id: The merged checkpoint's id.
            parents: ``(input id, normalised weight)`` in input order.
            detail: JSON for the ``merged`` event (method, weights, keys...).

        Raises:
            InvalidNameError: For fewer than two parents, one listed twice, the merged
                checkpoint among them, or a weight out of ``[0, 1]``.
            CheckpointNotFoundError: If a checkpoint does not exist.
        """
        if len(parents) < 2 or len({p for p, _ in parents}) != len(parents):
            raise InvalidNameError(
                "a merge records two or more distinct parents, got "
                f"{[p for p, _ in parents]}"
            )
        for position, (_, weight) in enumerate(parents):
            _check_share(MERGED_FROM, weight, position)
        payload = check_json(detail, "merge detail")
        now = utcnow()
        with self._write() as s:
            dst = self._endpoint(s, dst_id)
            rows = []
            for position, (parent, weight) in enumerate(parents):
                src = self._endpoint(s, parent)
                if src == dst:
                    raise InvalidNameError(f"checkpoint {dst} cannot be merged from itself")
                rows.append({"src_id": src, "dst_id": dst, "kind": MERGED_FROM,
                             "created_at": now, "weight": float(weight), "position": position})
            s.execute(
                self._insert(LineageEdgeRow)
                .values(rows)
                .on_conflict_do_nothing(index_elements=["src_id", "dst_id", "kind"])
            )
            run_id = s.scalar(select(C.run_id).where(C.id == dst))
            self._add_event(s, MERGE_EVENT, checkpoint_id=dst, run_id=run_id, detail=payload)

    def edges(self, ckpt_id: str | Ref) -> list[tuple[str, str, str]]:
        """Derivation edges touching a checkpoint, as ``(src_id, dst_id, kind)``, oldest first."""
        return [(link.src, link.dst, link.kind) for link in self.links(ckpt_id)]

    def links(self, ckpt_id: str | Ref) -> list[LineageLink]:
        """Derivation edges touching a checkpoint, with merge weights, oldest first.

        A merge's edges (created together) come in input order.
        """
        with self._read() as s:
            cid = self._endpoint(s, ckpt_id)
            return self._edges(s, cid)

    def merge_inputs(self, ckpt_id: str | Ref) -> list[LineageLink]:
        """The merged-from edges into a checkpoint, in input order (empty if not a merge)."""
        with self._read() as s:
            cid = self._endpoint(s, ckpt_id)
            found = [link for link in self._edges(s, cid)
                     if link.kind == MERGED_FROM and link.dst == cid]
        return sorted(found, key=lambda link: (link.position is None, link.position or 0))

    def lineage_graph(self, ref: str | Ref, *, descendants: bool = False) -> LineageGraph:
        """A checkpoint's ancestors (or descendants) through every parent, as a DAG.

        Follows ``parent_id`` and merged-from edges (so a merged checkpoint's ancestry holds
        every input and their own ancestors), in ONE recursive CTE whatever the depth.

        Args:
            ref: Reference of a COMMITTED checkpoint.
            descendants: Walk to the checkpoints derived from it instead.

        Returns:
            The :class:`LineageGraph`: nodes nearest first, with the links among them.
        """
        parsed = self._ref(ref)
        with self._read() as s:
            root = resolve(s, parsed)
            nodes = load_checkpoints(s, _GRAPH_DOWN if descendants else _GRAPH_UP,
                                     {"start": root.id})
            everyone = [root, *nodes]
            known = {ck.id for ck in everyone}
            links = [LineageLink(ck.parent_id, ck.id, "parent") for ck in everyone
                     if ck.parent_id in known]
            links += [link for link in self._links_among(s, known)
                      if link.kind == MERGED_FROM]
        return LineageGraph(root, nodes, links)

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
        return [(link.src, link.dst, link.kind) for link in self.links_among(ids)]

    def links_among(self, ids: Iterable[str]) -> list[LineageLink]:
        """Like :meth:`edges_among`, with merge weights and positions."""
        with self._read() as s:
            return self._links_among(s, ids)

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
            "edges": [_edge_json(link) for link in edges],
        }

    # ------------------------------------------------------------------ helpers
    @staticmethod
    def _ancestors(session: Reader, start: str) -> list[Checkpoint]:
        return load_checkpoints(session, _ANCESTORS, {"start": start})

    @staticmethod
    def _edges(session: Session, cid: str) -> list[LineageLink]:
        E = LineageEdgeRow
        rows = session.execute(
            select(E.src_id, E.dst_id, E.kind, E.weight, E.position)
            .where(or_(E.src_id == cid, E.dst_id == cid))
            .order_by(E.created_at, E.position, E.src_id, E.dst_id, E.kind)
        )
        return [LineageLink(*row) for row in rows]

    @staticmethod
    def _links_among(session: Session, ids: Iterable[str]) -> list[LineageLink]:
        batches = checkpoint_id_batches(ids)
        wanted = {cid for batch in batches for cid in batch}
        E = LineageEdgeRow
        rows: list[Any] = []
        for batch in batches:
            stmt = select(E.src_id, E.dst_id, E.kind, E.weight, E.position,
                          E.created_at).where(E.src_id.in_(batch))
            if len(batches) == 1:
                # Every id fits in one statement: the database filters both ends.
                stmt = stmt.where(E.dst_id.in_(batch))
            rows.extend(session.execute(stmt))
        rows = [r for r in rows if r.dst_id in wanted]
        # A merge's edges share one created_at: its inputs then come in their order.
        rows.sort(key=lambda r: (r.created_at, r.position is not None, r.position or 0,
                                 r.src_id, r.dst_id, r.kind))
        return [LineageLink(r.src_id, r.dst_id, r.kind, r.weight, r.position) for r in rows]

    def _endpoint(self, session: Session, ref: str | Ref) -> str:
        # Ids are taken in any state (edges and history outlive pruning); other references
        # must resolve to a COMMITTED checkpoint.
        parsed = self._ref(ref)
        if parsed.kind == "id" and parsed.id is not None:
            return resolve_any(session, parsed.id, attachments=False).id
        return resolve(session, parsed, attachments=False).id


def _edge_json(link: LineageLink) -> dict[str, Any]:
    out: dict[str, Any] = {"src": link.src, "dst": link.dst, "kind": link.kind}
    if link.weight is not None:
        out["weight"] = link.weight
    if link.position is not None:
        out["position"] = link.position
    return out


def _check_share(kind: str, weight: float | None, position: int | None) -> None:
    """A merged-from edge's weight in [0, 1] and position >= 0; other edges carry neither."""
    if kind != MERGED_FROM:
        if weight is not None or position is not None:
            raise InvalidNameError(f"only {MERGED_FROM} edges carry a weight and a position")
        return
    if weight is not None and (
        isinstance(weight, bool) or not isinstance(weight, int | float)
        or not math.isfinite(weight) or not 0.0 <= weight <= 1.0
    ):
        raise InvalidNameError(f"a merge weight is a normalised share in [0, 1], not {weight!r}")
    if position is not None and (
        isinstance(position, bool) or not isinstance(position, int) or not 0 <= position < 2**31
    ):
        raise InvalidNameError(f"a merge input position is a small non-negative int, "
                               f"not {position!r}")
