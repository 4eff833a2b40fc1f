"""Property test: list() filtering and ordering agree with a plain-Python model of them."""

from __future__ import annotations

import operator
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ckptstore.catalog import Catalog
from ckptstore.records import Checkpoint

RUNS = ("r-b", "r-a", "r-c")  # created in this order: ties break by creation, not by name
OPS = {"<": operator.lt, "<=": operator.le, ">": operator.gt, ">=": operator.ge,
       "==": operator.eq, "!=": operator.ne}  # fmt: skip
VALUES = (0.1, 0.25, 0.5, 0.75, 1.0)
FIELDS = ("step", "version", "created_at", "stored_bytes", "run", "metric:loss", "metric:acc")


@pytest.fixture
def dataset(catalog: Catalog, save) -> tuple[Catalog, list[Checkpoint]]:
    saved = []
    for i in range(15):
        run = RUNS[i % 3]
        metrics: dict[str, float] = {"loss": VALUES[i % 5]}
        if i % 4:
            metrics["acc"] = VALUES[(i * 2) % 5]
        tags = ["even"] if i % 2 == 0 else ["odd"]
        # Steps repeat across runs (and once within a run) to exercise the tie-breaks.
        saved.append(save(run, (i % 6) * 10, metrics=metrics, tags=tags, stored_bytes=i % 4))
    return catalog, saved


def _model(saved: list[Checkpoint], kw: dict[str, Any]) -> list[str]:
    rows = list(saved)
    if kw.get("tag"):
        rows = [c for c in rows if kw["tag"] in c.tags]
    low, high = kw.get("step_range") or (None, None)
    rows = [c for c in rows if (low is None or c.step >= low) and (high is None or c.step <= high)]
    for name, (op, value) in (kw.get("metrics") or {}).items():
        rows = [c for c in rows if name in c.metrics and OPS[op](c.metrics[name], value)]
    order = kw["order_by"]
    desc = order.startswith("-")
    field = order.lstrip("-")
    run_rank = {name: i for i, name in enumerate(RUNS)}

    def key(c: Checkpoint) -> tuple[Any, ...]:
        if field.startswith("metric:"):
            value = c.metrics.get(field.split(":", 1)[1])
            main: Any = value if value is not None else 0.0
            return (main, run_rank[c.run], c.version)
        if field == "run":
            return (c.run, c.version)
        return (getattr(c, field), run_rank[c.run], c.version)

    if field.startswith("metric:"):
        name = field.split(":", 1)[1]
        present = sorted((c for c in rows if name in c.metrics), key=key, reverse=desc)
        rows = present + sorted((c for c in rows if name not in c.metrics), key=key, reverse=desc)
    else:
        rows = sorted(rows, key=key, reverse=desc)
    limit = kw.get("limit")
    return [c.id for c in rows[:limit]]


filters = st.fixed_dictionaries(
    {"order_by": st.sampled_from(FIELDS).flatmap(lambda f: st.sampled_from([f, f"-{f}"]))},
    optional={
        "tag": st.sampled_from(["even", "odd"]),
        "step_range": st.tuples(st.none() | st.integers(0, 50), st.none() | st.integers(0, 50)),
        "metrics": st.dictionaries(
            st.sampled_from(["loss", "acc"]),
            st.tuples(st.sampled_from(sorted(OPS)), st.sampled_from(VALUES)),
            max_size=2,
        ),
        "limit": st.integers(1, 6),
    },
)


@settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],  # examples only read
)
@given(kw=filters)
def test_list_matches_the_model(
    dataset: tuple[Catalog, list[Checkpoint]], kw: dict[str, Any]
) -> None:
    catalog, saved = dataset
    assert [c.id for c in catalog.list(**kw)] == _model(saved, kw)
