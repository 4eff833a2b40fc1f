"""Validation of user-supplied names: run names, tags, aliases, metric names.

Names end up in file paths, object keys and catalog rows, so anything that could escape a
directory, confuse a shell or a URL, or collide with our reference syntax is refused here,
at the API boundary, before anything is written.
"""

from __future__ import annotations

import re

from ckptstore.errors import InvalidNameError

__all__ = ["MAX_NAME_BYTES", "validate_metric_name", "validate_name", "validate_tag"]

MAX_NAME_BYTES = 200

# Letters, digits and a few separators; must start with a letter or digit. '@' and ':' are
# reserved for references (run@latest, run@best:loss), '/' and '\\' for paths.
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._+=,-]*$")
_METRIC_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_./-]*$")


def _check_common(value: object, what: str) -> str:
    if not isinstance(value, str):
        raise InvalidNameError(f"{what} must be a string, got {type(value).__name__}")
    if value == "":
        raise InvalidNameError(f"{what} must not be empty")
    if "\x00" in value:
        raise InvalidNameError(f"{what} {value!r} contains a NUL byte; remove it")
    if len(value.encode("utf-8")) > MAX_NAME_BYTES:
        raise InvalidNameError(
            f"{what} is {len(value.encode('utf-8'))} bytes long; the limit is {MAX_NAME_BYTES}"
        )
    return value


def validate_name(value: object, what: str = "run name") -> str:
    """Check a run, experiment or alias name.

    Args:
        value: The candidate name.
        what: How to call the name in the error message.

    Returns:
        The name, unchanged.

    Raises:
        InvalidNameError: If the name is empty, too long, holds ``/``, ``..``, NUL, a leading
            dot, whitespace or other characters outside ``[A-Za-z0-9._+=,-]``.
    """
    name = _check_common(value, what)
    if ".." in name:
        raise InvalidNameError(f"{what} {name!r} contains '..'; use a plain name")
    if name.endswith("."):
        # 'run.' and 'run' are the same directory on some file systems (Windows, SMB).
        raise InvalidNameError(f"{what} {name!r} ends with '.'; drop the trailing dot")
    if not _NAME_RE.match(name):
        raise InvalidNameError(
            f"{what} {name!r} is not allowed: use letters, digits and . _ + = , - "
            "and start with a letter or digit (no '/', '@', ':', spaces or leading dots)"
        )
    return name


def validate_tag(value: object) -> str:
    """Check a tag; same rules as :func:`validate_name`."""
    return validate_name(value, "tag")


def validate_metric_name(value: object) -> str:
    """Check a metric name such as ``loss`` or ``val/acc``.

    Raises:
        InvalidNameError: If the name is not an identifier-like string.
    """
    name = _check_common(value, "metric name")
    if ".." in name or not _METRIC_RE.match(name):
        raise InvalidNameError(
            f"metric name {name!r} is not allowed: use letters, digits, '_', '.', '/', '-' "
            "and start with a letter or '_'"
        )
    return name
