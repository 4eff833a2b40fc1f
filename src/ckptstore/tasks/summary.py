"""Turn operation results into JSON-able summaries for task and flow results."""

from __future__ import annotations

import dataclasses
import enum
import logging
from datetime import datetime
from pathlib import Path
from typing import Any

__all__ = ["to_jsonable"]

logger = logging.getLogger(__name__)

_MAX_DEPTH = 8


def to_jsonable(value: Any, _depth: int = 0) -> Any:
    """Convert a report, record, path or container into plain JSON types.

    Objects with a ``to_dict()`` method use it; dataclasses are converted field by field;
    anything else unknown becomes its ``str``.

    Args:
        value: The value to convert.

    Returns:
        dicts, lists, strings, numbers, booleans and None only.
    """
    if _depth > _MAX_DEPTH:
        return str(value)
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, enum.Enum):
        return to_jsonable(value.value, _depth + 1)
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, datetime):
        return value.isoformat()
    to_dict = getattr(value, "to_dict", None)
    if callable(to_dict):
        return to_jsonable(to_dict(), _depth + 1)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {
            f.name: to_jsonable(getattr(value, f.name), _depth + 1)
            for f in dataclasses.fields(value)
        }
    if isinstance(value, dict):
        return {str(k): to_jsonable(v, _depth + 1) for k, v in value.items()}
    if isinstance(value, list | tuple | set | frozenset):
        return [to_jsonable(v, _depth + 1) for v in value]
    return str(value)
