"""The JSON skeleton ("tree") of a state: node encoding, validation, selection.

The tree keeps every non-tensor value and the container structure; tensors are replaced by
references to their key. Every node is plain JSON:

* ``null``, ``true``/``false``, strings, and numbers are themselves (ints within
  ``[-2**63, 2**64)``, finite floats; ``-0.0`` survives JSON exactly);
* other values are objects tagged with ``"t"`` (fields -> Python value):

  - ``int``: ``v`` hex string -> an int outside that range;
  - ``float``: ``v`` 16 hex digits of the IEEE-754 bits -> nan/inf (payload kept);
  - ``list`` / ``tuple``: ``v`` [nodes];
  - ``dict`` / ``odict``: ``k`` [scalar key nodes], ``v`` [nodes] -> dict / OrderedDict;
  - ``tensor`` / ``ndarray``: ``key`` tensor key -> torch.Tensor / numpy.ndarray;
  - ``bytes``: ``v`` base64;
  - ``size``: ``v`` [ints] -> torch.Size;
  - ``dtype``: ``v`` torch dtype name -> torch.dtype;
  - ``device``: ``v`` device string -> torch.device;
  - ``np``: ``dtype`` numpy dtype string, ``v`` hex of the value's bytes -> numpy scalar.

Dicts are stored as parallel key/value lists, so insertion order and non-string keys survive
a manifest serialised with sorted keys.
"""

from __future__ import annotations

import base64
import binascii
import logging
import math
import re
import struct
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from ckptstore.format.constants import MAX_TREE_DEPTH
from ckptstore.format.dtypes import DEVICE_TYPES, NUMPY_NATIVE_DTYPES, TORCH_DTYPE_ATTRS
from ckptstore.format.keys import join_key, key_matches
from ckptstore.format.validate import Invalid, short

__all__ = [
    "CONTAINER_TAGS",
    "INT_MAX",
    "INT_MIN",
    "TREE_TAGS",
    "decode_scalar",
    "encode_scalar",
    "iter_tensor_refs",
    "match_into",
    "select_tree",
    "validate_tree",
]

logger = logging.getLogger(__name__)

#: Range of ints stored as plain JSON numbers; others are tagged hex (no digit limits).
INT_MIN = -(2**63)
INT_MAX = 2**64 - 1

CONTAINER_TAGS = frozenset({"list", "tuple", "dict", "odict"})
TREE_TAGS = frozenset(
    CONTAINER_TAGS | {"int", "float", "tensor", "ndarray", "bytes", "size", "dtype", "device", "np"}
)

_HEX_INT = re.compile(r"^-?0x[0-9a-f]+$")
_HEX_BITS = re.compile(r"^[0-9a-f]{16}$")
_DTYPE_NAME = re.compile(r"^[a-z][a-z0-9_]{0,39}$")
_DEVICE = re.compile(r"^[a-z][a-z_]{0,31}(:[0-9]{1,6})?$")
_NP_DTYPE = re.compile(r"^[<>|=][biufc][0-9]{1,2}$")
_EXACT_FIELDS = {
    "int": {"t", "v"},
    "float": {"t", "v"},
    "list": {"t", "v"},
    "tuple": {"t", "v"},
    "dict": {"t", "k", "v"},
    "odict": {"t", "k", "v"},
    "tensor": {"t", "key"},
    "ndarray": {"t", "key"},
    "bytes": {"t", "v"},
    "size": {"t", "v"},
    "dtype": {"t", "v"},
    "device": {"t", "v"},
    "np": {"t", "dtype", "v"},
}


def encode_scalar(value: int | float) -> Any:
    """Encode an int or float leaf (also used for dict keys)."""
    if isinstance(value, float):
        if math.isfinite(value):
            return value
        return {"t": "float", "v": struct.pack(">d", value).hex()}
    if INT_MIN <= value <= INT_MAX:
        return value
    return {"t": "int", "v": hex(value)}


def decode_scalar(node: Any) -> Any:
    """Decode a node that may be a dict key: None, bool, int, float or str.

    Raises:
        ValueError: If ``node`` is not a scalar node.
    """
    if node is None or isinstance(node, bool | int | float | str):
        return node
    if isinstance(node, dict):
        tag = node.get("t")
        if tag == "int":
            return int(node["v"], 16)
        if tag == "float":
            return struct.unpack(">d", bytes.fromhex(node["v"]))[0]
    raise ValueError(f"not a scalar node: {short(node, 80)}")


def _children(node: Any) -> Iterator[tuple[object, Any]]:
    """Yield (path component, child node) of a container node."""
    tag = node["t"]
    if tag in ("list", "tuple"):
        yield from enumerate(node["v"])
    else:
        for key_node, child in zip(node["k"], node["v"], strict=True):
            yield decode_scalar(key_node), child


def _is_container(node: Any) -> bool:
    return isinstance(node, dict) and node.get("t") in CONTAINER_TAGS


