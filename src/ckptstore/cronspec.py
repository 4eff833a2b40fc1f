"""The shape of a schedule string, checked without any scheduler installed.

``[schedules]`` entries are read when the settings are resolved, long before a flow runner
(and ``croniter``, from the ``flows`` extra) parses them; a typo such as ``"every ten
minutes"`` must fail there, naming the key. Accepted, as ``ckptstore.flows.schedules`` reads
them:

* an interval: ``"every 30s"``, ``"every 5 minutes"``, ``"@every 2h"``;
* a cron macro: ``@yearly``, ``@annually``, ``@monthly``, ``@weekly``, ``@daily``,
  ``@midnight``, ``@hourly``;
* a cron expression of 5 fields (minute hour day-of-month month day-of-week), or 6 with a
  trailing seconds field as croniter reads it; each field a comma list of ``*``, ``N``,
  ``N-M``, each with an optional ``/STEP``; months and weekdays also by English
  abbreviation (``jan``, ``mon``); ``L`` for the last day of the month.
"""

from __future__ import annotations

import re

__all__ = ["INTERVAL_UNITS", "SCHEDULE_FORMS", "check_schedule"]

#: Interval units and their length in seconds.
INTERVAL_UNITS: dict[str, int] = {
    "s": 1, "sec": 1, "secs": 1, "second": 1, "seconds": 1,
    "m": 60, "min": 60, "mins": 60, "minute": 60, "minutes": 60,
    "h": 3600, "hr": 3600, "hour": 3600, "hours": 3600,
    "d": 86400, "day": 86400, "days": 86400,
}
#: What a schedule may be, for error messages.
SCHEDULE_FORMS = ("a cron expression ('*/10 * * * *', '0 3 * * 0', '@daily') or an interval "
                  "('every 30s', 'every 5 minutes', '@every 2h')")

# re.ASCII: \d would otherwise match non-ASCII digits (a full-width 3).
_INTERVAL = re.compile(r"^\s*@?every\s+(\d+(?:\.\d+)?)\s*([a-z]+)\s*\Z", re.I | re.ASCII)
_MACROS = frozenset({"@yearly", "@annually", "@monthly", "@weekly", "@daily", "@midnight",
                     "@hourly"})
_MONTHS = ("jan", "feb", "mar", "apr", "may", "jun", "jul", "aug", "sep", "oct", "nov", "dec")
_DAYS = ("sun", "mon", "tue", "wed", "thu", "fri", "sat")
# (name, lowest, highest, names) per field, in order; the optional 6th is seconds.
_FIELDS = (
    ("minute", 0, 59, ()),
    ("hour", 0, 23, ()),
    ("day of month", 1, 31, ()),
    ("month", 1, 12, _MONTHS),
    ("day of week", 0, 7, _DAYS),
    ("second", 0, 59, ()),
)
_ITEM = re.compile(r"^(\*|[a-z0-9]+(?:-[a-z0-9]+)?)(?:/(\d+))?\Z", re.I | re.ASCII)


def check_schedule(text: object) -> str:
    """Check one schedule string; returns it unchanged.

    Raises:
        ValueError: Saying what is wrong and what a schedule may be.
    """
    if not isinstance(text, str) or not text.strip():
        raise ValueError(f"must be {SCHEDULE_FORMS}")
    if not text.isascii():
        raise ValueError("must be written with ASCII characters only")
    stripped = text.strip()
    match = _INTERVAL.match(stripped)
    if match:
        if match.group(2).lower() not in INTERVAL_UNITS or float(match.group(1)) <= 0:
            raise ValueError("an interval is a positive number and a unit (s, m, h, d), "
                             "e.g. 'every 30s' or 'every 5 minutes'")
        return text
    if stripped.startswith("@"):
        if stripped.lower() in _MACROS:
            return text
        raise ValueError(f"unknown macro; use one of {', '.join(sorted(_MACROS))} or "
                         f"{SCHEDULE_FORMS}")
    fields = stripped.split()
    if len(fields) not in (5, 6):
        raise ValueError(f"is neither a cron expression nor an interval: write {SCHEDULE_FORMS}")
    for field, (name, low, high, names) in zip(fields, _FIELDS, strict=False):
        for item in field.split(","):
            _check_item(item, name, low, high, names)
    return text


def _check_item(item: str, name: str, low: int, high: int, names: tuple[str, ...]) -> None:
    match = _ITEM.match(item)
    if match is None:
        raise ValueError(f"the {name} field's {item!r} is not *, N, N-M or one of them "
                         "with /STEP")
    if match.group(2) is not None and int(match.group(2)) == 0:
        raise ValueError(f"the {name} field's step in {item!r} must be positive")
    if match.group(1) == "*":
        return
    if name == "day of month" and match.group(1).upper() == "L":
        return
    bounds = [_value(part, name, low, high, names) for part in match.group(1).split("-")]
    if len(bounds) == 2 and bounds[0] > bounds[1] and not names:
        raise ValueError(f"the {name} range {item!r} runs backwards")


def _value(part: str, name: str, low: int, high: int, names: tuple[str, ...]) -> int:
    if part.isdigit():
        number = int(part)
        if low <= number <= high:
            return number
        raise ValueError(f"the {name} field's {part} is outside {low}-{high}")
    if part.lower() in names:
        return names.index(part.lower()) + (1 if name == "month" else 0)
    allowed = f"{low}-{high}" + (f" or {', '.join(names)}" if names else "")
    raise ValueError(f"the {name} field's {part!r} is not a number ({allowed})")
