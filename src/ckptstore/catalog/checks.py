"""Validation of values the catalog accepts from callers, before any SQL runs.

Names go through :mod:`ckptstore.names`; this module adds the catalog's own value rules
(metrics are finite numbers, steps are non-negative ints, states and lineage kinds come from
fixed sets). Every failure is an :class:`~ckptstore.errors.InvalidNameError` (a ``ValueError``).

Integers are also checked against the range of the column they are bound to (models.py):
``BigInteger`` columns (steps, byte counts) hold signed 64-bit values, ``Integer`` ones
(versions) signed 32-bit values. Without the check a too large value fails only in the driver,
as an ``OverflowError`` (SQLite) or ``sqlalchemy.exc.DataError`` (PostgreSQL), and differently
on each backend.
"""

from __future__ import annotations

import json
import math
import uuid
from collections.abc import Iterable, Mapping
from typing import Any

from ckptstore.errors import InvalidNameError
from ckptstore.names import validate_metric_name, validate_name, validate_tag
from ckptstore.numeric import MAX_INT64
from ckptstore.records import CheckpointState, ReplicaState
from ckptstore.refs import MAX_STEP, MAX_VERSION

__all__ = [
    "EDGE_KINDS",
    "check_checkpoint_id",
    "check_checkpoint_state",
    "check_count",
    "check_json",
    "check_edge_kind",
    "check_finite",
    "check_metric_value",
    "check_metrics",
    "check_positive",
    "check_replica_state",
    "check_step",
    "check_tags",
    "check_tier",
    "check_version",
]

#: Kinds of :meth:`Catalog.add_edge` derivation edges.
EDGE_KINDS = ("resumed-from", "fine-tuned-from", "converted-from", "merged-from")


def check_metric_value(name: str, value: object) -> float:
    """A metric value as a finite float.

    Raises:
        InvalidNameError: If the value is not a real number (bools and strings are refused)
            or is NaN or infinite, which would break ``best()`` and metric filters.
    """
    if isinstance(value, bool | str | bytes) or value is None:
        raise InvalidNameError(f"metric {name!r} must be a number, got {type(value).__name__}")
    try:
        number = float(value)  # type: ignore[arg-type]  # numpy and torch scalars too
    except OverflowError as e:  # an int beyond the float range, e.g. 10**400
        raise InvalidNameError(
            f"metric {name!r} is too large for a float column (about 1.8e308 at most)"
        ) from e
    except (TypeError, ValueError) as e:
        raise InvalidNameError(
            f"metric {name!r} must be a number, got {type(value).__name__}"
        ) from e
    if not math.isfinite(number):
        raise InvalidNameError(
            f"metric {name!r} is {number}; only finite values are catalogued "
            "(log NaN/inf losses elsewhere, or use LossMonitor)"
        )
    return number


def check_metrics(metrics: Mapping[str, object] | None) -> dict[str, float]:
    """Validate metric names and values; returns a new ``{name: float}`` dict."""
    if metrics is None:
        return {}
    if not isinstance(metrics, Mapping):
        raise InvalidNameError(f"metrics must be a mapping, got {type(metrics).__name__}")
    return {validate_metric_name(k): check_metric_value(k, v) for k, v in metrics.items()}


def check_tags(tags: Iterable[str] | str) -> tuple[str, ...]:
    """Validate tags; a bare string is one tag, duplicates are dropped, order is kept."""
    if isinstance(tags, str):
        tags = (tags,)
    return tuple(dict.fromkeys(validate_tag(t) for t in tags))


def check_count(value: object, what: str, lo: int = 0, hi: int = MAX_INT64) -> int:
    """An int in ``[lo, hi]`` (bools refused); ``hi`` is the range of the column it is bound to.

    Raises:
        InvalidNameError: If it is not an int or lies outside the range.
    """
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidNameError(f"{what} must be an int, got {_short(value)}")
    if not lo <= value <= hi:
        raise InvalidNameError(f"{what} must be between {lo} and {hi}, got {_short(value)}")
    return value


