"""Schedules of our own for embedded mode (Prefect's cron schedules only fire with a server).

Accepted forms (``settings.schedules`` maps a flow name to one of them):

* a cron expression, ``"0 3 * * *"`` or a macro such as ``"@daily"``, evaluated in UTC like
  Prefect's served deployments (parsed with ``croniter``, from the ``flows`` extra);
* an interval, ``"every 30s"``, ``"every 5 minutes"``, ``"@every 2h"`` (units: s, sec, second(s),
  m, min, minute(s), h, hour(s), d, day(s)).
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, Protocol

from ckptstore.errors import ConfigError
from ckptstore.extras import require

__all__ = ["CronSchedule", "IntervalSchedule", "Schedule", "parse_schedule"]

logger = logging.getLogger(__name__)

_UNITS = {
    "s": 1, "sec": 1, "secs": 1, "second": 1, "seconds": 1,
    "m": 60, "min": 60, "mins": 60, "minute": 60, "minutes": 60,
    "h": 3600, "hr": 3600, "hour": 3600, "hours": 3600,
    "d": 86400, "day": 86400, "days": 86400,
}
# re.ASCII: \d and \s would otherwise match non-ASCII digits and blanks (U+FF13, a full-width 3).
_INTERVAL = re.compile(r"^\s*(?:@?every)\s+(\d+(?:\.\d+)?)\s*([a-z]+)\s*\Z",
                       re.IGNORECASE | re.ASCII)


class Schedule(Protocol):
    """When a scheduled flow fires next."""

    @property
    def text(self) -> str:
        """The schedule as written in the config."""

    def next_after(self, moment: datetime) -> datetime:
        """The first firing time strictly after ``moment`` (tz-aware in, tz-aware out)."""


@dataclass(frozen=True)
class IntervalSchedule:
    """Fires every ``seconds``, counted from when the runner started."""

    text: str
    seconds: float

    def next_after(self, moment: datetime) -> datetime:
        """``moment + interval``."""
        return moment + timedelta(seconds=self.seconds)


@dataclass(frozen=True)
class CronSchedule:
    """Fires on a cron expression (UTC)."""

    text: str

    def next_after(self, moment: datetime) -> datetime:
        """The next cron time after ``moment``."""
        croniter = _croniter()
        result = croniter(self.text, moment).get_next(datetime)
        assert isinstance(result, datetime)
        return result


def _croniter() -> Any:
    # The public package (declared in the 'flows' extra), not the copy Prefect vendors: that
    # one is private to Prefect and may move or go in any release.
    return require("croniter", "a cron schedule").croniter


def parse_schedule(text: str) -> IntervalSchedule | CronSchedule:
    """Parse one schedule string.

    Args:
        text: ``"every 30s"``-style interval or a cron expression.

    Returns:
        The schedule.

    Raises:
        ConfigError: If it is neither a valid interval nor a valid cron expression.
        MissingExtraError: For a cron expression when croniter is not installed.
    """
    if not isinstance(text, str) or not text.isascii():
        # int() and float() (and so croniter) read non-ASCII digits: a full-width 0 would read as 0.
        raise ConfigError(f"invalid schedule {text!r}: write it with ASCII characters only")
    match = _INTERVAL.match(text)
    if match:
        amount, unit = float(match.group(1)), match.group(2).lower()
        if unit not in _UNITS or amount <= 0:
            raise ConfigError(
                f"invalid schedule interval {text!r}; write e.g. 'every 30s' or 'every 5 minutes'"
            )
        return IntervalSchedule(text=text, seconds=amount * _UNITS[unit])
    croniter = _croniter()
    if not croniter.is_valid(text):
        raise ConfigError(
            f"invalid schedule {text!r}; use a cron expression ('0 3 * * *', '@daily') or an "
            "interval ('every 30s')"
        )
    return CronSchedule(text=text)
