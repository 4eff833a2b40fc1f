"""Reading the catalog: references, listings with filters, storage usage.

User input never becomes SQL text. Filter values are bound parameters; the fields a listing
may be ordered by and the comparison operators of metric filters are looked up in fixed
tables (:data:`ORDER_FIELDS`, :data:`METRIC_OPS`), and anything else is refused with an error
naming what is allowed.
"""

from __future__ import annotations

import builtins
import functools
import json
import operator
import time
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any

from sqlalchemy import (
    BigInteger,
    ColumnElement,
    Integer,
    Select,
    String,
    any_,
    bindparam,
    column,
    exists,
    false,
    func,
    literal_column,
    select,
)
from sqlalchemy.engine import Connection
from sqlalchemy.orm import aliased

from ckptstore.catalog.checks import (
    check_checkpoint_state,
    check_count,
    check_metric_value,
    check_tags,
    check_tier,
)
from ckptstore.catalog.config_filter import config_clauses, config_template, template_clauses
from ckptstore.catalog.core import CatalogCore
from ckptstore.catalog.loading import checkpoint_query, load_checkpoints
from ckptstore.catalog.models import (
    CheckpointMetricRow,
    CheckpointRow,
    CheckpointTagRow,
    ExperimentRow,
    ReplicaRow,
    RunRow,
)
from ckptstore.catalog.pg_ids import IdArray, PackedIds
from ckptstore.catalog.resolve import resolve
from ckptstore.errors import InvalidNameError, UsageError
from ckptstore.names import validate_metric_name, validate_name
from ckptstore.records import Checkpoint, CheckpointState, ReplicaState, UsageRow
from ckptstore.refs import MAX_STEP, Ref

__all__ = ["METRIC_OPS", "ORDER_FIELDS", "QueriesMixin"]

C = CheckpointRow

#: Fields :meth:`Catalog.list` can order by (besides ``metric:<name>``).
ORDER_FIELDS: dict[str, Any] = {
    "step": C.step,
    "version": C.version,
    "created_at": C.created_at,
    "logical_bytes": C.logical_bytes,
    "stored_bytes": C.stored_bytes,
    "run": RunRow.name,
}

#: Comparison operators accepted by metric filters.
METRIC_OPS: dict[str, Callable[[Any, Any], ColumnElement[bool]]] = {
    "<": operator.lt,
    "<=": operator.le,
    ">": operator.gt,
    ">=": operator.ge,
    "==": operator.eq,
    "!=": operator.ne,
}

_ALLOWED_ORDER = ", ".join([*ORDER_FIELDS, "metric:<name>"])

# Table aliases are made once, with fixed names: a fresh aliased() per call gives every
# statement a new cache key, so SQLAlchemy recompiled each listing (1.2 ms instead of 0.25).
_MAX_TAGS = 16
_MAX_METRIC_FILTERS = 16
_TAG_ALIASES = tuple(aliased(CheckpointTagRow, name=f"tag_{i}") for i in range(_MAX_TAGS))
_METRIC_ALIASES = tuple(
    aliased(CheckpointMetricRow, name=f"metric_{i}") for i in range(_MAX_METRIC_FILTERS)
)
_ORDER_METRIC = aliased(CheckpointMetricRow, name="order_metric")


def _order_clause(stmt: Select[Any], order: str, tagged: Any = None) -> Select[Any]:
    """Order by ``order`` (checked: see :func:`_order_shape`); a metric's name is bound."""
    descending = order.startswith("-")
    field = order[1:] if descending else order
    if field == "metric:":
        metric = _ORDER_METRIC
        stmt = stmt.outerjoin(
            metric,
            (metric.checkpoint_id == C.id) & (metric.name == bindparam("order_metric")),
        )
        # Checkpoints without the metric go last in both directions (false sorts first).
        prefix: builtins.list[Any] = [metric.value.is_(None)]
        main: Any = metric.value
    elif field == "step" and tagged is not None:
        # Same values, read from the tag row: the (tag, step, run_id, version) index then
        # delivers rows already in order and the LIMIT stops the scan early.
        prefix, main = [], tagged.step
    else:
        prefix, main = [], ORDER_FIELDS[field]
    # Deterministic ties: run (in creation order: an indexed column, unlike its name), then
    # version, in the same direction as the main key.
    if field == "run":
        tail = [C.version]
    elif tagged is not None and field == "step":
        tail = [tagged.run_id, tagged.version]
    else:
        tail = [C.run_id, C.version]
    keys = [k.desc() if descending else k.asc() for k in (main, *tail)]
    return stmt.order_by(*prefix, *keys)


