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
import string
from collections.abc import Iterable, Sequence

import blake3

__all__ = ["escape_component", "escape_node_name", "join_key", "key_matches", "render_path"]

logger = logging.getLogger(__name__)

# Characters a Zarr node name keeps as they are; everything else is %-escaped.
_NODE_SAFE = frozenset(string.ascii_letters + string.digits + "._-")
# Longer escaped names are cut and suffixed with a hash (file systems limit a name to 255).
_MAX_NODE_NAME = 160


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


def escape_node_name(name: str) -> str:
    """Zarr node name for a tensor key or a DCP fqn: injective, filesystem-safe, bounded.

    Letters, digits and ``._-`` stay; every other byte of the UTF-8 form becomes ``%XX``.
    A leading ``__`` (reserved by zarr) and the names ``.``/``..`` are escaped too. Names
    longer than 160 characters are cut and suffixed with ``~`` and a hash of the name (``~``
    never survives escaping, so this cannot collide with an escaped name).
    """
    if not name:
        return "%"  # a lone '%' is never produced by escaping a non-empty name
    out = [c if c in _NODE_SAFE else "".join(f"%{b:02X}" for b in c.encode()) for c in name]
    escaped = "".join(out)
    if escaped.startswith("__"):
        escaped = "%5F" + escaped[1:]
    if escaped in (".", ".."):
        escaped = escaped.replace(".", "%2E")
    if len(escaped) > _MAX_NODE_NAME:
        escaped = escaped[:_MAX_NODE_NAME] + "~" + blake3.blake3(name.encode()).hexdigest()[:32]
    return escaped
