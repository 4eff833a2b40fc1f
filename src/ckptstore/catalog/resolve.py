"""Resolving checkpoint references, and error messages that say what does exist.

Only COMMITTED checkpoints resolve. The one exception is a reference by id: the row is found
in any state, and a PENDING/FAILED row raises :class:`IncompleteCheckpointError` (the save never
finished) while a DELETING/DELETED one raises :class:`CheckpointNotFoundError` saying it was
pruned, because "does not exist" would send the user looking in the wrong place.

When nothing matches, the error lists what the run does have (steps, versions, metrics), so
the next attempt can be right.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sqlalchemy import Select, bindparam, func, select

from ckptstore.catalog.checks import check_step, check_version
from ckptstore.catalog.core import name_list, names_hint, runs_hint
from ckptstore.catalog.loading import Reader, checkpoint_query, load_by_id, load_one
from ckptstore.catalog.models import AliasRow, CheckpointMetricRow, CheckpointRow, RunRow
from ckptstore.errors import CheckpointNotFoundError, IncompleteCheckpointError
from ckptstore.records import Checkpoint, CheckpointState
from ckptstore.refs import Ref

__all__ = ["ensure_committed", "resolve", "resolve_any", "summarise_numbers"]

C = CheckpointRow
COMMITTED = CheckpointState.COMMITTED


# Each reference is resolved in two nested steps inside ONE statement: a narrow inner query
# finds the id on an index (run_id, state, version) or (run_id, name, value) and stops at the
# first row, then the outer query loads that single wide row. Joining runs by name in the
# outer query instead made PostgreSQL fetch and sort every checkpoint of the run.
_RUN_ID = select(RunRow.id).where(RunRow.name == bindparam("run")).scalar_subquery()


def _load_first(inner: Select[Any]) -> Select[Any]:
    return checkpoint_query().where(C.id == inner.limit(1).scalar_subquery())


def _committed_id() -> Select[Any]:
    return select(C.id).where(C.run_id == _RUN_ID, C.state == COMMITTED)


def _best(mode: str) -> Select[Any]:
    metric = CheckpointMetricRow
    order = metric.value.desc() if mode == "max" else metric.value.asc()
    # Walks the (run_id, name, value) index in value order; the newest version wins ties.
    return _load_first(
        select(metric.checkpoint_id)
        .join(C, C.id == metric.checkpoint_id)
        .where(
            metric.run_id == _RUN_ID,
            metric.name == bindparam("metric"),
            C.state == COMMITTED,
        )
        .order_by(order, C.version.desc())
    )


# Built once (statement construction costs more than the indexed lookups themselves).
_LATEST = _load_first(_committed_id().order_by(C.version.desc()))
_AT_STEP = _load_first(
    _committed_id().where(C.step == bindparam("step")).order_by(C.version.desc())
)
_AT_VERSION = _load_first(_committed_id().where(C.version == bindparam("version")))
_BY_ALIAS = (
    checkpoint_query()
    .join(AliasRow, AliasRow.checkpoint_id == C.id)
    .where(AliasRow.name == bindparam("alias"))
)
_BEST_MIN = _best("min")
_BEST_MAX = _best("max")


def summarise_numbers(
    values: Sequence[int], *, around: int | None = None, limit: int = 20, prefix: str = ""
) -> str:
    """Sorted numbers as text; long lists keep the ``limit`` nearest to ``around``."""
    ordered = sorted(set(values))
    if len(ordered) <= limit:
        return ", ".join(f"{prefix}{v}" for v in ordered)
    if around is None:
        half = limit // 2
        shown = [*ordered[:half], None, *ordered[-half:]]
    else:
        nearest = sorted(sorted(ordered, key=lambda v: (abs(v - around), v))[:limit])
        shown = [*([None] if nearest[0] != ordered[0] else []), *nearest]
        if nearest[-1] != ordered[-1]:
            shown.append(None)
    text = ", ".join("..." if v is None else f"{prefix}{v}" for v in shown)
    return f"{text} ({len(ordered)} in total)"


def ensure_committed(ck: Checkpoint, what: str | None = None) -> Checkpoint:
    """Return ``ck`` if it is COMMITTED, else raise the error that explains its state.

    Args:
        ck: The checkpoint found.
        what: How the user referred to it (defaults to its id).

    Raises:
        IncompleteCheckpointError: PENDING or FAILED (the save never completed).
        CheckpointNotFoundError: DELETING or DELETED (pruned).
    """
    if ck.state == COMMITTED:
        return ck
    label = what or f"checkpoint {ck.id}"
    where = f"run {ck.run!r} step {ck.step} (v{ck.version})"
    if ck.state == CheckpointState.PENDING:
        raise IncompleteCheckpointError(
            f"{label} of {where} was never committed (state PENDING: still being saved, or its "
            "writer died); run `ckpt gc` to clean up abandoned saves, or load "
            f"{ck.run}@latest"
        )
    if ck.state == CheckpointState.FAILED:
        raise IncompleteCheckpointError(
            f"{label} of {where} was never committed (state FAILED: its save failed); run "
            f"`ckpt gc` to remove it, or load {ck.run}@latest"
        )
    verb = "is being pruned" if ck.state == CheckpointState.DELETING else "was pruned"
    raise CheckpointNotFoundError(
        f"{label} of {where} {verb} (state {ck.state.value}); `ckpt events {ck.id}` shows "
        f"its history, {ck.run}@latest is the newest kept checkpoint"
    )


def resolve_any(session: Reader, ckpt_id: str, *, attachments: bool = True) -> Checkpoint:
    """The checkpoint with this id in any state.

    Raises:
        CheckpointNotFoundError: If no row has that id.
    """
    ck = load_by_id(session, ckpt_id, attachments=attachments)
    if ck is None:
        raise CheckpointNotFoundError(f"no checkpoint has id {ckpt_id}; {runs_hint(session)}")
    return ck


def resolve(session: Reader, ref: Ref, *, attachments: bool = True) -> Checkpoint:
    """Resolve a parsed reference to a COMMITTED checkpoint.

    Raises:
        CheckpointNotFoundError: Nothing committed matches (the message lists what exists).
        IncompleteCheckpointError: An id reference names a PENDING or FAILED checkpoint.
    """
    if ref.kind == "id":
        assert ref.id is not None
        return ensure_committed(resolve_any(session, ref.id, attachments=attachments))
    if ref.kind == "alias":
        return _resolve_alias(session, ref, attachments=attachments)
    params: dict[str, object]
    if ref.kind == "latest":
        stmt, params = _LATEST, {"run": ref.run}
    elif ref.kind == "step":
        # parse_ref bounds the numbers; a Ref built by hand is checked here, before binding.
        stmt, params = _AT_STEP, {"run": ref.run, "step": check_step(ref.step)}
    elif ref.kind == "version":
        stmt, params = _AT_VERSION, {"run": ref.run, "version": check_version(ref.version)}
    else:
        stmt = _BEST_MAX if ref.mode == "max" else _BEST_MIN
        params = {"run": ref.run, "metric": ref.metric}
    found = load_one(session, stmt, params, attachments=attachments)
    if found is None:
        raise CheckpointNotFoundError(_explain_missing(session, ref))
    return found


def _resolve_alias(session: Reader, ref: Ref, *, attachments: bool) -> Checkpoint:
    found = load_one(session, _BY_ALIAS, {"alias": ref.alias}, attachments=attachments)
    if found is None:
        known = names_hint(session, AliasRow.name, "aliases") or "no aliases are defined"
        raise CheckpointNotFoundError(
            f"no alias {ref.alias!r} ({known}); to name a checkpoint of a run use run@latest, "
            "run@<step>, run@v<version> or run@best:<metric>"
        )
    return ensure_committed(found, f"alias {ref.alias!r} -> {found.id}")


def _explain_missing(session: Reader, ref: Ref) -> str:
    run_id = session.scalar(select(RunRow.id).where(RunRow.name == ref.run))
    if run_id is None:
        return f"run {ref.run!r} does not exist; {runs_hint(session)}"
    rows = session.execute(
        select(C.step, C.version, C.state).where(C.run_id == run_id).order_by(C.version)
    ).all()
    committed = [r for r in rows if r.state == COMMITTED]
    if not committed:
        states: dict[str, int] = {}
        for r in rows:
            states[r.state.value] = states.get(r.state.value, 0) + 1
        detail = ", ".join(f"{n} {s}" for s, n in sorted(states.items())) or "none at all"
        return f"run {ref.run!r} has no committed checkpoints ({detail})"
    latest = committed[-1].version
    steps = [r.step for r in committed]
    if ref.kind == "step":
        assert ref.step is not None
        other = [r for r in rows if r.step == ref.step]
        head = (
            f"run {ref.run!r} step {ref.step} was never committed (state {other[-1].state.value})"
            if other
            else f"run {ref.run!r} has no step {ref.step}"
        )
        listing = summarise_numbers(steps, around=ref.step)
        return f"{head}; committed steps: {listing} (latest v{latest})"
    if ref.kind == "version":
        assert ref.version is not None
        other = [r for r in rows if r.version == ref.version]
        head = (
            f"run {ref.run!r} v{ref.version} is {other[0].state.value}, not committed"
            if other
            else f"run {ref.run!r} has no version v{ref.version}"
        )
        listing = summarise_numbers([r.version for r in committed], around=ref.version, prefix="v")
        return f"{head}; committed versions: {listing}"
    if ref.kind == "best":
        names = list(
            session.scalars(
                select(CheckpointMetricRow.name)
                .join(C, C.id == CheckpointMetricRow.checkpoint_id)
                .where(CheckpointMetricRow.run_id == run_id, C.state == COMMITTED)
                .group_by(CheckpointMetricRow.name)
                .order_by(CheckpointMetricRow.name)
            )
        )
        known = f"metrics recorded: {name_list(names)}" if names else "no metrics were recorded"
        return f"run {ref.run!r} has no committed checkpoint with metric {ref.metric!r}; {known}"
    count = session.scalar(select(func.count()).where(C.run_id == run_id))
    return f"run {ref.run!r} has nothing matching {ref.text!r} ({count} rows)"