def validate_tree(tree: Any, tensor_dtypes: Mapping[str, str]) -> None:
    """Check that ``tree`` is a well-formed skeleton whose tensor references exist.

    Args:
        tree: The decoded JSON tree.
        tensor_dtypes: Tensor key -> torch dtype name, from the manifest.

    Raises:
        Invalid: (a ValueError, see :mod:`ckptstore.format.validate`) naming the first
            problem and its path.
    """
    _validate_node(tree, "", 0, tensor_dtypes)


#: A node's path: the string, or (parent path, key) joined only when a message or a child
#: container needs it (joining every leaf's path cost as much as the checks themselves).
_Path = str | tuple[str, Any]


def _joined(path: _Path) -> str:
    return path if isinstance(path, str) else join_key(*path)


def _where(path: _Path) -> str:
    """The path for a message."""
    return _joined(path) or "<root>"


def _validate_node(node: Any, at: _Path, depth: int, tensor_dtypes: Mapping[str, str]) -> None:
    if node is None or isinstance(node, bool | str):
        return
    if isinstance(node, int):
        if not INT_MIN <= node <= INT_MAX:
            raise Invalid(f"tree {_where(at)}: plain int out of range")
        return
    if isinstance(node, float):
        if not math.isfinite(node):
            raise Invalid(f"tree {_where(at)}: non-finite float must be tagged")
        return
    if not isinstance(node, dict):
        raise Invalid(f"tree {_where(at)}: unexpected JSON {type(node).__name__}")
    tag = node.get("t")
    if not isinstance(tag, str) or tag not in TREE_TAGS:
        raise Invalid(f"tree {_where(at)}: unknown node tag {short(tag, 80)}")
    if set(node) != _EXACT_FIELDS[tag]:
        raise Invalid(f"tree {_where(at)}: node {tag!r} has fields {sorted(node)}")
    if tag in CONTAINER_TAGS:
        path = _joined(at)
        if depth >= MAX_TREE_DEPTH:
            raise Invalid(f"tree {path or '<root>'}: nested deeper than {MAX_TREE_DEPTH} "
                          "containers")
        _validate_container(node, tag, path, depth, tensor_dtypes)
        return
    _validate_leaf(node, tag, at, tensor_dtypes)


def _validate_container(
    node: dict[str, Any], tag: str, path: str, depth: int, tensor_dtypes: Mapping[str, str]
) -> None:
    values = node["v"]
    if not isinstance(values, list):
        raise Invalid(f"tree {path or '<root>'}: {tag} values must be a list")
    if tag in ("dict", "odict"):
        keys = node["k"]
        if not isinstance(keys, list) or len(keys) != len(values):
            raise Invalid(f"tree {path or '<root>'}: {tag} keys and values differ in length")
        decoded = []
        for key_node in keys:
            if _is_container(key_node) or (
                isinstance(key_node, dict) and key_node.get("t") not in ("int", "float")
            ):
                raise Invalid(f"tree {path or '<root>'}: dict key must be a scalar")
            _validate_node(key_node, path, depth + 1, tensor_dtypes)
            decoded.append(decode_scalar(key_node))
        # NaN keys are distinct objects in Python; count them by identity-free repr instead.
        if len({(type(k), repr(k)) for k in decoded}) != len(decoded):
            raise Invalid(f"tree {path or '<root>'}: duplicate dict keys")
        for key, child in zip(decoded, values, strict=True):
            _validate_node(child, (path, key), depth + 1, tensor_dtypes)
    else:
        for index, child in enumerate(values):
            _validate_node(child, (path, index), depth + 1, tensor_dtypes)


def _validate_leaf(
    node: dict[str, Any], tag: str, at: _Path, tensor_dtypes: Mapping[str, str]
) -> None:
    if tag in ("tensor", "ndarray"):
        key = node["key"]
        if not isinstance(key, str) or key not in tensor_dtypes:
            raise Invalid(f"tree {_where(at)}: reference to unknown tensor {short(key, 80)}")
        if tag == "ndarray" and tensor_dtypes[key] not in _NUMPY_NATIVE:
            raise Invalid(f"tree {_where(at)}: ndarray of dtype {tensor_dtypes[key]}")
        return
    value = node.get("v")
    ok: bool
    if tag == "int":
        ok = isinstance(value, str) and bool(_HEX_INT.match(value)) and len(value) < 100_000
    elif tag == "float":
        ok = isinstance(value, str) and bool(_HEX_BITS.match(value))
    elif tag == "bytes":
        ok = isinstance(value, str) and _is_base64(value)
    elif tag == "size":
        ok = isinstance(value, list) and all(
            isinstance(d, int) and not isinstance(d, bool) and 0 <= d < 2**63 for d in value
        )
    elif tag == "dtype":
        ok = (
            isinstance(value, str)
            and bool(_DTYPE_NAME.match(value))
            and value in TORCH_DTYPE_ATTRS
        )
    elif tag == "device":
        ok = (isinstance(value, str) and bool(_DEVICE.match(value))
              and value.partition(":")[0] in DEVICE_TYPES)
    else:  # "np"
        dtype = node.get("dtype")
        ok = (
            isinstance(dtype, str)
            and bool(_NP_DTYPE.match(dtype))
            and isinstance(value, str)
            and _np_itemsize(dtype) * 2 == len(value)
            and _is_hex(value)
        )
    if not ok:
        raise Invalid(f"tree {_where(at)}: malformed {tag!r} node {short(node, 80)}")


