"""Tensor key names: how a path into the state becomes one string, and key selection.

A key is the path of container keys from the root to a leaf, joined with ``/``. Each path
component is escaped so a ``/`` or ``%`` inside a dict key cannot be confused with the
separator: ``%`` becomes ``%25`` and ``/`` becomes ``%2F``. Non-string dict keys render as
``str()`` of the key (an int key ``0`` becomes ``"0"``); list and tuple positions render as
their decimal index. Examples::

    {"model": {"encoder.layer.0.weight": t}}   -> "model/encoder.layer.0.weight"
    {"optimizer": {"state": {0: {"exp_avg": t}}}} -> "optimizer/state/0/exp_avg"
    {"a/b": t}                                 -> "a%2Fb"

A bare tensor passed as the whole state has the empty key ``""``.
"""

from __future__ import annotations

import fnmatch
import logging
from collections.abc import Iterable, Sequence

__all__ = ["escape_component", "join_key", "key_matches", "render_path"]

logger = logging.getLogger(__name__)


def escape_component(component: object) -> str:
    """Render one path component (a dict key or a list index) as escaped text."""
    if isinstance(component, str):
        text = component
    elif isinstance(component, int) and not isinstance(component, bool):
        # Python limits str() of huge ints; hex has no such limit and stays unambiguous.
        try:
            text = str(component)
        except ValueError:
            text = hex(component)
    else:
        text = str(component)
    return text.replace("%", "%25").replace("/", "%2F")


def join_key(parent: str, component: object) -> str:
    """Append one component to a key."""
    escaped = escape_component(component)
    return f"{parent}/{escaped}" if parent else escaped


def render_path(key: str) -> str:
    """Return a key as shown in error messages (the root reads ``<root>``)."""
    return key if key else "<root>"


def key_matches(key: str, patterns: Sequence[str]) -> bool:
    """Whether ``key`` is selected by any fnmatch pattern.

    A pattern selects a key when it matches the whole key or any of its ancestor paths, so
    ``"model"`` selects everything under ``model/`` just like ``"model/*"``. Matching is
    case-sensitive; ``*`` also matches ``/``.
    """
    return any(_matches_one(key, pattern) for pattern in patterns)


def _matches_one(key: str, pattern: str) -> bool:
    if fnmatch.fnmatchcase(key, pattern):
        return True
    return any(fnmatch.fnmatchcase(prefix, pattern) for prefix in _ancestors(key))


def _ancestors(key: str) -> Iterable[str]:
    end = key.find("/")
    while end != -1:
        yield key[:end]
        end = key.find("/", end + 1)