def _order_shape(order_by: object, params: dict[str, Any]) -> str:
    """``order_by`` checked, as it is part of a statement's shape (``[-]field`` or
    ``[-]metric:``); a metric's name goes to ``params``."""
    if not isinstance(order_by, str):
        raise UsageError(f"order_by must be a string; allowed fields: {_ALLOWED_ORDER}")
    descending = order_by.startswith("-")
    field = order_by[1:] if descending else order_by
    if field.startswith("metric:"):
        params["order_metric"] = validate_metric_name(field.removeprefix("metric:"))
        field = "metric:"
    elif field not in ORDER_FIELDS:
        raise UsageError(
            f"cannot order by {order_by!r}; allowed fields: {_ALLOWED_ORDER} "
            "(prefix '-' for descending)"
        )
    return f"-{field}" if descending else field


def _metric_shape(
    metrics: Mapping[str, tuple[str, float]], params: dict[str, Any]
) -> tuple[str, ...]:
    """The operators of the metric filters (the shape); names and values go to ``params``."""
    if not isinstance(metrics, Mapping):
        raise InvalidNameError("metrics filter must map metric name -> (operator, value)")
    if len(metrics) > _MAX_METRIC_FILTERS:
        raise InvalidNameError(f"at most {_MAX_METRIC_FILTERS} metric filters, got {len(metrics)}")
    ops: builtins.list[str] = []
    for i, (name, spec) in enumerate(metrics.items()):
        validate_metric_name(name)
        if not isinstance(spec, tuple | builtins.list) or len(spec) != 2:
            raise InvalidNameError(
                f"metric filter for {name!r} must be (operator, value), got {spec!r}"
            )
        op, value = spec
        if op not in METRIC_OPS:
            raise UsageError(
                f"unknown operator {op!r} in metric filter for {name!r}; "
                f"use one of {' '.join(METRIC_OPS)}"
            )
        params[f"metric_name_{i}"] = name
        params[f"metric_value_{i}"] = check_metric_value(name, value)
        ops.append(op)
    return tuple(ops)


def _step_shape(step_range: object, params: dict[str, Any]) -> tuple[bool, bool]:
    """Which bounds of ``step_range`` are given (the shape); their values go to ``params``."""
    if not isinstance(step_range, tuple | builtins.list) or len(step_range) != 2:
        raise InvalidNameError(f"step_range must be (low, high), got {step_range!r}")
    for bound, key in zip(step_range, ("step_low", "step_high"), strict=True):
        if bound is None:
            continue
        if isinstance(bound, bool) or not isinstance(bound, int):
            raise InvalidNameError(f"step_range bounds must be ints or None, got {bound!r}")
        params[key] = check_count(bound, "step_range bound", 0, MAX_STEP)
    return "step_low" in params, "step_high" in params


