"""Save policies: pure values that say when a training loop should checkpoint.

A policy answers ``should_save(step, now)`` and is told ``saved(step, now)`` after each save.
Policies do no I/O and read no clock themselves: the caller passes ``now`` (the manager uses
``time.monotonic()``), so tests can drive them with a table of (step, time) pairs.

Example:
    >>> policy = AnyOf(EveryNSteps(100), EveryNSeconds(1800.0))
    >>> policy.should_save(100, now=0.0)
    True
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from ckptstore.errors import ConfigError

__all__ = ["AnyOf", "EveryNSeconds", "EveryNSteps", "OnDemand", "SavePolicy"]

logger = logging.getLogger(__name__)


@runtime_checkable
class SavePolicy(Protocol):
    """Decides when to save.

    Lifecycle: the loop calls :meth:`should_save` once per step; when it returns True (or the
    loop saves for another reason) the loop saves and then calls :meth:`saved` with the same
    step and time, which moves the policy's baseline forward.
    """

    def should_save(self, step: int, now: float) -> bool:
        """Whether a save is due at ``step`` (``now``: seconds on a monotonic clock)."""
        ...

    def saved(self, step: int, now: float) -> None:
        """Record that the state of ``step`` was saved at ``now``."""
        ...


@dataclass
class EveryNSteps:
    """Due whenever the step reaches a multiple of ``n`` not yet covered by a save.

    The rule is ``step // n > baseline // n`` where the baseline is the last saved step
    (initially ``start``). Steps that skip a multiple (gradient accumulation, an uneven
    resume) still trigger at the first step past it, and a resumed run that tells the policy
    its restored step via :meth:`saved` keeps saving on the same multiples.

    Attributes:
        n: Interval in steps (positive).
        start: Baseline step before any save; the first save is due at the first multiple
            of ``n`` above it.
    """

    n: int
    start: int = 0
    _last: int | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        """Validate the interval."""
        if isinstance(self.n, bool) or not isinstance(self.n, int) or self.n <= 0:
            raise ConfigError(f"EveryNSteps needs a positive int interval, got {self.n!r}")

    def should_save(self, step: int, now: float) -> bool:
        """Whether ``step`` crossed a multiple of ``n`` since the baseline."""
        baseline = self.start if self._last is None else self._last
        return step // self.n > baseline // self.n

    def saved(self, step: int, now: float) -> None:
        """Move the baseline to ``step``."""
        self._last = step


@dataclass
class EveryNSeconds:
    """Due when ``seconds`` have passed since the last save.

    Before the first save the clock starts at ``start``, or, when that is None, at the first
    :meth:`should_save` call (so a policy built before a long setup phase does not fire at
    once).

    Attributes:
        seconds: Interval (positive).
        start: Time the interval counts from before any save.
    """

    seconds: float
    start: float | None = None
    _last: float | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        """Validate the interval."""
        if not self.seconds > 0:
            raise ConfigError(f"EveryNSeconds needs a positive interval, got {self.seconds!r}")

    def should_save(self, step: int, now: float) -> bool:
        """Whether ``seconds`` passed since the last save (or since the clock started)."""
        if self._last is None:
            if self.start is None:
                # The clock starts here: the only state a query is allowed to set.
                self.start = now
            baseline = self.start
        else:
            baseline = self._last
        return now - baseline >= self.seconds

    def saved(self, step: int, now: float) -> None:
        """Restart the interval at ``now``."""
        self._last = now


@dataclass
class OnDemand:
    """Due only after :meth:`request` (an operator, a signal handler, a loss monitor).

    ``request`` only sets a flag, so it is safe to call from a signal handler or another
    thread; the next ``should_save`` sees it.
    """

    _requested: bool = field(default=False, init=False, repr=False)

    def request(self) -> None:
        """Ask for a save at the next step."""
        self._requested = True

    @property
    def requested(self) -> bool:
        """Whether a save was requested and not yet made."""
        return self._requested

    def should_save(self, step: int, now: float) -> bool:
        """Whether a save was requested."""
        return self._requested

    def saved(self, step: int, now: float) -> None:
        """Clear the request."""
        self._requested = False


@dataclass(init=False)
class AnyOf:
    """Due when any of its policies is due; a save resets all of them.

    Attributes:
        policies: The combined policies.
    """

    policies: tuple[SavePolicy, ...]

    def __init__(self, *policies: SavePolicy) -> None:
        """Combine ``policies`` (none means never due)."""
        self.policies = tuple(policies)

    def should_save(self, step: int, now: float) -> bool:
        """Whether any policy is due.

        Every policy is asked (no short-circuit) so that clocks that start on their first
        query start at the same time.
        """
        due = [policy.should_save(step, now) for policy in self.policies]
        return any(due)

    def saved(self, step: int, now: float) -> None:
        """Tell every policy about the save."""
        for policy in self.policies:
            policy.saved(step, now)