def check_step(step: object) -> int:
    """A step: a non-negative int that fits ``checkpoints.step`` (BIGINT; bools refused)."""
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise InvalidNameError(f"step must be a non-negative int, got {_short(step)}")
    if step > MAX_STEP:
        raise InvalidNameError(f"step {_short(step)} is out of range: at most {MAX_STEP}")
    return step


def check_version(version: object) -> int:
    """A version: a positive int that fits ``checkpoints.version`` (INTEGER)."""
    return check_count(version, "version", 1, MAX_VERSION)


def check_positive(value: object, what: str) -> float:
    """A finite number greater than zero (TTLs, ages)."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        raise InvalidNameError(f"{what} must be a positive number, got {_short(value)}")
    try:
        number = float(value)
    except OverflowError:  # an int beyond the float range
        number = math.inf
    if not math.isfinite(number):
        raise InvalidNameError(f"{what} must be finite, got {_short(value)}")
    return number


def check_finite(value: object, what: str) -> float:
    """A finite number >= 0 (error bounds)."""
    if isinstance(value, bool) or value is None:
        raise InvalidNameError(f"{what} must be a number, got {_short(value)}")
    try:
        number = float(value)  # type: ignore[arg-type]  # numpy and torch scalars too
    except (TypeError, ValueError, OverflowError) as e:
        raise InvalidNameError(f"{what} must be a finite number >= 0, got {_short(value)}") from e
    if not math.isfinite(number) or number < 0:
        raise InvalidNameError(f"{what} must be a finite number >= 0, got {number}")
    return number


def _short(value: object) -> str:
    # A 400-digit int makes an unreadable message; show its size instead.
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) > 2**100:
        return f"an int of {value.bit_length()} bits"
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def check_checkpoint_id(value: object) -> str:
    """A checkpoint id: a uuid, returned in canonical lowercase form."""
    if isinstance(value, uuid.UUID):
        return str(value)
    if not isinstance(value, str):
        raise InvalidNameError(f"checkpoint id must be a uuid string, got {type(value).__name__}")
    try:
        return str(uuid.UUID(value))
    except ValueError as e:
        raise InvalidNameError(f"checkpoint id {value!r} is not a uuid") from e


def check_checkpoint_state(value: object) -> CheckpointState:
    """A :class:`CheckpointState` from the enum or its name."""
    try:
        return CheckpointState(str(value))
    except ValueError as e:
        allowed = ", ".join(s.value for s in CheckpointState)
        raise InvalidNameError(f"unknown checkpoint state {value!r}; use one of {allowed}") from e


def check_replica_state(value: object) -> ReplicaState:
    """A :class:`ReplicaState` from the enum or its name."""
    try:
        return ReplicaState(str(value))
    except ValueError as e:
        allowed = ", ".join(s.value for s in ReplicaState)
        raise InvalidNameError(f"unknown replica state {value!r}; use one of {allowed}") from e


def check_tier(value: object) -> str:
    """A tier name (``hot``, ``warm``, ``cold`` or a configured one): name rules apply."""
    tier = validate_name(value, "tier")
    if len(tier) > 64:
        raise InvalidNameError(f"tier name {tier!r} is longer than 64 characters")
    return tier


def check_edge_kind(value: object) -> str:
    """A lineage edge kind from :data:`EDGE_KINDS`."""
    if value not in EDGE_KINDS:
        raise InvalidNameError(
            f"unknown lineage edge kind {value!r}; use one of {', '.join(EDGE_KINDS)}"
        )
    assert isinstance(value, str)
    return value


def check_json(value: Mapping[str, Any] | None, what: str) -> dict[str, Any]:
    """A JSON-serialisable mapping (event detail, run config), as a plain dict."""
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise InvalidNameError(f"{what} must be a mapping, got {type(value).__name__}")
    try:
        # Round-trip so what is stored is exactly what later reads return (tuples become
        # lists, keys strings), and NaN is refused: PostgreSQL's JSON type rejects it.
        loaded: dict[str, Any] = json.loads(json.dumps(dict(value), allow_nan=False))
    except (TypeError, ValueError) as e:
        raise InvalidNameError(f"{what} is not JSON-serialisable: {e}") from e
    return loaded