def _run_ids_clause(
    dialect: str, runs: str, matching: Select[Any] | None
) -> ColumnElement[bool]:
    """The checkpoint's run is one of the run ids bound as ONE value (``run_ids``), or, with
    ``matching`` (PostgreSQL only), one of the ids that query selects.

    One array parameter, not an ``IN`` list of N: the statement's text (and so its cached
    compilation) is the same whatever the number of matching runs. In ``"in"`` listings
    the ids are an array the ``run_id`` index is probed with; ``matching`` goes in as
    ``ARRAY(SELECT ...)``, which PostgreSQL evaluates once before the scan (an InitPlan),
    not as ``IN (SELECT ...)``, which it may plan as a join of its own choosing: one such
    plan of a config listing took 98 ms instead of 3.

    In ``"scan"`` listings ``run_id + 0`` keeps the planner off the ``run_id`` index
    (neither backend uses an index under an expression), and on PostgreSQL the test is
    ``coalesce(run_id + 0 IN (SELECT ...), false)``: inside an expression the subquery
    cannot become a join, and it is a *hashed* SubPlan, one probe per checkpoint row the
    scan passes, where ``= ANY(array)`` compared each row with every id (0.93 -> 0.66 ms
    for 100 of 1,000 runs, at 100,000 checkpoints).
    """
    scan = runs == "scan"
    run_id = C.run_id + literal_column("0") if scan else C.run_id.expression
    if dialect != "postgresql":
        each = func.json_each(bindparam("run_ids", type_=String)).table_valued(
            column("value", Integer)
        )
        return run_id.in_(select(each.c.value))
    # A typed array parameter, sent in binary (pg_ids.PackedIds). Binding the array's text
    # with a CAST in the statement instead measured slower: 10 ms instead of 6 for a config
    # listing of 500 runs at 100,000 checkpoints.
    bound = bindparam("run_ids", type_=IdArray())
    if scan:
        ids = matching if matching is not None else select(func.unnest(bound))
        return func.coalesce(run_id.in_(ids), false())
    if matching is not None:
        return run_id == any_(func.array(matching.scalar_subquery()))
    return run_id == any_(bound)


@functools.lru_cache(maxsize=256)
def _listing(
    dialect: str,
    run: bool,
    experiment: bool,
    tags: int,
    steps: tuple[bool, bool],
    metric_ops: tuple[str, ...],
    runs: str | None,
    state: bool,
    tier: bool,
    order: str,
    limit: bool,
    matching: Select[Any] | None = None,
) -> Select[Any]:
    """The listing statement of one shape, with every value a bind parameter.

    Built once per shape (a bounded cache): constructing a statement and computing its
    cache key cost more than running an indexed listing, and a statement reused as the
    same object is compiled once. ``runs`` is None, ``"in"`` (the checkpoints of the bound
    run ids, through the ``run_id`` indexes) or ``"scan"`` (through the order's index,
    keeping those of the bound runs: see :meth:`QueriesMixin._config_runs`). With
    ``matching`` (PostgreSQL: the query of the matching runs' ids, one per shape of filter,
    its values bound), the run ids are that query's instead of a bound value: one round
    trip instead of two.
    """
    stmt = checkpoint_query()
    if run:
        stmt = stmt.where(RunRow.name == bindparam("run"))
    if experiment:
        stmt = stmt.where(ExperimentRow.name == bindparam("experiment"))
    first_tag = None
    for i in range(tags):
        tagged = _TAG_ALIASES[i]
        # A JOIN, not EXISTS: the planner can then start from the tag index instead of
        # scanning every checkpoint in list order and probing its tags.
        stmt = stmt.join(
            tagged, (tagged.checkpoint_id == C.id) & (tagged.tag == bindparam(f"tag_{i}"))
        )
        first_tag = tagged if first_tag is None else first_tag
    if steps[0]:
        stmt = stmt.where(C.step >= bindparam("step_low"))
    if steps[1]:
        stmt = stmt.where(C.step <= bindparam("step_high"))
    for i, (metric, op) in enumerate(zip(_METRIC_ALIASES, metric_ops, strict=False)):
        stmt = stmt.where(
            exists().where(
                metric.checkpoint_id == C.id,
                metric.name == bindparam(f"metric_name_{i}"),
                METRIC_OPS[op](metric.value, bindparam(f"metric_value_{i}")),
            )
        )
    if runs is not None:
        stmt = stmt.where(_run_ids_clause(dialect, runs, matching))
    if state:
        stmt = stmt.where(C.state == bindparam("state"))
    if tier:
        stmt = stmt.where(
            exists().where(
                ReplicaRow.checkpoint_id == C.id,
                ReplicaRow.tier == bindparam("tier"),
                ReplicaRow.state == ReplicaState.PRESENT,
            )
        )
    stmt = _order_clause(stmt, order, first_tag)
    if limit:
        stmt = stmt.limit(bindparam("limit", type_=BigInteger))
    return stmt


