"""Numbers read from text (ASCII digits only, bounded before they are converted), and
numbers written for people (byte counts in binary units).

Python's ``int()``, ``float()`` and ``str.isdigit()`` accept every Unicode decimal digit:
``int("\\uff13")`` (a full-width 3) and ``int("\\u0663")`` (an Arabic-Indic 3) are 3, and
``"\\u00b2".isdigit()`` (a superscript 2) is True although ``int()`` refuses it. A reference
such as ``run@`` + full-width 3 would then name step 3, a ``host:pid`` tag with exotic digits
would name a real pid, and two spellings of one number would mean the same checkpoint. Every
number ckptstore reads from text (references, CLI options and filters, config files and
``CKPT_*`` variables, tar headers, lease and writer tags, fault points, staging directory
names) goes through this module instead.

Byte counts people read go through :func:`human_bytes` (``1.5 GiB``) everywhere text is
printed: the CLI, the web view, retention reports.

Parsing is pure and has no dependencies, so every layer may use it.
"""

from __future__ import annotations

import math
import re
from typing import Any

from ckptstore.errors import CkptError, InvalidNameError

__all__ = [
    "MAX_INT32",
    "MAX_INT64",
    "counted",
    "decimal_or_none",
    "float_or_none",
    "human_bytes",
    "is_decimal",
    "parse_decimal",
    "parse_float",
    "rounded",
]

#: Largest value of a signed 64-bit column (``BIGINT``: steps, byte counts).
MAX_INT64 = 2**63 - 1
#: Largest value of a signed 32-bit column (``INTEGER``: versions).
MAX_INT32 = 2**31 - 1

# A float as people write it, ASCII only: 1, -2.5, .5, 1e-4, 3.0E+2. No "_" separators, no
# surrounding blanks, no hex; "inf"/"nan" are spelled out by name (float() accepts more).
_FLOAT = re.compile(r"[+-]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]+)?", re.ASCII)
_SPECIAL = {"inf": math.inf, "+inf": math.inf, "-inf": -math.inf, "nan": math.nan}
# Longer texts are refused before conversion (int() of a huge digit string is quadratic).
_MAX_FLOAT_CHARS = 64


def is_decimal(text: str) -> bool:
    """Whether ``text`` is a non-empty run of ASCII digits ``0-9`` (nothing else)."""
    return bool(text) and text.isascii() and text.isdigit()


def decimal_or_none(text: str, max_value: int = MAX_INT64) -> int | None:
    """``text`` as a non-negative int, or None if it is not ASCII digits or exceeds the bound.

    Args:
        text: The text, e.g. ``"1200"`` (no sign, no blanks, no ``_``).
        max_value: Largest value accepted.

    Returns:
        The number, or None.
    """
    if not is_decimal(text):
        return None
    digits = text.lstrip("0")
    if len(digits) > len(str(max_value)):
        return None
    value = int(text)
    return value if value <= max_value else None


def parse_decimal(
    text: str,
    what: str,
    *,
    max_value: int = MAX_INT64,
    error: type[CkptError] = InvalidNameError,
) -> int:
    """Parse a non-negative decimal int written with ASCII digits.

    Args:
        text: The text, e.g. ``"1200"``.
        what: How to call the value in the error message (``"step"``, ``"$CKPT_THREADS"``).
        max_value: Largest value accepted (the range of the column it ends up in).
        error: The error class to raise (:class:`InvalidNameError` by default).

    Returns:
        The number.

    Raises:
        CkptError: ``error``, when the text is not ASCII digits or the value exceeds
            ``max_value``.

    Example:
        >>> parse_decimal("42", "step")
        42
    """
    value = decimal_or_none(text, max_value)
    if value is not None:
        return value
    if is_decimal(text):
        raise error(f"{what} {_shown(text)} is out of range: at most {max_value} can be "
                    "stored")
    raise error(f"{what} must be a non-negative integer written with the digits 0-9, "
                f"got {_shown(text)}")


def float_or_none(text: str) -> float | None:
    """``text`` as a float if it is ASCII decimal notation (or inf/nan by name), else None."""
    if not isinstance(text, str) or len(text) > _MAX_FLOAT_CHARS:
        return None
    special = _SPECIAL.get(text.lower())
    if special is not None:
        return special
    if not _FLOAT.fullmatch(text):
        return None
    return float(text)


def parse_float(
    text: str, what: str, *, finite: bool = True, error: type[CkptError] = InvalidNameError
) -> float:
    """Parse a float written in ASCII decimal notation (``1``, ``-2.5``, ``1e-4``).

    Args:
        text: The text.
        what: How to call the value in the error message.
        finite: Refuse ``inf``, ``nan`` and values that overflow to infinity (``1e999``).
        error: The error class to raise (:class:`InvalidNameError` by default).

    Returns:
        The number.

    Raises:
        CkptError: ``error``, when the text is not a number in that notation, or not finite
            while ``finite`` is set.
    """
    value = float_or_none(text)
    if value is None:
        raise error(f"{what} must be a number written with the digits 0-9 (e.g. 2.5 or "
                    f"1e-4), got {_shown(text)}")
    if finite and not math.isfinite(value):
        raise error(f"{what} must be a finite number, got {_shown(text)}")
    return value


def _shown(text: object) -> str:
    shown = repr(text)
    return shown if len(shown) <= 48 else shown[:45] + "..."


def human_bytes(n: int | float | None) -> str:
    """A byte count in binary units for people (``"1.5 GiB"``, ``"312 B"``; ``"-"`` for None).

    Every byte count a command prints as text goes through here; ``--json`` prints the exact
    integer instead.
    """
    if n is None:
        return "-"
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")  # pragma: no cover


def counted(n: int, noun: str, plural: str | None = None) -> str:
    """``n`` and the noun in the right number: ``"1 problem"``, ``"3 problems"``, ``"0
    arrays"`` (``plural`` for nouns that do not just take an s: ``"copies"``)."""
    return f"{n} {noun if n == 1 else (plural or noun + 's')}"


# A float written with more digits than anyone reads (1.1026153340935707).
_LONG_FLOAT = re.compile(r"-?\d+\.\d{5,}(?:[eE][-+]?\d+)?")


def rounded(value: Any) -> str:
    """A number for people: 4 significant digits (``1.103``); text passes through with
    every long float in it rounded the same way; None is "-"."""
    if value is None:
        return "-"
    if isinstance(value, bool):
        return str(value)
    if isinstance(value, int | float):
        return f"{value:.4g}"
    return _LONG_FLOAT.sub(lambda m: f"{float(m.group(0)):.4g}", str(value))
