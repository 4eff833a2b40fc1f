"""Filters on a run's recorded config: ``config.lr<1e-3``, ``config.optim.name==adam``.

The config is the ``runs.config`` JSON column (filled from the run's context, see
:mod:`ckptstore.catalog.contexts`). A filter is a dotted key path, an operator and a value;
the path and value are bound parameters, the operator comes from a fixed table, so user
input never becomes SQL text. Each comparison is guarded by the JSON type of the value at
the path (``json_type`` on SQLite, ``jsonb_typeof`` on PostgreSQL): a run whose value is a
string never fails a numeric comparison, it simply does not match. Equality on PostgreSQL is
JSONB containment (``config @> '{"optim": "adam"}'``), which the column's GIN index serves,
and a numeric comparison is an SQL/JSON path test (:func:`_number_path`).

Checkpoint listings apply the filters to runs (``checkpoints.run_id IN (SELECT id FROM
runs WHERE ...)``): there is one row per run, and the checkpoints of the matching runs are
then read through the ``(run_id, ...)`` indexes.
"""

from __future__ import annotations

import json
import math
import operator
import re
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any, cast

from sqlalchemy import Boolean, ColumnElement, String, bindparam, case, func, type_coerce
from sqlalchemy.dialects.postgresql import JSONB, JSONPATH

from ckptstore.catalog.models import RunRow
from ckptstore.errors import InvalidNameError

__all__ = [
    "CONFIG_OPS", "config_clauses", "config_template", "parse_config_filter", "template_clauses",
]

#: Comparison operators of config filters.
CONFIG_OPS: dict[str, Callable[[Any, Any], ColumnElement[bool]]] = {
    "<=": operator.le, ">=": operator.ge, "==": operator.eq, "!=": operator.ne,
    "<": operator.lt, ">": operator.gt,
}
_MAX_FILTERS = 16
_KEY = r"[A-Za-z0-9_][A-Za-z0-9_\-]*"
_FILTER = re.compile(rf"^\s*config\.({_KEY}(?:\.{_KEY})*)\s*(<=|>=|==|!=|<|>)\s*(.*?)\s*\Z",
                     re.ASCII)


def parse_config_filter(text: str) -> tuple[str, tuple[str, Any]]:
    """``"config.lr<1e-3"`` → ``("config.lr", ("<", 0.001))``.

    The value is read as JSON (numbers, ``true``/``false``, ``null``, ``"quoted"``),
    anything else as a plain string.

    Raises:
        InvalidNameError: If the text is not ``config.<key>[.<key>...]<op><value>``.
    """
    match = _FILTER.match(text) if isinstance(text, str) else None
    if not match or not match.group(3):
        raise InvalidNameError(
            f"cannot parse config filter {text!r}: write config.<key>[.<key>]<op><value> "
            "with op one of < <= > >= == !=, e.g. 'config.lr<1e-3' or "
            "'config.optimizer==adam'")
    raw = match.group(3)
    try:
        value: Any = json.loads(raw)
    except ValueError:
        value = raw
    return f"config.{match.group(1)}", (match.group(2), value)


def _filters(where: object) -> list[tuple[str, tuple[str, Any]]]:
    if isinstance(where, str):
        return [parse_config_filter(where)]
    if isinstance(where, Mapping):
        return [(str(k), tuple(v)) for k, v in where.items()]  # type: ignore[misc]
    if isinstance(where, Sequence):
        return [parse_config_filter(w) for w in where]
    raise InvalidNameError(f"where must be a text, a list of texts or a mapping, not {where!r}")


def _checked(where: object) -> list[tuple[tuple[str, ...], str, Any]]:
    """``where`` as checked ``(path, op, value)`` filters.

    Raises:
        InvalidNameError: For a bad path, operator or value.
    """
    filters = _filters(where)
    if len(filters) > _MAX_FILTERS:
        raise InvalidNameError(f"at most {_MAX_FILTERS} config filters, got {len(filters)}")
    checked = []
    for key, spec in filters:
        if not re.fullmatch(rf"config\.{_KEY}(?:\.{_KEY})*", key, re.ASCII):
            raise InvalidNameError(f"config filter key must be config.<key>[.<key>], "
                                   f"not {key!r}")
        if len(spec) != 2 or spec[0] not in CONFIG_OPS:
            raise InvalidNameError(f"config filter for {key!r} must be (op, value) with op "
                                   f"one of {' '.join(CONFIG_OPS)}, got {spec!r}")
        op, value = spec
        if not (value is None or isinstance(value, bool | int | float | str)):
            # Not left to PostgreSQL's containment, which would take [1] as "holds 1".
            raise InvalidNameError(f"{key}: cannot compare with {value!r}: "
                                   "give a number, a string, true, false or null")
        if isinstance(value, bool | str) and op not in ("==", "!="):
            kind = "booleans" if isinstance(value, bool) else "strings"
            raise InvalidNameError(f"{key}: {kind} compare with == or !=, not {op}")
        if isinstance(value, int | float) and not math.isfinite(value):
            # json.loads reads NaN and Infinity; no JSON document holds them.
            raise InvalidNameError(f"{key}: cannot compare with {value!r}: give a finite number")
        if value is None and op not in ("==", "!="):
            raise InvalidNameError(f"{key}: cannot compare with {value!r}")
        checked.append((tuple(key.split(".")[1:]), op, value))
    return checked


