"""Save policies, table-driven: each row is a sequence of (step, time) and the expected saves."""

from __future__ import annotations

import pytest

from ckptstore.errors import ConfigError
from ckptstore.hooks.policies import AnyOf, EveryNSeconds, EveryNSteps, OnDemand, SavePolicy

Ticks = list[tuple[int, float]]


def drive(policy: SavePolicy, ticks: list[tuple[int, float]]) -> list[int]:
    """Run a loop over (step, now) ticks; return the steps at which the policy saved."""
    saved = []
    for step, now in ticks:
        if policy.should_save(step, now):
            policy.saved(step, now)
            saved.append(step)
    return saved


def steps(*values: int) -> list[tuple[int, float]]:
    return [(s, float(s)) for s in values]


@pytest.mark.parametrize(
    ("policy", "ticks", "expected"),
    [
        (EveryNSteps(10), steps(*range(0, 35)), [10, 20, 30]),
        (EveryNSteps(10), steps(*range(1, 11)), [10]),
        # A loop that skips the multiple still saves at the first step past it.
        (EveryNSteps(10), steps(5, 9, 12, 13, 19, 21), [12, 21]),
        # Baseline moved by a resume: the first save is the next multiple after step 1003.
        (EveryNSteps(100, start=1003), steps(1004, 1050, 1099, 1100, 1101), [1100]),
        (EveryNSteps(1), steps(0, 1, 2, 3), [1, 2, 3]),
        # The same step seen twice saves once.
        (EveryNSteps(5), steps(5, 5, 6), [5]),
    ],
)
def test_every_n_steps(policy: SavePolicy, ticks: Ticks, expected: list[int]) -> None:
    assert drive(policy, ticks) == expected


@pytest.mark.parametrize(
    ("policy", "ticks", "expected"),
    [
        # The clock starts at the first query (t=100), so t=100..159 is not due.
        (EveryNSeconds(60.0), [(1, 100.0), (2, 130.0), (3, 159.9), (4, 160.0), (5, 200.0),
                               (6, 220.0)], [4, 6]),
        (EveryNSeconds(10.0, start=0.0), [(1, 5.0), (2, 10.0), (3, 15.0), (4, 21.0)], [2, 4]),
        (EveryNSeconds(0.5), [(i, i * 0.1) for i in range(12)], [5, 10]),
    ],
)
def test_every_n_seconds(policy: SavePolicy, ticks: Ticks, expected: list[int]) -> None:
    assert drive(policy, ticks) == expected


def test_on_demand_saves_once_per_request() -> None:
    policy = OnDemand()
    assert drive(policy, steps(1, 2)) == []
    policy.request()
    assert policy.requested
    assert drive(policy, steps(3, 4)) == [3]
    assert not policy.requested


@pytest.mark.parametrize(
    ("ticks", "request_at", "expected"),
    [
        (steps(*range(1, 26)), None, [10, 20]),
        # An on-demand save at 13 does not shift the step grid: the next is still 20.
        (steps(*range(1, 26)), 13, [10, 13, 20]),
    ],
)
def test_any_of(ticks: Ticks, request_at: int | None, expected: list[int]) -> None:
    demand = OnDemand()
    policy = AnyOf(EveryNSteps(10), EveryNSeconds(1000.0), demand)
    saved = []
    for step, now in ticks:
        if step == request_at:
            demand.request()
        if policy.should_save(step, now):
            policy.saved(step, now)
            saved.append(step)
    assert saved == expected


def test_any_of_time_or_steps() -> None:
    # Steps every 100, or 30 s: slow steps make the time policy fire first.
    policy = AnyOf(EveryNSteps(100), EveryNSeconds(30.0))
    ticks = [(s, s * 2.0) for s in range(0, 60)]  # 2 s per step
    assert drive(policy, ticks) == [15, 30, 45]


def test_any_of_empty_never_saves() -> None:
    assert drive(AnyOf(), steps(*range(100))) == []


@pytest.mark.parametrize("bad", [0, -1, True, 2.5])
def test_every_n_steps_rejects_bad_interval(bad: object) -> None:
    with pytest.raises(ConfigError, match="positive"):
        EveryNSteps(bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", [0.0, -5.0])
def test_every_n_seconds_rejects_bad_interval(bad: float) -> None:
    with pytest.raises(ConfigError, match="positive"):
        EveryNSeconds(bad)


def test_policies_satisfy_protocol() -> None:
    for policy in (EveryNSteps(1), EveryNSeconds(1.0), OnDemand(), AnyOf()):
        assert isinstance(policy, SavePolicy)
