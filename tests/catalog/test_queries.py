"""Listing with filters and ordering, injection attempts, usage accounting."""

from __future__ import annotations

import pytest
from sqlalchemy import inspect

from ckptstore.catalog import Catalog
from ckptstore.errors import InvalidNameError
from ckptstore.records import CheckpointState, ReplicaState, UsageRow


@pytest.fixture
def populated(catalog: Catalog, save) -> Catalog:
    """Two runs in two experiments; metrics, tags and tiers vary by step."""
    catalog.ensure_run("a", experiment="exp1")
    catalog.ensure_run("b", experiment="exp2")
    for step, loss, acc in ((9, 0.9, 0.1), (10, 0.5, 0.4), (20, 0.3, 0.6), (100, 0.1, 0.9)):
        tags = ["even"] if step % 2 == 0 else ["odd"]
        if step >= 20:
            tags.append("late")
        save("a", step, metrics={"loss": loss, "acc": acc}, tags=tags, stored_bytes=step)
    save("b", 5, metrics={"loss": 0.05}, tags=["odd"], stored_bytes=7)
    save("b", 50, stored_bytes=9)  # no metrics at all
    catalog.begin_checkpoint("a", 200, metrics={"loss": 0.0})  # PENDING
    return catalog


def steps(cks: list) -> list[tuple[str, int]]:
    return [(c.run, c.step) for c in cks]


def test_default_lists_committed_by_step(populated: Catalog) -> None:
    assert steps(populated.list()) == [
        ("b", 5),
        ("a", 9),
        ("a", 10),
        ("a", 20),
        ("b", 50),
        ("a", 100),
    ]
    assert len(populated.list(state=None)) == 7
    assert steps(populated.list(state=CheckpointState.PENDING)) == [("a", 200)]
    assert steps(populated.list(state="PENDING")) == [("a", 200)]


def test_run_experiment_tag_and_step_range(populated: Catalog) -> None:
    assert steps(populated.list(run="b")) == [("b", 5), ("b", 50)]
    assert steps(populated.list(experiment="exp1", limit=2)) == [("a", 9), ("a", 10)]
    assert steps(populated.list(tag="odd")) == [("b", 5), ("a", 9)]
    assert steps(populated.list(tag=["even", "late"])) == [("a", 20), ("a", 100)]
    assert steps(populated.list(step_range=(10, 50))) == [("a", 10), ("a", 20), ("b", 50)]
    assert steps(populated.list(step_range=(None, 9))) == [("b", 5), ("a", 9)]
    assert steps(populated.list(step_range=(21, None), run="a")) == [("a", 100)]
    assert populated.list(tag="nope") == []


def test_metric_filters(populated: Catalog) -> None:
    assert steps(populated.list(metrics={"loss": ("<", 0.3)})) == [("b", 5), ("a", 100)]
    assert steps(populated.list(metrics={"loss": ("<=", 0.3)})) == [("b", 5), ("a", 20), ("a", 100)]
    assert steps(populated.list(metrics={"loss": (">", 0.5)})) == [("a", 9)]
    assert steps(populated.list(metrics={"loss": (">=", 0.5)})) == [("a", 9), ("a", 10)]
    assert steps(populated.list(metrics={"acc": ("==", 0.4)})) == [("a", 10)]
    # Rows without the metric never match, not even "!=".
    assert steps(populated.list(metrics={"acc": ("!=", 0.4)})) == [("a", 9), ("a", 20), ("a", 100)]
    both = {"loss": ("<", 0.6), "acc": (">", 0.5)}
    assert steps(populated.list(metrics=both)) == [("a", 20), ("a", 100)]


def test_order_by_fields(populated: Catalog) -> None:
    assert steps(populated.list(order_by="-step", limit=2)) == [("a", 100), ("b", 50)]
    assert steps(populated.list(order_by="metric:loss")) == [
        ("b", 5),
        ("a", 100),
        ("a", 20),
        ("a", 10),
        ("a", 9),
        ("b", 50),  # no metric: last
    ]
    assert steps(populated.list(order_by="-metric:loss"))[:2] == [("a", 9), ("a", 10)]
    assert steps(populated.list(order_by="-metric:loss"))[-1] == ("b", 50)
    assert steps(populated.list(order_by="run")) == [
        ("a", 9),
        ("a", 10),
        ("a", 20),
        ("a", 100),
        ("b", 5),
        ("b", 50),
    ]
    assert [c.version for c in populated.list(run="a", order_by="-version")] == [4, 3, 2, 1]
    # 9 bytes each: ties break by run name.
    assert steps(populated.list(order_by="stored_bytes", limit=3)) == [
        ("b", 5),
        ("a", 9),
        ("b", 50),
    ]
    assert steps(populated.list(order_by="-logical_bytes", limit=1)) == [("a", 100)]
    created = populated.list(order_by="created_at")
    assert [c.created_at for c in created] == sorted(c.created_at for c in created)


