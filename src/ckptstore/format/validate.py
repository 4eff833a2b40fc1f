"""The validation kit every parser of untrusted format bytes uses.

Manifests, the DCP index inside them and the Zarr documents checked by ``ckpt doctor`` are
read from disks and bundles that may be hostile. Their parsers are written as a series of
checks on plain JSON values; each check raises :class:`Invalid` with a message naming the
field and what is wrong with it, and the parser's entry point turns the first one into an
:class:`~ckptstore.errors.IntegrityError` (:func:`rejecting`), so every parser reports
problems the same way and none of them lets a bad value reach the code that opens files or
allocates memory.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from ckptstore.errors import IntegrityError

__all__ = [
    "MAX_DIMS",
    "MAX_ELEMENTS",
    "Invalid",
    "check_depth",
    "dims",
    "hex_digest",
    "int_in",
    "load_json",
    "no_duplicates",
    "obj",
    "rejecting",
    "require",
    "short",
    "str_max",
]

#: Dimensions a shape may have (torch allows 64).
MAX_DIMS = 64
#: Elements a tensor, array or shape may hold: exact in a float64, far beyond any real state.
MAX_ELEMENTS = 2**53

_BLAKE3_HEX = re.compile(r"^[0-9a-f]{64}$")


class Invalid(ValueError):
    """One validation failure; the parser's entry point turns it into IntegrityError."""


@contextmanager
def rejecting(prefix: str, advice: str = "", *, too_deep: str | None = None) -> Iterator[None]:
    """Turn the first :class:`Invalid` raised in the block into an IntegrityError.

    The message is ``"<prefix>: <what is wrong><advice>"``; the Invalid is not chained (it
    carries nothing the message does not). A ``RecursionError`` (a document nested too
    deeply for the checks themselves) becomes an IntegrityError as well.

    Args:
        prefix: What was being parsed, as the start of a message (``"invalid manifest"``).
        advice: Appended to the message: what the user should do.
        too_deep: The message for a RecursionError (default: ``"<prefix>: nested too
            deeply<advice>"``).

    Raises:
        IntegrityError: For the first failed check.
    """
    try:
        yield
    except Invalid as exc:
        raise IntegrityError(f"{prefix}: {exc}{advice}") from None
    except RecursionError as exc:
        raise IntegrityError(too_deep or f"{prefix}: nested too deeply{advice}") from exc


def require(cond: bool, message: str) -> None:
    """Raise :class:`Invalid` with ``message`` unless ``cond`` holds."""
    if not cond:
        raise Invalid(message)


def short(value: Any, limit: int = 60) -> str:
    """``repr(value)``, cut to ``limit`` characters: a hostile value must not flood a log."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


# The checks below build their message only when they fail: a manifest of thousands of
# tensors runs them tens of thousands of times in a process that just started (a restore
# after a crash), where formatting a message per check cost more than the checks.


def int_in(value: Any, what: str, lo: int = 0, hi: int = 2**63 - 1) -> int:
    """``value`` as an int in ``[lo, hi]`` (a bool is not an int here)."""
    if type(value) is not int or not lo <= value <= hi:  # bool and subclasses refused
        raise Invalid(f"{what} must be an int in [{lo}, {hi}], got {short(value)}")
    return value


def str_max(value: Any, what: str, max_len: int) -> str:
    """``value`` as a string of at most ``max_len`` characters."""
    if type(value) is not str or len(value) > max_len:
        raise Invalid(f"{what} must be a string of at most {max_len} characters")
    return value


def hex_digest(value: Any, what: str) -> str:
    """``value`` as a lower-case hex blake3 digest."""
    if type(value) is not str or not _BLAKE3_HEX.match(value):
        raise Invalid(f"{what}: blake3 must be 64 hex digits")
    return value


def obj(value: Any, what: str, fields: Iterable[str]) -> dict[str, Any]:
    """``value`` as a JSON object with exactly the keys ``fields``."""
    wanted = set(fields)
    require(isinstance(value, dict) and set(value) == wanted, f"{what} must have {sorted(wanted)}")
    assert isinstance(value, dict)
    return value


def dims(value: Any, what: str, lo: int = 0) -> tuple[int, ...]:
    """``value`` as a shape: at most :data:`MAX_DIMS` ints >= ``lo``, whose product (checked
    as it grows, so a hostile shape cannot make us multiply huge ints) is at most
    :data:`MAX_ELEMENTS`."""
    require(isinstance(value, list) and len(value) <= MAX_DIMS, f"{what} must be a list")
    out = tuple(int_in(v, what, lo, MAX_ELEMENTS) for v in value)
    total = 1
    for d in out:
        total *= d
        require(total <= MAX_ELEMENTS, f"{what} has too many elements")
    return out


def check_depth(value: Any, what: str, max_depth: int, depth: int = 0) -> None:
    """Require ``value`` to nest at most ``max_depth`` containers deep."""
    require(depth <= max_depth, f"{what} is nested deeper than {max_depth}")
    children: Iterable[Any]
    if isinstance(value, dict):
        children = value.values()
    elif isinstance(value, list):
        children = value
    else:
        return
    for child in children:
        check_depth(child, what, max_depth, depth + 1)


def no_duplicates(pairs: Sequence[tuple[str, Any]]) -> dict[str, Any]:
    """``json.loads`` object hook that refuses an object naming a key twice.

    Two values for one key would let two readers (ours and zarr's, or two versions) see
    different documents in the same bytes.
    """
    result = dict(pairs)
    if len(result) != len(pairs):
        raise ValueError("duplicate object key")
    return result


def load_json(data: bytes, what: str, *, max_bytes: int, max_items: int,
              too_many: str = "") -> Any:
    """Parse hostile JSON bytes, bounding what ``json.loads`` may build before it builds it.

    Args:
        data: The bytes.
        what: What they are, for messages (``"manifest"``).
        max_bytes: Largest accepted size.
        max_items: Largest accepted number of JSON values, estimated by counting ``,``,
            ``{`` and ``[`` bytes (an upper bound: one inside a string only makes us
            stricter).
        too_many: Appended to the message when there are too many values.

    Raises:
        IntegrityError: If the bytes are too large, hold too many values, are not JSON,
            name an object key twice or nest too deeply.
    """
    if len(data) > max_bytes:
        raise IntegrityError(f"{what} is {len(data)} bytes, over the {max_bytes} byte limit")
    items = data.count(b",") + data.count(b"{") + data.count(b"[")
    if items > max_items:
        raise IntegrityError(
            f"{what} holds about {items} JSON values, over the {max_items} limit{too_many}"
        )
    try:
        return json.loads(data, object_pairs_hook=no_duplicates)
    except RecursionError as exc:
        raise IntegrityError(f"{what} JSON is nested too deeply") from exc
    except (ValueError, UnicodeDecodeError) as exc:
        raise IntegrityError(f"{what} is not valid JSON: {exc}") from exc