_NUMPY_NATIVE = frozenset(NUMPY_NATIVE_DTYPES)


def _is_base64(value: str) -> bool:
    try:
        base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        return False
    return True


def _is_hex(value: str) -> bool:
    try:
        bytes.fromhex(value)
    except ValueError:
        return False
    return True


def _np_itemsize(dtype: str) -> int:
    import numpy as np

    try:
        return int(np.dtype(dtype).itemsize)
    except TypeError:
        return -1


def iter_tensor_refs(tree: Any, path: str = "") -> Iterator[tuple[str, str, str]]:
    """Yield ``(path, tag, key)`` for every tensor/ndarray node, in tree order."""
    if _is_container(tree):
        for component, child in _children(tree):
            yield from iter_tensor_refs(child, join_key(path, component))
    elif isinstance(tree, dict) and tree.get("t") in ("tensor", "ndarray"):
        yield path, tree["t"], tree["key"]


_DROP = object()


def select_tree(tree: Any, patterns: Sequence[str]) -> tuple[Any, set[str]]:
    """Keep only the parts of ``tree`` selected by fnmatch ``patterns``.

    A leaf is kept when a pattern matches its key or one of its ancestors' paths (see
    :func:`ckptstore.format.keys.key_matches`); a container is kept when a pattern matches
    its own path (then whole) or when it still holds a kept leaf. Containers left with no
    kept leaf are dropped; lists and tuples keep only their selected elements, in order, so
    their indices compact.

    Args:
        tree: The full tree.
        patterns: fnmatch patterns against keys.

    Returns:
        The pruned tree (None when nothing matched) and the set of patterns that matched.
    """
    matched: set[str] = set()
    kept = _select(tree, "", patterns, matched)
    return (None if kept is _DROP else kept), matched


def _select(node: Any, path: str, patterns: Sequence[str], matched: set[str]) -> Any:
    # The root has no path of its own, except when the whole state is one leaf (key "").
    if path or not _is_container(node):
        hits = [p for p in patterns if key_matches(path, [p])]
        if hits:
            matched.update(hits)
            return node
    if not _is_container(node):
        return _DROP
    tag = node["t"]
    if tag in ("list", "tuple"):
        items = [
            _select(child, join_key(path, i), patterns, matched)
            for i, child in enumerate(node["v"])
        ]
        kept = [item for item in items if item is not _DROP]
        return {"t": tag, "v": kept} if kept else _DROP
    keys: list[Any] = []
    values: list[Any] = []
    for key_node, child in zip(node["k"], node["v"], strict=True):
        item = _select(child, join_key(path, decode_scalar(key_node)), patterns, matched)
        if item is not _DROP:
            keys.append(key_node)
            values.append(item)
    return {"t": tag, "k": keys, "v": values} if keys else _DROP


def match_into(tree: Any, into: Any, accept: Callable[[str, Any], bool]) -> dict[str, Any]:
    """Pair each tensor key with the object found at the same path inside ``into``.

    Walks ``tree`` and ``into`` side by side: dict nodes look up the same key in a mapping,
    list/tuple nodes the same index in a list or tuple. Only the first occurrence of a key
    (its defining path) is considered.

    Args:
        tree: The (possibly pruned) tree.
        into: The caller's live state.
        accept: Called as ``accept(key, obj)``; pairs where it returns False are skipped.

    Returns:
        Tensor key -> object from ``into``.
    """
    found: dict[str, Any] = {}
    _match(tree, into, found, accept)
    return found


def _match(node: Any, live: Any, found: dict[str, Any], accept: Callable[[str, Any], bool]) -> None:
    if _is_container(node):
        tag = node["t"]
        if tag in ("list", "tuple"):
            if not isinstance(live, list | tuple):
                return
            for index, child in enumerate(node["v"]):
                if index < len(live):
                    _match(child, live[index], found, accept)
            return
        if not isinstance(live, Mapping):
            return
        for key_node, child in zip(node["k"], node["v"], strict=True):
            key = decode_scalar(key_node)
            try:
                sub = live[key]
            except (KeyError, TypeError):
                continue
            _match(child, sub, found, accept)
    elif isinstance(node, dict) and node.get("t") in ("tensor", "ndarray"):
        key = node["key"]
        if key not in found and accept(key, live):
            found[key] = live