BAD_ORDER_BY = [
    "step; DROP TABLE checkpoints",
    "__class__",
    "step desc",
    "id",
    "--step",
    "",
    "checkpoints.step",
    "metric:loss; DROP TABLE runs",
    "metric:",
]

BAD_FILTERS: list[dict[str, object]] = [
    {"metrics": {"loss": ("<;", 0.1)}},
    {"metrics": {"loss": ("LIKE", 0.1)}},
    {"metrics": {"loss": ("<", "0 OR 1=1")}},
    {"metrics": {"loss; --": ("<", 1.0)}},
    {"metrics": {"loss": "<0.1"}},
    {"metrics": {"loss": ("<", float("nan"))}},
    {"tag": "x' OR '1'='1"},
    {"run": "a' OR 1=1 --"},
    {"experiment": "e; DROP TABLE runs"},
    {"state": "COMMITTED' OR 1=1"},
    {"tier": "hot' --"},
    {"step_range": (1, "2")},
    {"step_range": (1,)},
    {"limit": 0},
    {"limit": "10"},
    {"order_by": 3},
]


def test_order_by_injection_is_refused(catalog: Catalog, save) -> None:
    save("a", 1, metrics={"loss": 0.1})
    for order_by in BAD_ORDER_BY:
        with pytest.raises(InvalidNameError) as info:
            catalog.list(order_by=order_by)
        if not order_by.startswith("metric:"):
            assert "allowed fields: step, version, created_at" in str(info.value), order_by
    assert {"checkpoints", "runs"} <= set(inspect(catalog.engine).get_table_names())
    assert len(catalog.list()) == 1


def test_filter_values_are_validated(catalog: Catalog, save) -> None:
    save("a", 1, metrics={"loss": 0.1})
    for kwargs in BAD_FILTERS:
        with pytest.raises(InvalidNameError):
            catalog.list(**kwargs)  # type: ignore[arg-type]
    assert len(catalog.list()) == 1


def test_values_are_bound_not_interpolated(catalog: Catalog, save) -> None:
    # A legal but SQL-looking tag is matched literally.
    save("a", 1, tags=["x=1,y"])
    assert len(catalog.list(tag="x=1,y")) == 1
    assert catalog.list(tag="x") == []


def test_tier_filter(catalog: Catalog, save) -> None:
    hot_only = save("r", 1)
    archived = save("r", 2)
    catalog.set_replica(archived.id, "warm", uri="s3://b/r/2", state=ReplicaState.PRESENT, bytes=5)
    copying = save("r", 3)
    catalog.set_replica(copying.id, "warm", uri="s3://b/r/3", state="COPYING")
    assert [c.id for c in catalog.list(tier="warm")] == [archived.id]
    assert [c.id for c in catalog.list(tier="hot")] == [hot_only.id, archived.id, copying.id]
    catalog.set_replica(hot_only.id, "hot", state=ReplicaState.DELETED)
    assert [c.id for c in catalog.list(tier="hot")] == [archived.id, copying.id]
    assert catalog.list(tier="cold") == []


def test_records_carry_tags_aliases_pins_replicas(catalog: Catalog, save) -> None:
    a = save("r", 1, tags=["t2", "t1"])
    catalog.alias(a.id, "zeta")
    catalog.alias(a.id, "alpha")
    catalog.pin(a.id)
    catalog.set_replica(a.id, "cold", uri="s3://c/x", state="PRESENT", bytes=3)
    catalog.set_replica(a.id, "warm", uri="s3://w/x", state="PRESENT", bytes=4)
    (ck,) = catalog.list()
    assert ck.tags == ("t1", "t2") and ck.aliases == ("alpha", "zeta") and ck.pinned
    assert [r.tier for r in ck.replicas] == ["hot", "warm", "cold"]  # fastest first
    assert ck.tiers == ("hot", "warm", "cold")
    assert ck.ref == "r@v1"


def test_usage_by_run_and_tier(catalog: Catalog, save) -> None:
    a1 = save("a", 1, stored_bytes=100)
    save("a", 2, stored_bytes=50)
    b1 = save("b", 1, stored_bytes=10)
    catalog.set_replica(a1.id, "warm", uri="s3://x", state="PRESENT", bytes=80)
    catalog.set_replica(b1.id, "warm", uri="s3://y", state="COPYING", bytes=10)  # not counted
    catalog.begin_checkpoint("b", 2)  # COPYING hot replica: not counted
    assert catalog.usage() == [
        UsageRow(run="a", tier="hot", checkpoints=2, bytes=150),
        UsageRow(run="a", tier="warm", checkpoints=1, bytes=80),
        UsageRow(run="b", tier="hot", checkpoints=1, bytes=10),
    ]
