"""Retention policy: which checkpoints to keep, as pure values (no I/O).

A :class:`RetentionPolicy` is a *union of preservation rules*. A checkpoint is kept when at
least one rule (or one protection) gives it a reason; otherwise it is pruned:

* ``keep_last=N``: the N newest checkpoints of each run by numeric ``(step, version)``, counted
  among the checkpoints that are not already protected (pinned, aliased, leased), so pinning an
  old checkpoint never pushes a recent one out of the window.
* ``keep_every=K``: every checkpoint whose step is a multiple of K.
* ``keep_best=(metric, "min"|"max", N)``: the N best by that metric per run; a missing or
  non-finite metric is never "best".
* ``max_age_days=D``: checkpoints younger than D days are kept; older ones are pruned unless
  another rule keeps them.

Protections apply whatever the rules say: pinned or aliased checkpoints, checkpoints under a
lease (another flow is using them), the newest checkpoint of every run (highest
``(step, version)``) and its latest save (highest version, what ``run@latest`` resolves to;
they differ after a run was rewound), and every base a kept delta needs (transitively). With
no rule set at all, everything is kept.

Example:
    >>> policy = RetentionPolicy(keep_last=2)
    >>> [d.keep for d in policy.decide(candidates, now=now)]  # doctest: +SKIP
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any, Protocol

from ckptstore.errors import ConfigError

__all__ = [
    "CandidateInfo",
    "Decision",
    "RetentionPolicy",
    "RetentionSettings",
    "REASON_LATEST",
    "REASON_LEASED",
    "REASON_NEWEST",
    "REASON_NO_POLICY",
    "REASON_PINNED",
]

logger = logging.getLogger(__name__)

REASON_NO_POLICY = "no retention rule set"
REASON_PINNED = "pinned"
REASON_LEASED = "leased"
REASON_NEWEST = "newest of run"
REASON_LATEST = "latest version of run"


class RetentionSettings(Protocol):
    """The retention fields of :class:`ckptstore.config.Settings` (a structural type)."""

    @property
    def keep_last(self) -> int | None: ...

    @property
    def keep_every(self) -> int | None: ...

    @property
    def keep_best(self) -> tuple[str, str, int] | None: ...

    @property
    def max_age_days(self) -> float | None: ...


@dataclass(frozen=True)
class CandidateInfo:
    """What the policy needs to know about one COMMITTED checkpoint.

    Attributes:
        checkpoint_id: Catalog id.
        run: Run name; ``keep_last``, ``keep_best`` and "newest" apply per run.
        step: Training step.
        version: Per-run version (breaks ties between saves of the same step).
        created_at: When the checkpoint was created (tz-aware; naive means UTC).
        metrics: Recorded metrics.
        pinned: Pinned checkpoints are never pruned.
        aliases: Aliased checkpoints are never pruned.
        base_id: Base of a delta (or dedup source); kept while this one is kept.
        leased: Another flow holds a lease on it: it is skipped (kept).
        required_by: Ids of checkpoints outside the candidate set that need this one as
            their base; it is kept for them.
    """

    checkpoint_id: str
    run: str
    step: int
    version: int
    created_at: datetime
    metrics: Mapping[str, float] = field(default_factory=dict)
    pinned: bool = False
    aliases: tuple[str, ...] = ()
    base_id: str | None = None
    leased: bool = False
    required_by: tuple[str, ...] = ()

    @property
    def order_key(self) -> tuple[int, int]:
        """Numeric recency: higher ``(step, version)`` is newer (never a string sort)."""
        return (int(self.step), int(self.version))

    @property
    def protected(self) -> bool:
        """Pinned, aliased or leased: kept regardless of the rules."""
        return self.pinned or bool(self.aliases) or self.leased


@dataclass(frozen=True)
class Decision:
    """The verdict on one checkpoint.

    Attributes:
        checkpoint_id: Catalog id.
        keep: True to keep it.
        reasons: Why it is kept (every reason that applies) or, when pruned, why no rule kept it.
    """

    checkpoint_id: str
    keep: bool
    reasons: tuple[str, ...]


def _as_utc(value: datetime) -> datetime:
    # The catalog hands out tz-aware UTC datetimes; a naive one is taken as UTC, not local.
    return value if value.tzinfo is not None else value.replace(tzinfo=UTC)


def _finite_metric(c: CandidateInfo, metric: str) -> float | None:
    value = c.metrics.get(metric)
    if value is None or isinstance(value, bool):
        return None
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return number if math.isfinite(number) else None


@dataclass(frozen=True)
class RetentionPolicy:
    """A union of preservation rules; see the module docstring for the exact semantics.

    Attributes:
        keep_last: Keep the N newest (non-protected) checkpoints of each run; ``0`` keeps
            none by this rule (the newest of each run is still kept).
        keep_every: Keep every checkpoint whose step is a multiple of K (K >= 1).
        keep_best: ``(metric, "min" | "max", N)``: keep the N best per run.
        max_age_days: Keep checkpoints younger than this many days.

    Raises:
        ConfigError: If a value is out of range.
    """

    keep_last: int | None = None
    keep_every: int | None = None
    keep_best: tuple[str, str, int] | None = None
    max_age_days: float | None = None

    def __post_init__(self) -> None:
        """Validate the rule values."""
        if self.keep_last is not None and (isinstance(self.keep_last, bool) or self.keep_last < 0):
            raise ConfigError(
                f"retention keep_last must be an int >= 0, got {self.keep_last!r}; fix the "
                "[retention] section of the config"
            )
        if self.keep_every is not None and (
            isinstance(self.keep_every, bool) or self.keep_every < 1
        ):
            raise ConfigError(
                f"retention keep_every must be an int >= 1, got {self.keep_every!r}; use None "
                "(or 0 in the config) to disable it"
            )
        if self.keep_best is not None:
            if len(self.keep_best) != 3:
                raise ConfigError(
                    f"retention keep_best must be (metric, 'min'|'max', count), got "
                    f"{self.keep_best!r}"
                )
            metric, mode, count = self.keep_best
            if not metric or mode not in ("min", "max") or int(count) < 0:
                raise ConfigError(
                    f"retention keep_best must be (metric, 'min'|'max', count >= 0), got "
                    f"{self.keep_best!r}"
                )
        if self.max_age_days is not None and (
            not math.isfinite(self.max_age_days) or self.max_age_days < 0
        ):
            raise ConfigError(
                f"retention max_age_days must be a finite number >= 0, got {self.max_age_days!r}"
            )

    @classmethod
    def from_settings(cls, settings: RetentionSettings) -> RetentionPolicy:
        """Build the policy from a store's settings (``keep_every = 0`` means disabled).

        Args:
            settings: A :class:`ckptstore.config.Settings` (or anything with its retention
                fields).

        Returns:
            The policy.

        Raises:
            ConfigError: If a value is out of range.
        """
        keep_every = settings.keep_every or None
        return cls(
            keep_last=settings.keep_last,
            keep_every=keep_every,
            keep_best=settings.keep_best,
            max_age_days=settings.max_age_days,
        )

    @property
    def empty(self) -> bool:
        """True when no rule is set (then everything is kept)."""
        return (
            self.keep_last is None
            and self.keep_every is None
            and self.keep_best is None
            and self.max_age_days is None
        )

    def describe(self) -> str:
        """A one-line human description, e.g. ``keep_last=3 keep_every=1000``."""
        parts: list[str] = []
        if self.keep_last is not None:
            parts.append(f"keep_last={self.keep_last}")
        if self.keep_every is not None:
            parts.append(f"keep_every={self.keep_every}")
        if self.keep_best is not None:
            metric, mode, count = self.keep_best
            parts.append(f"keep_best={metric}:{mode}:{count}")
        if self.max_age_days is not None:
            parts.append(f"max_age_days={self.max_age_days:g}")
        return " ".join(parts) or "keep everything (no rule)"

    def to_dict(self) -> dict[str, Any]:
        """JSON-able form (for flow results and events)."""
        return {
            "keep_last": self.keep_last,
            "keep_every": self.keep_every,
            "keep_best": list(self.keep_best) if self.keep_best else None,
            "max_age_days": self.max_age_days,
        }

    # ------------------------------------------------------------------ decide
    def decide(self, candidates: Sequence[CandidateInfo], *, now: datetime) -> list[Decision]:
        """Decide keep/prune for every candidate.

        Args:
            candidates: COMMITTED checkpoints, of one run or several (rules apply per run).
            now: The reference time for ``max_age_days``.

        Returns:
            One :class:`Decision` per candidate, in the input order.

        Raises:
            ValueError: If two candidates share an id.
        """
        ids = [c.checkpoint_id for c in candidates]
        if len(set(ids)) != len(ids):
            raise ValueError("retention candidates must have distinct checkpoint ids")
        reasons: dict[str, list[str]] = {c.checkpoint_id: [] for c in candidates}
        if self.empty:
            return [Decision(c.checkpoint_id, True, (REASON_NO_POLICY,)) for c in candidates]

        for c in candidates:
            if c.pinned:
                reasons[c.checkpoint_id].append(REASON_PINNED)
            for alias in c.aliases:
                reasons[c.checkpoint_id].append(f"alias {alias}")
            if c.leased:
                reasons[c.checkpoint_id].append(REASON_LEASED)
            for dependent in c.required_by:
                reasons[c.checkpoint_id].append(f"base of {dependent}")

        for run_members in _by_run(candidates).values():
            newest = max(run_members, key=lambda c: c.order_key)
            reasons[newest.checkpoint_id].append(REASON_NEWEST)
            # ``run@latest`` (what a resume loads) is the highest version, which differs from
            # the highest step after a run was rewound; both stay.
            latest = max(run_members, key=lambda c: int(c.version))
            reasons[latest.checkpoint_id].append(REASON_LATEST)
            if self.keep_last is not None and self.keep_last > 0:
                open_members = sorted(
                    (c for c in run_members if not c.protected),
                    key=lambda c: c.order_key,
                    reverse=True,
                )
                for c in open_members[: self.keep_last]:
                    reasons[c.checkpoint_id].append(f"among last {self.keep_last}")
            if self.keep_best is not None:
                metric, mode, count = self.keep_best
                scored = [
                    (v, c) for c in run_members if (v := _finite_metric(c, metric)) is not None
                ]
                # Best first; among equal values the newer checkpoint wins the slot.
                sign = 1.0 if mode == "min" else -1.0
                scored.sort(key=lambda vc: (sign * vc[0], tuple(-k for k in vc[1].order_key)))
                for _value, c in scored[: int(count)]:
                    reasons[c.checkpoint_id].append(f"best {count} by {metric} ({mode})")

        max_age = timedelta(days=self.max_age_days) if self.max_age_days is not None else None
        now_utc = _as_utc(now)
        for c in candidates:
            if self.keep_every is not None and c.step % self.keep_every == 0:
                reasons[c.checkpoint_id].append(f"step multiple of {self.keep_every}")
            if max_age is not None and now_utc - _as_utc(c.created_at) <= max_age:
                reasons[c.checkpoint_id].append(f"younger than {self.max_age_days:g} days")

        kept = {cid for cid, why in reasons.items() if why}
        for cid, base in _needed_bases(candidates, kept):
            reasons[base].append(f"base of {cid}")

        decisions: list[Decision] = []
        for c in candidates:
            why = reasons[c.checkpoint_id]
            if why:
                decisions.append(Decision(c.checkpoint_id, True, tuple(_unique(why))))
            else:
                decisions.append(Decision(c.checkpoint_id, False, self._prune_reasons(c, now_utc)))
        logger.debug(
            "retention %s: %d candidates, %d kept",
            self.describe(), len(candidates), sum(d.keep for d in decisions),
        )
        return decisions

    def _prune_reasons(self, c: CandidateInfo, now: datetime) -> tuple[str, ...]:
        out: list[str] = []
        if self.keep_last is not None:
            out.append(f"not among last {self.keep_last}")
        if self.keep_every is not None:
            out.append(f"step not a multiple of {self.keep_every}")
        if self.keep_best is not None:
            out.append(f"not best {self.keep_best[2]} by {self.keep_best[0]}")
        if self.max_age_days is not None:
            age_days = (now - _as_utc(c.created_at)).total_seconds() / 86400.0
            out.append(f"older than {self.max_age_days:g} days ({age_days:.1f})")
        return tuple(out)


def _by_run(candidates: Iterable[CandidateInfo]) -> dict[str, list[CandidateInfo]]:
    groups: dict[str, list[CandidateInfo]] = {}
    for c in candidates:
        groups.setdefault(c.run, []).append(c)
    return groups


def _needed_bases(
    candidates: Sequence[CandidateInfo], kept: set[str]
) -> list[tuple[str, str]]:
    """(dependent, base) pairs for every base a kept checkpoint needs, followed transitively."""
    by_id = {c.checkpoint_id: c for c in candidates}
    pairs: list[tuple[str, str]] = []
    stack = sorted(kept)
    seen: set[str] = set(kept)
    # Bounded: each candidate enters the stack at most once.
    while stack:
        cid = stack.pop()
        base = by_id[cid].base_id
        if base is None or base not in by_id:
            continue
        pairs.append((cid, base))
        if base not in seen:
            seen.add(base)
            stack.append(base)
    return pairs


def _unique(items: Iterable[str]) -> list[str]:
    out: list[str] = []
    for item in items:
        if item not in out:
            out.append(item)
    return out