def config_clauses(where: object, dialect: str) -> list[ColumnElement[bool]]:
    """SQL conditions on ``runs.config`` for ``where`` (see :func:`parse_config_filter`),
    their values bound.

    Raises:
        InvalidNameError: For a bad path, operator or value.
    """
    checked = _checked(where)
    if dialect == "sqlite":
        return [_sqlite_clause(path, op, value) for path, op, value in checked]
    shapes, values = _pg_template(checked)
    return [_pg_clause(shape, values) for shape in shapes]


def config_template(where: object) -> tuple[tuple[Hashable, ...], dict[str, Any]]:
    """PostgreSQL: ``where`` as the *shapes* of its conditions and their parameters' values.

    Filters that differ only in their values (``config.seed==3``, ``config.seed==4``) have
    the same shapes, so a statement built once from :func:`template_clauses` serves all of
    them with the values bound at execution.

    Raises:
        InvalidNameError: For a bad path, operator or value.
    """
    return _pg_template(_checked(where))


def template_clauses(shapes: tuple[Hashable, ...]) -> list[ColumnElement[bool]]:
    """PostgreSQL: the conditions of :func:`config_template`'s shapes, values unbound."""
    return [_pg_clause(shape, None) for shape in shapes]


def _sqlite_clause(path: tuple[str, ...], op: str, value: Any) -> ColumnElement[bool]:
    json_path = "$" + "".join(f'."{p}"' for p in path)
    kind: Any = func.json_type(RunRow.config, json_path)
    # SQLite's AND stops at a false type check, and json_extract yields the SQL value itself
    # (never an error), so no CASE guard: each run's config is then parsed at most twice per
    # filter (its type, its value) instead of three times.
    extracted: Any = func.json_extract(RunRow.config, json_path)
    if isinstance(value, bool):
        truth = extracted == 1
        return cast("ColumnElement[bool]", kind.in_(("true", "false")) & (
            truth if (op == "==") == value else ~truth))
    if isinstance(value, int | float):
        return cast("ColumnElement[bool]", kind.in_(("integer", "real")) & CONFIG_OPS[op](
            extracted, float(value)))
    if isinstance(value, str):
        return cast("ColumnElement[bool]", (kind == "text") & CONFIG_OPS[op](extracted, value))
    null = kind == "null"
    return cast("ColumnElement[bool]", null if op == "==" else ~null)


def _pg_template(
    checked: list[tuple[tuple[str, ...], str, Any]],
) -> tuple[tuple[Hashable, ...], dict[str, Any]]:
    shapes: list[Hashable] = []
    values: dict[str, Any] = {}
    for i, (path, op, value) in enumerate(checked):
        name = f"config_value_{i}"
        if op == "==" and value is not None:
            # Containment, which the GIN index on runs.config serves (models.py); jsonb
            # compares numbers as numbers, so 1e-3 finds 0.001.
            nested: Any = value
            for part in reversed(path):
                nested = {part: nested}
            shapes.append(("contains", name))
            values[name] = nested
        elif isinstance(value, bool) or value is None:
            shapes.append(("boolean" if value is not None else "null", path, op, value))
        elif isinstance(value, int | float):
            shapes.append(("number", name))
            values[name] = _number_path(path, op, value)
        else:
            shapes.append(("string", path, op, name))
            values[name] = value
    return tuple(shapes), values


def _number_path(path: tuple[str, ...], op: str, value: float) -> str:
    """A numeric comparison on PostgreSQL as one SQL/JSON path test (``config @? path``).

    One walk of the run's config per filter, where the guarded cast (``CASE WHEN
    jsonb_typeof(...) = 'number' THEN (...)::float8 END``) walked it twice and converted
    the number through text: half the time on a table of runs. ``strict`` keeps an array
    at the path from matching through one of its elements, and the ``type()`` test keeps
    ``null != 1`` (true in SQL/JSON paths) from matching; ``@?`` turns a missing key into
    no match. The path text is built from checked keys (letters, digits, ``_``, ``-``) and
    a finite number's JSON text, and bound as a parameter.
    """
    keys = "".join(f'."{part}"' for part in path)
    return f'strict ${keys} ? (@.type() == "number" && @ {op} {json.dumps(value)})'


def _pg_clause(shape: Hashable, values: Mapping[str, Any] | None) -> ColumnElement[bool]:
    """One condition of a :func:`_pg_template` shape; its parameter carries its value from
    ``values``, or none (bound at execution) when ``values`` is None."""
    kind, *rest = cast("tuple[Any, ...]", shape)

    def value(name: str, type_: Any) -> Any:
        return bindparam(name, values[name] if values is not None else None, type_=type_)

    config = type_coerce(RunRow.config, JSONB)
    if kind == "contains":
        return config.contains(value(rest[0], JSONB))
    if kind == "number":
        return cast("ColumnElement[bool]", config.op("@?", return_type=Boolean)(
            value(rest[0], JSONPATH)))
    path, op = rest[0], rest[1]
    element = RunRow.config[path]
    json_type = func.jsonb_typeof(element)
    if kind == "boolean":
        truth = element.as_boolean()
        return cast("ColumnElement[bool]", (json_type == "boolean") & (
            truth if (op == "==") == rest[2] else ~truth))
    if kind == "null":
        null = json_type == "null"
        return null if op == "==" else ~null
    # PostgreSQL may evaluate an extraction before the type check: the CASE keeps any other
    # type from reaching the comparison (NULL never matches).
    string = case((json_type == "string", element.as_string()), else_=None)
    return CONFIG_OPS[op](string, value(rest[2], String))