def _config_runs_query(dialect: str, where: object) -> Select[Any]:
    """``SELECT id, <number of runs> FROM runs WHERE <the config filters>``.

    Filters given as text (what ``--where`` passes) are built once per text (a bounded
    cache): the construction cost more than scanning the runs. Mappings are built each
    time: their values would share cache entries across types (``1 == 1.0 == True``).

    Raises:
        InvalidNameError: For a bad filter (:func:`config_clauses`).
    """
    key = _filter_key(where)
    return _config_runs_built(dialect, where) if key is None else _config_runs_cached(dialect, key)


@functools.lru_cache(maxsize=256)
def _config_runs_cached(dialect: str, where: str | tuple[str, ...]) -> Select[Any]:
    return _config_runs_built(dialect, where)


def _config_runs_built(dialect: str, where: object) -> Select[Any]:
    total = select(func.count()).select_from(RunRow).scalar_subquery()
    return select(RunRow.id, total).where(*config_clauses(where, dialect))


@functools.lru_cache(maxsize=256)
def _config_template(
    where: str | tuple[str, ...],
) -> tuple[Select[Any], Select[Any], dict[str, Any]]:
    """PostgreSQL: the statements of a filter text, its values as parameters, and those
    values: ``SELECT id, <number of runs> FROM runs WHERE <the filters>`` (the count of
    :func:`_config_runs_query`) and ``SELECT id FROM runs WHERE ...`` (the one-statement
    listing's). The statements are built once per *shape* of filter
    (:func:`~ckptstore.catalog.config_filter.config_template`): ``config.seed==3`` and
    ``config.seed==4`` share them, and a text seen for the first time costs its parsing only.

    Raises:
        InvalidNameError: For a bad filter.
    """
    shapes, values = config_template(where)
    return _config_ids(shapes), _config_counted(shapes), values


@functools.lru_cache(maxsize=256)
def _config_ids(shapes: tuple[Hashable, ...]) -> Select[Any]:
    return select(RunRow.id).where(*template_clauses(shapes))


@functools.lru_cache(maxsize=256)
def _config_counted(shapes: tuple[Hashable, ...]) -> Select[Any]:
    total = select(func.count()).select_from(RunRow).scalar_subquery()
    return select(RunRow.id, total).where(*template_clauses(shapes))


def _filter_key(where: object) -> str | tuple[str, ...] | None:
    """The filter as a cache key: its text(s); None for mappings (see
    :func:`_config_runs_query`)."""
    if isinstance(where, str):
        return where
    if isinstance(where, Sequence) and all(isinstance(w, str) for w in where):
        return tuple(where)
    return None


#: How long a listing keeps reading a config filter's checkpoints the way its last count of
#: matching runs chose (:meth:`QueriesMixin._config_runs`) before counting them again.
_PLAN_SECONDS = 10.0
_MAX_PLANS = 256


