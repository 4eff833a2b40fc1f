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
from collections.abc import Callable, Mapping, Sequence
from typing import Any, cast

from sqlalchemy import Boolean, ColumnElement, bindparam, case, func, type_coerce
from sqlalchemy.dialects.postgresql import JSONB, JSONPATH

from ckptstore.catalog.models import RunRow
from ckptstore.errors import InvalidNameError

__all__ = ["CONFIG_OPS", "config_clauses", "parse_config_filter"]

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


def config_clauses(where: object, dialect: str) -> list[ColumnElement[bool]]:
    """SQL conditions on ``runs.config`` for ``where`` (see :func:`parse_config_filter`).

    Raises:
        InvalidNameError: For a bad path, operator or value.
    """
    filters = _filters(where)
    if len(filters) > _MAX_FILTERS:
        raise InvalidNameError(f"at most {_MAX_FILTERS} config filters, got {len(filters)}")
    clauses = []
    for key, spec in filters:
        if not re.fullmatch(rf"config\.{_KEY}(?:\.{_KEY})*", key, re.ASCII):
            raise InvalidNameError(f"config filter key must be config.<key>[.<key>], "
                                   f"not {key!r}")
        if len(spec) != 2 or spec[0] not in CONFIG_OPS:
            raise InvalidNameError(f"config filter for {key!r} must be (op, value) with op "
                                   f"one of {' '.join(CONFIG_OPS)}, got {spec!r}")
        op, value = spec
        clauses.append(_clause(tuple(key.split(".")[1:]), op, value, dialect))
    return clauses


def _number_path(path: tuple[str, ...], op: str, value: float) -> ColumnElement[bool]:
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
    test = f'strict ${keys} ? (@.type() == "number" && @ {op} {json.dumps(value)})'
    return cast(
        "ColumnElement[bool]",
        type_coerce(RunRow.config, JSONB).op("@?", return_type=Boolean)(
            bindparam(None, test, type_=JSONPATH)
        ),
    )


def _clause(path: tuple[str, ...], op: str, value: Any, dialect: str) -> ColumnElement[bool]:
    return cast("ColumnElement[bool]", _condition(path, op, value, dialect))


def _condition(path: tuple[str, ...], op: str, value: Any, dialect: str) -> Any:
    if not (value is None or isinstance(value, bool | int | float | str)):
        # Not left to PostgreSQL's containment, which would take [1] as "holds 1".
        raise InvalidNameError(f"config.{'.'.join(path)}: cannot compare with {value!r}: "
                               "give a number, a string, true, false or null")
    compare = CONFIG_OPS[op]
    element = RunRow.config[path]
    if dialect == "sqlite":
        json_path = "$" + "".join(f'."{p}"' for p in path)
        kind: Any = func.json_type(RunRow.config, json_path)
        numeric, text, boolean = kind.in_(("integer", "real")), kind == "text", \
            kind.in_(("true", "false"))
        # SQLite's AND stops at a false type check, and json_extract yields the SQL value
        # itself (never an error), so no CASE guard: each run's config is then parsed at
        # most twice per filter (its type, its value) instead of three times.
        extracted: Any = func.json_extract(RunRow.config, json_path)
        number: Any = extracted
        string: Any = extracted
        truth: Any = extracted == 1
    else:
        if op == "==" and value is not None:
            # Containment, which the GIN index on runs.config serves (models.py); jsonb
            # compares numbers as numbers, so 1e-3 finds 0.001.
            nested: Any = value
            for part in reversed(path):
                nested = {part: nested}
            return type_coerce(RunRow.config, JSONB).contains(nested)
        kind = func.jsonb_typeof(element)
        numeric, text, boolean = kind == "number", kind == "string", kind == "boolean"
        # PostgreSQL may evaluate the cast before the type check: the CASE keeps a string
        # from ever reaching it.
        number = case((numeric, element.as_float()), else_=None)
        string = case((text, element.as_string()), else_=None)
        truth = element.as_boolean()
    if isinstance(value, bool):
        if op not in ("==", "!="):
            raise InvalidNameError(f"config.{'.'.join(path)}: booleans compare with == or !=")
        return boolean & (truth if (op == "==") == value else ~truth)
    if isinstance(value, int | float):
        if not math.isfinite(value):
            # json.loads reads NaN and Infinity; no JSON document holds them.
            raise InvalidNameError(f"config.{'.'.join(path)}: cannot compare with "
                                   f"{value!r}: give a finite number")
        if dialect != "sqlite":
            return _number_path(path, op, value)
        # On PostgreSQL the CASE alone is the guard (NULL never matches): checking the type
        # again outside it would look the path up once more per run.
        compared = compare(number, float(value))
        return numeric & compared if dialect == "sqlite" else compared
    if isinstance(value, str):
        if op not in ("==", "!="):
            raise InvalidNameError(f"config.{'.'.join(path)}: strings compare with == or !=, "
                                   f"not {op}")
        compared = compare(string, value)
        return text & compared if dialect == "sqlite" else compared
    if value is None and op in ("==", "!="):
        null = kind == "null"
        return null if op == "==" else ~null
    raise InvalidNameError(f"config.{'.'.join(path)}: cannot compare with {value!r}")
