"""Turning catalog rows into the plain records of :mod:`ckptstore.records`.

Reads select plain columns (Core rows, no ORM identity map): loading a 1,000-deep lineage or a
page of a listing is dominated by object construction, and Core rows are several times cheaper
than ORM instances. A list of N checkpoints costs ONE query whatever N is: each row carries
the checkpoint's scalar columns, its run and experiment names, and one JSON text (the
*document*) holding everything list-valued: metrics, tags, the lossy scope, the part hosts,
and the replicas and aliases, gathered by two correlated subqueries that probe the
``checkpoint_id`` indexes once per row. The database writes the document by concatenating the
stored JSON texts (nothing is parsed on its side), and Python decodes it with one
``json.loads`` per row instead of one per column.

Statements on hot paths are built once at import with bind parameters: SQLAlchemy's
statement construction costs more than executing an indexed point query.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

from sqlalchemy import (
    ColumnElement,
    FromClause,
    Row,
    Select,
    Text,
    bindparam,
    cast,
    func,
    literal_column,
    select,
)
from sqlalchemy.engine import Connection
from sqlalchemy.ext.compiler import compiles
from sqlalchemy.orm import Session
from sqlalchemy.sql.compiler import SQLCompiler
from sqlalchemy.sql.functions import FunctionElement

from ckptstore.catalog.models import (
    AliasRow,
    CheckpointRow,
    ExperimentRow,
    ReplicaRow,
    RunRow,
    parse_utc,
)
from ckptstore.format.gcpause import gc_paused
from ckptstore.records import TIER_ORDER, Checkpoint, Replica, ReplicaState

__all__ = [
    "ROW_COLUMNS",
    "Reader",
    "checkpoint_query",
    "checkpoint_query_from",
    "load_by_id",
    "load_checkpoints",
    "load_one",
    "load_rows",
]


# Replicas are shown fastest tier first; unknown tier names follow, alphabetically.
_TIER_RANK = {tier: rank for rank, tier in enumerate(TIER_ORDER)}
#: ``object.__new__``: a record without running its dataclass __init__ (see _record).
_new_record = object.__new__
# A dict lookup: calling the enum costs several times more per replica.
_REPLICA_STATES = {state.value: state for state in ReplicaState}

C = CheckpointRow

#: What reads run on: a session (inside the caller's transaction), or a connection of the
#: single-statement read path (:meth:`ckptstore.catalog.core.CatalogCore._reading`).
Reader = Session | Connection

# The checkpoint's own columns: what a recursive walk carries along (lineage.py), so that
# the rows it reaches need no second lookup.
ROW_COLUMNS = (
    C.id,
    C.step,
    C.version,
    C.state,
    C.kind,
    C.base_id,
    C.parent_id,
    C.metrics,
    C.tags,
    C.logical_bytes,
    C.stored_bytes,
    C.manifest_digest,
    C.codec,
    C.lossy,
    C.error_bound,
    C.lossy_scope,
    C.pinned,
    C.writer,
    C.created_at,
    C.committed_at,
    C.part_hosts,
)

# The scalar columns a record is built from, in the order _record unpacks them; run name,
# experiment name and the document follow.
_SCALARS = (
    "id", "step", "version", "state", "kind", "base_id", "parent_id", "logical_bytes",
    "stored_bytes", "manifest_digest", "codec", "lossy", "error_bound", "pinned", "writer",
    "created_at", "committed_at",
)
# The JSON columns the document starts with, in the order _record unpacks them.
_DOCUMENT_COLUMNS = ("metrics", "tags", "lossy_scope", "part_hosts")


class _json_rows(FunctionElement[str]):
    """The JSON array of one value per row of its group (an aggregate)."""

    type = Text()
    inherit_cache = True


class _json_tuple(FunctionElement[str]):
    """A JSON array of its arguments."""

    type = Text()
    inherit_cache = True


@compiles(_json_rows, "sqlite")
def _json_rows_sqlite(element: _json_rows, compiler: SQLCompiler, **kw: Any) -> str:
    return f"json_group_array({compiler.process(element.clauses, **kw)})"


@compiles(_json_rows, "postgresql")
def _json_rows_pg(element: _json_rows, compiler: SQLCompiler, **kw: Any) -> str:
    return f"json_agg({compiler.process(element.clauses, **kw)})"


@compiles(_json_tuple, "sqlite")
def _json_tuple_sqlite(element: _json_tuple, compiler: SQLCompiler, **kw: Any) -> str:
    return f"json_array({compiler.process(element.clauses, **kw)})"


@compiles(_json_tuple, "postgresql")
def _json_tuple_pg(element: _json_tuple, compiler: SQLCompiler, **kw: Any) -> str:
    return f"json_build_array({compiler.process(element.clauses, **kw)})"


def _text(sql: str) -> ColumnElement[str]:
    return literal_column(sql, Text)


def _document(source: FromClause) -> ColumnElement[str]:
    """The row's document: ``[metrics, tags, lossy_scope, part_hosts, replicas, aliases]``.

    SQL NULL becomes JSON ``null`` (an empty list for the two subqueries: PostgreSQL's
    ``json_agg`` of no rows is NULL), so the text is always one valid JSON array.
    """
    cid = source.c.id
    # Own aliases of both tables, correlated to the source alone: a statement that also
    # joins aliases (resolving an alias) or replicas must not capture the subqueries.
    rep = ReplicaRow.__table__.alias("attached_replicas")
    ali = AliasRow.__table__.alias("attached_aliases")
    replicas = (
        select(
            _json_rows(
                _json_tuple(
                    rep.c.tier, rep.c.uri, rep.c.state, rep.c.bytes, rep.c.verified_at,
                    rep.c.manifest_digest,
                )
            )
        )
        .where(rep.c.checkpoint_id == cid)
        .correlate(source)
        .scalar_subquery()
    )
    aliases = (
        select(_json_rows(ali.c.name))
        .where(ali.c.checkpoint_id == cid)
        .correlate(source)
        .scalar_subquery()
    )
    parts: list[ColumnElement[str]] = [
        func.coalesce(cast(source.c[name], Text), _text("'null'")) for name in _DOCUMENT_COLUMNS
    ]
    parts += [
        func.coalesce(cast(replicas, Text), _text("'[]'")),
        func.coalesce(cast(aliases, Text), _text("'[]'")),
    ]
    document = _text("'['")
    for i, part in enumerate(parts):
        document = document + (part if i == 0 else _text("','") + part)
    return (document + _text("']'")).label("document")


def checkpoint_query_from(source: FromClause) -> Select[Any]:
    """Like :func:`checkpoint_query`, reading the checkpoint columns from ``source``.

    ``source`` (a CTE, typically) must carry every column of :data:`ROW_COLUMNS` plus
    ``run_id`` under their own names: a recursive walk that already fetched each row then
    needs no second lookup per row.
    """
    return (
        select(
            *(source.c[name] for name in _SCALARS),
            RunRow.name.label("run_name"),
            ExperimentRow.name.label("experiment_name"),
            _document(source),
        )
        .select_from(source)
        .join(RunRow, source.c.run_id == RunRow.id)
        .outerjoin(ExperimentRow, RunRow.experiment_id == ExperimentRow.id)
    )


def checkpoint_query() -> Select[Any]:
    """``SELECT`` of everything a :class:`Checkpoint` needs, before filters and ordering."""
    return checkpoint_query_from(CheckpointRow.__table__)


def _utc(text: str | None) -> datetime | None:
    # SQLite's text has no zone (stored as UTC); PostgreSQL's JSON carries the session's.
    return None if text is None else parse_utc(text)


def _replicas(rows: list[list[Any]]) -> tuple[Replica, ...]:
    replicas = [
        Replica(
            tier=tier,
            uri=uri,
            state=_REPLICA_STATES[state],
            bytes=size,
            verified_at=_utc(verified_at),
            manifest_digest=digest,
        )
        for tier, uri, state, size, verified_at, digest in rows
    ]
    if len(replicas) > 1:
        replicas.sort(key=lambda rep: (_TIER_RANK.get(rep.tier, len(_TIER_RANK)), rep.tier))
    return tuple(replicas)


def _record(row: Sequence[Any], attachments: bool) -> Checkpoint:
    # Unpacked positionally (the order of _SCALARS): far cheaper than row.<name> lookups.
    (
        cid,
        step,
        version,
        state,
        kind,
        base_id,
        parent_id,
        logical_bytes,
        stored_bytes,
        manifest_digest,
        codec,
        lossy,
        error_bound,
        pinned,
        writer,
        created_at,
        committed_at,
        run_name,
        experiment_name,
        document,
    ) = row
    metrics, tags, lossy_scope, part_hosts, replicas, aliases = json.loads(document)
    if attachments:
        if len(aliases) > 1:
            aliases.sort()
        attached: tuple[Replica, ...] = _replicas(replicas) if replicas else ()
    else:
        aliases, attached = (), ()
    # The record's fields set as its __dict__ in one step: the frozen dataclass's __init__
    # sets its 25 fields one object.__setattr__ at a time, 3.4 us a record against 0.3 (0.3
    # ms of a 100-record listing). tests/catalog/test_records_loading.py checks that every
    # field is set and that the record equals the constructor's.
    record = _new_record(Checkpoint)
    record.__dict__.update(
        id=cid,
        run=run_name,
        step=step,
        version=version,
        state=state,
        created_at=created_at,
        kind=kind,
        base_id=base_id,
        parent_id=parent_id,
        experiment=experiment_name,
        committed_at=committed_at,
        metrics=metrics or {},
        tags=tuple(tags) if tags else (),
        logical_bytes=logical_bytes,
        stored_bytes=stored_bytes,
        codec=codec,
        manifest_digest=manifest_digest,
        lossy=bool(lossy),
        error_bound=error_bound,
        lossy_scope=tuple(lossy_scope) if lossy_scope else (),
        pinned=bool(pinned),
        aliases=tuple(aliases),
        replicas=attached,
        writer=writer,
        hosts=tuple(part_hosts) if part_hosts else (),
    )
    return record


def load_rows(rows: Sequence[Row[Any]], *, attachments: bool = True) -> list[Checkpoint]:
    """Records of rows a :func:`checkpoint_query`-based statement returned, in row order.

    The cyclic garbage collector is paused while they are built (:mod:`ckptstore.format.
    gcpause`): the records hold no cycles, and a 1,000-record lineage otherwise allocated
    enough to trigger full collections over every live object of the process, which made
    its p99 several times its median.
    """
    with gc_paused():
        return [_record(r, attachments) for r in rows]


def load_checkpoints(
    session: Reader,
    stmt: Select[Any],
    params: Mapping[str, Any] | None = None,
    *,
    attachments: bool = True,
) -> list[Checkpoint]:
    """Run a :func:`checkpoint_query`-based statement and build full records, in row order.

    Args:
        session: Open session (inside the caller's transaction), or a connection.
        stmt: A statement built from :func:`checkpoint_query`.
        params: Values of the statement's bind parameters, if it has any.
        attachments: Fill in aliases and replicas; internal callers that only need the
            row itself (ids, states) skip building them.

    Returns:
        One :class:`Checkpoint` per row, with tags, aliases and replicas filled in.
    """
    # Through the Connection, not Session.execute: plain Core rows skip the ORM's per-row
    # result machinery, which dominated loading long lineages.
    conn = session if isinstance(session, Connection) else session.connection()
    rows = conn.execute(stmt, params).all()
    return load_rows(rows, attachments=attachments) if rows else []


_BY_ID = checkpoint_query().where(C.id == bindparam("cid"))


def load_by_id(session: Reader, cid: str, *, attachments: bool = True) -> Checkpoint | None:
    """The checkpoint with this id in any state, or None."""
    return load_one(session, _BY_ID, {"cid": cid}, attachments=attachments)


def load_one(
    session: Reader,
    stmt: Select[Any],
    params: Mapping[str, Any] | None = None,
    *,
    attachments: bool = True,
) -> Checkpoint | None:
    """Like :func:`load_checkpoints` for a statement that matches at most one row."""
    found = load_checkpoints(session, stmt, params, attachments=attachments)
    return found[0] if found else None