class QueriesMixin(CatalogCore):
    """Read methods of :class:`~ckptstore.catalog.Catalog`."""

    def get(self, ref: str | Ref) -> Checkpoint:
        """Resolve a reference to a COMMITTED checkpoint.

        Args:
            ref: A uuid, ``run@latest``, ``run@<step>``, ``run@v<version>``,
                ``run@best:<metric>[:max]`` or an alias (parsed or as text).

        Returns:
            The checkpoint.

        Raises:
            InvalidNameError: If the reference cannot be parsed.
            CheckpointNotFoundError: If nothing committed matches; the message lists the
                run's committed steps / versions / metrics, or the runs when the run is unknown.
            IncompleteCheckpointError: If an id names a PENDING or FAILED checkpoint.

        Example:
            >>> catalog.get("resnet-a@best:val_loss").step  # doctest: +SKIP
            12000
        """
        parsed = self._ref(ref)
        return self._reading(lambda conn: resolve(conn, parsed))

    def latest(self, run: str) -> Checkpoint:
        """The run's COMMITTED checkpoint with the highest version (``run@latest``)."""
        return self.get(Ref(kind="latest", text=f"{run}@latest", run=validate_name(run)))

    def best(self, run: str, metric: str, mode: str = "min") -> Checkpoint:
        """The run's COMMITTED checkpoint with the lowest (``mode="min"``) or highest metric.

        Ties go to the newest version.
        """
        if mode not in ("min", "max"):
            raise InvalidNameError(f"mode must be 'min' or 'max', not {mode!r}")
        validate_name(run)
        validate_metric_name(metric)
        text = f"{run}@best:{metric}" + (":max" if mode == "max" else "")
        return self.get(
            Ref(
                kind="best",
                text=text,
                run=run,
                metric=metric,
                mode="max" if mode == "max" else "min",
            )
        )

    def list(
        self,
        *,
        run: str | None = None,
        experiment: str | None = None,
        tag: str | Sequence[str] | None = None,
        step_range: tuple[int | None, int | None] | None = None,
        metrics: Mapping[str, tuple[str, float]] | None = None,
        state: CheckpointState | str | None = CheckpointState.COMMITTED,
        tier: str | None = None,
        order_by: str = "step",
        limit: int | None = None,
        where: str | Sequence[str] | Mapping[str, tuple[str, Any]] | None = None,
    ) -> builtins.list[Checkpoint]:
        """List checkpoints matching every given filter.

        Args:
            run: Only this run.
            experiment: Only runs of this experiment.
            tag: Only checkpoints carrying this tag (or all of these tags).
            step_range: ``(low, high)``, both inclusive, None for open.
            metrics: ``{name: (op, value)}`` with op in ``< <= > >= == !=``; checkpoints
                without the metric never match.
            state: Only this state; COMMITTED by default, None for every state.
            tier: Only checkpoints with a PRESENT replica on this tier.
            order_by: ``step``, ``version``, ``created_at``, ``logical_bytes``,
                ``stored_bytes``, ``run`` or ``metric:<name>``; prefix ``-`` to descend.
                Ties are broken by run (in creation order), then version.
            limit: At most this many.
            where: Filters on the run's config (:mod:`ckptstore.catalog.config_filter`):
                ``"config.lr<1e-3"``, a list of such texts, or ``{"config.lr": ("<",
                1e-3)}``; numbers compare as numbers, strings and booleans with ``==``
                and ``!=``. Runs without the key never match.

        Returns:
            The checkpoints, ordered.

        Raises:
            InvalidNameError: If a filter value, operator or order field is not allowed.

        Example:
            >>> catalog.list(run="a", metrics={"loss": ("<", 0.5)}, order_by="-step", limit=5)
            ... # doctest: +SKIP
        """
        params: dict[str, Any] = {}
        if run is not None:
            params["run"] = validate_name(run)
        if experiment is not None:
            params["experiment"] = validate_name(experiment, "experiment name")
        if tag is not None:
            tags = check_tags(tag)
            if len(tags) > _MAX_TAGS:
                raise InvalidNameError(f"at most {_MAX_TAGS} tags per filter, got {len(tags)}")
            params.update((f"tag_{i}", t) for i, t in enumerate(tags))
        else:
            tags = ()
        steps = _step_shape(step_range, params) if step_range is not None else (False, False)
        metric_ops = _metric_shape(metrics, params) if metrics else ()
        if state is not None:
            params["state"] = check_checkpoint_state(state)
        if tier is not None:
            params["tier"] = check_tier(tier)
        order = _order_shape(order_by, params)
        if limit is not None:
            params["limit"] = check_count(limit, "limit", 1)
        key = _filter_key(where) if where else None
        ids: Select[Any] | None = None
        matching: Select[Any] | None
        if key is not None and self.dialect == "postgresql":
            ids, matching, values = _config_template(key)
            params.update(values)
        else:
            matching = _config_runs_query(self.dialect, where) if where else None
        # On PostgreSQL a filter text listed within the last _PLAN_SECONDS is read in ONE
        # statement, which selects the matching runs itself (so a run recorded meanwhile is
        # listed), reading their checkpoints the way the last count of them chose ("in" or
        # "scan"); counting them first costs a round trip and a second statement. Only that
        # choice is remembered, never which runs matched.
        plan_key = (key, limit is not None)
        remembered = self._config_plans.get(plan_key) if ids is not None else None
        folded = (
            remembered[0]
            if remembered is not None and time.monotonic() < remembered[1]
            else None
        )

        def query(conn: Connection) -> builtins.list[Checkpoint]:
            runs = folded
            if folded is None and matching is not None:
                runs = self._config_runs(conn, matching, params, limited=limit is not None)
                if runs is None:
                    return []
                if ids is not None:
                    if len(self._config_plans) >= _MAX_PLANS:
                        self._config_plans.clear()
                    self._config_plans[plan_key] = (runs, time.monotonic() + _PLAN_SECONDS)
            stmt = _listing(
                self.dialect, run is not None, experiment is not None, len(tags), steps,
                metric_ops, runs, state is not None, tier is not None, order,
                limit is not None, ids if folded is not None else None,
            )
            return load_checkpoints(conn, stmt, params)

        return self._reading(query)

    def _config_runs(
        self,
        conn: Connection,
        matching: Select[Any],
        params: dict[str, Any],
        *,
        limited: bool,
    ) -> str | None:
        """Find the runs whose config matches; bind their ids; say how to read their rows.

        ONE query over the runs table (one row per run, ``matching``: see
        :func:`_config_runs_query` and :func:`_config_template`, whose filter values are in
        ``params``) returns the matching ids and the number of runs. When
        few runs match, their checkpoints are read through the ``run_id`` indexes
        (``"in"``). When many do (a twentieth of the runs or more) and
        the listing has a limit, reading checkpoints through the listing's own order index
        and keeping those of matching runs stops after ``limit`` rows instead of gathering
        and sorting all of them (``"scan"``; with R runs of n checkpoints each, the
        break-even is about sqrt(limit * R / n) matching runs: 3% of 1,000 runs of 100 for a
        limit of 100).

        Returns:
            ``"in"`` or ``"scan"`` with ``params["run_ids"]`` set, or None when no run
            matches (nothing to list).
        """
        rows = conn.execute(matching, params).all()
        if not rows:
            return None
        ids = [row[0] for row in rows]
        params["run_ids"] = PackedIds(ids) if self.dialect == "postgresql" else json.dumps(ids)
        return "scan" if limited and len(ids) * 20 >= rows[0][1] else "in"

    def usage(self) -> builtins.list[UsageRow]:
        """Bytes of PRESENT replicas by run and tier, ordered by run then tier."""
        stmt = (
            select(
                RunRow.name,
                ReplicaRow.tier,
                func.count(),
                func.coalesce(func.sum(ReplicaRow.bytes), 0),
            )
            .join(C, ReplicaRow.checkpoint_id == C.id)
            .join(RunRow, C.run_id == RunRow.id)
            .where(ReplicaRow.state == ReplicaState.PRESENT)
            .group_by(RunRow.name, ReplicaRow.tier)
            .order_by(RunRow.name, ReplicaRow.tier)
        )
        with self._read() as s:
            return [
                UsageRow(run=name, tier=tier, checkpoints=int(n), bytes=int(total))
                for name, tier, n, total in s.execute(stmt)
            ]

    @staticmethod
    def _step_clauses(step_range: object) -> builtins.list[ColumnElement[bool]]:
        if not isinstance(step_range, tuple | builtins.list) or len(step_range) != 2:
            raise InvalidNameError(f"step_range must be (low, high), got {step_range!r}")
        clauses = []
        for bound, cmp in zip(step_range, (operator.ge, operator.le), strict=True):
            if bound is None:
                continue
            if isinstance(bound, bool) or not isinstance(bound, int):
                raise InvalidNameError(f"step_range bounds must be ints or None, got {bound!r}")
            clauses.append(cmp(C.step, check_count(bound, "step_range bound", 0, MAX_STEP)))
        return clauses
