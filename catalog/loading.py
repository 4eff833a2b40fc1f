"""Turning catalog rows into the plain records of :mod:`ckptstore.records`.

Reads select plain columns (Core rows, no ORM identity map): loading a 1,000-deep lineage or a
page of a listing is dominated by object construction, and Core rows are several times cheaper
than ORM instances. A list of N checkpoints costs two queries whatever N is: the checkpoints
themselves (joined with run and experiment; tags and metrics ride along as JSON copies), then
the aliases and replicas of all of them in one ``UNION ALL``. The ids travel as ONE bound
value (a PostgreSQL array, a JSON array that SQLite unpacks with ``json_each``) rather than an
``IN`` list of N parameters, whose rendering and binding cost more than the query for N in the
thousands.

Statements on hot paths are built once at import with bind parameters: SQLAlchemy's
statement construction costs more than executing an indexed point query.
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Mapping, Sequence
from typing import Any
from typing import cast as typing_cast

from sqlalchemy import (
    BigInteger,
    DateTime,
    FromClause,
    Row,
    Select,
    String,
    Text,
    bindparam,
    cast,
    column,
    func,
    literal_column,
    null,
    select,
    true,
    union_all,
)
from sqlalchemy.dialects import postgresql
from sqlalchemy.orm import Session

from ckptstore.catalog.models import (
    AliasRow,
    CheckpointRow,
    ExperimentRow,
    ReplicaRow,
    RunRow,
)
from ckptstore.records import Checkpoint, Replica

__all__ = [
    "ROW_COLUMNS",
    "checkpoint_query",
    "checkpoint_query_from",
    "load_by_id",
    "load_checkpoints",
    "load_one",
]


# Replicas are shown fastest tier first; unknown tier names follow, alphabetically.
_TIER_RANK = {"hot": 0, "warm": 1, "cold": 2}

C = CheckpointRow

# The checkpoint's own columns, in the order _record unpacks them.
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
_COLUMNS = (
    *ROW_COLUMNS,
    RunRow.name.label("run_name"),
    ExperimentRow.name.label("experiment_name"),
)


def checkpoint_query_from(source: FromClause) -> Select[Any]:
    """Like :func:`checkpoint_query`, reading the checkpoint columns from ``source``.

    ``source`` (a CTE, typically) must carry every column of :data:`ROW_COLUMNS` plus
    ``run_id`` under their own names: a recursive walk that already fetched each row then
    needs no second lookup per row.
    """
    return (
        select(
            *(source.c[col.key] for col in ROW_COLUMNS),
            RunRow.name.label("run_name"),
            ExperimentRow.name.label("experiment_name"),
        )
        .select_from(source)
        .join(RunRow, source.c.run_id == RunRow.id)
        .outerjoin(ExperimentRow, RunRow.experiment_id == ExperimentRow.id)
    )


def checkpoint_query() -> Select[Any]:
    """``SELECT`` of everything a :class:`Checkpoint` needs, before filters and ordering."""
    return (
        select(*_COLUMNS)
        .join(RunRow, C.run_id == RunRow.id)
        .outerjoin(ExperimentRow, RunRow.experiment_id == ExperimentRow.id)
    )


def _per_id(dialect: str, columns: Sequence[Any], key: Any, *, probe: bool = True) -> Select[Any]:
    """``SELECT columns`` for every id of the bound list, driven by that list.

    The ids are a table to join FROM, so each branch probes the ``checkpoint_id`` indexes
    once per id. On PostgreSQL the probe is a LATERAL subquery: with a plain join (or
    ``= ANY(array)``) the planner preferred scanning the whole table under the default
    ``random_page_cost``, which cost up to 30 ms on a 100,000-checkpoint catalog where 100
    or 1,000 index probes take well under a millisecond. ``probe=False`` leaves the join
    strategy to the planner, for tables that stay small (aliases).
    """
    if dialect == "postgresql":
        array = bindparam("ids", type_=postgresql.ARRAY(String))
        ids = func.unnest(array).table_valued(column("id", String)).render_derived("ids")
        if not probe:
            return select(*columns).select_from(ids.join(key.table, key == ids.c.id))
        # OFFSET 0 keeps PostgreSQL from flattening the LATERAL subquery back into a plain
        # join (which it would again plan as a hash join over a full table scan).
        per_id = select(*columns).where(key == ids.c.id).offset(0).lateral()
        return select(*per_id.c).select_from(ids.join(per_id, true()))
    each = func.json_each(bindparam("ids", type_=String)).table_valued(column("value", String))
    return select(*columns).select_from(each.join(key.table, key == each.c.value))


def _attachment_query(dialect: str) -> Select[Any]:
    # Aliases and replicas of many checkpoints in ONE round trip (tags come with the row).
    # Replicas come first so the UNION's column types (state enum, UTC timestamps) are the
    # replica columns'; the alias branch fills those columns with NULL.
    # Typed NULLs: PostgreSQL turns an untyped NULL of a subquery into text, which then
    # cannot be UNIONed with the replica branch's timestamp and bigint columns.
    nulls = [
        cast(null(), Text()).label("uri"),
        cast(null(), String(16)).label("state"),
        cast(null(), BigInteger()).label("bytes"),
        cast(null(), DateTime(timezone=True)).label("verified_at"),
        cast(null(), String(128)).label("manifest_digest"),
    ]
    replicas = _per_id(
        dialect,
        [
            ReplicaRow.checkpoint_id,
            literal_column("'r'", String).label("what"),
            ReplicaRow.tier.label("name"),
            ReplicaRow.uri,
            ReplicaRow.state,
            ReplicaRow.bytes,
            ReplicaRow.verified_at,
            ReplicaRow.manifest_digest,
        ],
        ReplicaRow.checkpoint_id,
    )
    aliases = _per_id(
        dialect,
        [
            AliasRow.checkpoint_id,
            literal_column("'a'", String).label("what"),
            AliasRow.name.label("name"),
            *nulls,
        ],
        AliasRow.checkpoint_id,
        # A handful of user labels: hashing the whole table beats a probe per checkpoint.
        probe=False,
    )
    return select(union_all(replicas, aliases).subquery())


# Built once: constructing a statement costs more than running it on an indexed table.
_ATTACHMENTS = {name: _attachment_query(name) for name in ("sqlite", "postgresql")}


def _attachments(
    session: Session, ids: Sequence[str]
) -> tuple[dict[str, list[str]], dict[str, list[Replica]]]:
    aliases: dict[str, list[str]] = defaultdict(list)
    replicas: dict[str, list[Replica]] = defaultdict(list)
    conn = session.connection()
    dialect = conn.dialect.name
    value = list(ids) if dialect == "postgresql" else json.dumps(list(ids))
    # fetchall + tuple unpacking: Row attribute access by name costs ~1 us per field.
    for cid, what, name, uri, state, size, verified_at, digest in conn.execute(
        _ATTACHMENTS[dialect], {"ids": value}
    ).all():
        if what == "a":
            aliases[cid].append(name)
        else:
            replicas[cid].append(
                Replica(tier=name, uri=uri, state=state, bytes=size, verified_at=verified_at,
                        manifest_digest=digest)
            )
    for names in aliases.values():
        names.sort()
    for reps in replicas.values():
        reps.sort(key=lambda rep: (_TIER_RANK.get(rep.tier, len(_TIER_RANK)), rep.tier))
    return aliases, replicas


def _record(row: Row[Any], aliases: list[str], replicas: list[Replica]) -> Checkpoint:
    # Unpacked positionally (same order as _COLUMNS): far cheaper than row.<name> lookups.
    (
        cid,
        step,
        version,
        state,
        kind,
        base_id,
        parent_id,
        metrics,
        tags,
        logical_bytes,
        stored_bytes,
        manifest_digest,
        codec,
        lossy,
        error_bound,
        lossy_scope,
        pinned,
        writer,
        created_at,
        committed_at,
        part_hosts,
        run_name,
        experiment_name,
    ) = typing_cast("tuple[Any, ...]", row)
    return Checkpoint(
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
        tags=tuple(tags or ()),
        logical_bytes=logical_bytes,
        stored_bytes=stored_bytes,
        codec=codec,
        manifest_digest=manifest_digest,
        lossy=bool(lossy),
        error_bound=error_bound,
        lossy_scope=tuple(lossy_scope or ()),
        pinned=bool(pinned),
        aliases=tuple(aliases),
        replicas=tuple(replicas),
        writer=writer,
        hosts=tuple(part_hosts or ()),
    )


def load_checkpoints(
    session: Session,
    stmt: Select[Any],
    params: Mapping[str, Any] | None = None,
    *,
    attachments: bool = True,
) -> list[Checkpoint]:
    """Run a :func:`checkpoint_query`-based statement and build full records, in row order.

    Args:
        session: Open session (inside the caller's transaction).
        stmt: A statement built from :func:`checkpoint_query`.
        params: Values of the statement's bind parameters, if it has any.
        attachments: Load aliases and replicas; internal callers that only need the
            row itself (ids, states) skip that query.

    Returns:
        One :class:`Checkpoint` per row, with tags, aliases and replicas filled in.
    """
    # Through the Connection, not Session.execute: plain Core rows skip the ORM's per-row
    # result machinery, which dominated loading long lineages.
    rows = session.connection().execute(stmt, params).all()
    if not rows:
        return []
    if not attachments:
        return [_record(r, [], []) for r in rows]
    aliases, replicas = _attachments(session, [r[0] for r in rows])
    none: list[Any] = []
    return [_record(r, aliases.get(r[0], none), replicas.get(r[0], none)) for r in rows]


_BY_ID = checkpoint_query().where(C.id == bindparam("cid"))


def load_by_id(session: Session, cid: str, *, attachments: bool = True) -> Checkpoint | None:
    """The checkpoint with this id in any state, or None."""
    return load_one(session, _BY_ID, {"cid": cid}, attachments=attachments)


def load_one(
    session: Session,
    stmt: Select[Any],
    params: Mapping[str, Any] | None = None,
    *,
    attachments: bool = True,
) -> Checkpoint | None:
    """Like :func:`load_checkpoints` for a statement that matches at most one row."""
    found = load_checkpoints(session, stmt, params, attachments=attachments)
    return found[0] if found else None
