"""Run contexts and their blobs, and ``list(where=config...)``, on SQLite and PostgreSQL."""

from __future__ import annotations

import pytest
from sqlalchemy import event, inspect, text

from ckptstore.capture import blob_digest
from ckptstore.catalog import Catalog
from ckptstore.errors import IntegrityError, InvalidNameError


def _commit(catalog: Catalog, run: str, step: int) -> str:
    ck = catalog.begin_checkpoint(run, step)
    catalog.commit_checkpoint(ck.id, manifest_digest="b3:" + "0" * 64, logical_bytes=1,
                              stored_bytes=1)
    return ck.id


@pytest.fixture
def runs(catalog: Catalog) -> Catalog:
    catalog.ensure_run("a", config={"lr": 1e-4, "opt": {"name": "adam"}, "amp": True})
    catalog.ensure_run("b", config={"lr": 0.1, "opt": {"name": "sgd"}, "amp": False})
    catalog.ensure_run("c", config={"lr": "high", "opt": "none"})
    catalog.ensure_run("d")
    # Arrays are never unwrapped and null is a value of its own (on both backends).
    catalog.ensure_run("e", config={"lr": [1e-4, 1], "amp": None, "opt": {"name": ["sgd"]}})
    for run in "abcde":
        _commit(catalog, run, 1)
        _commit(catalog, run, 2)
    return catalog


@pytest.mark.parametrize(("where", "expected"), [
    ("config.lr<1e-3", {"a"}),
    ("config.lr>=0", {"a", "b"}),
    ("config.lr==high", {"c"}),
    ('config.lr=="high"', {"c"}),
    ("config.opt.name==sgd", {"b"}),
    ("config.opt.name!=sgd", {"a"}),
    ("config.amp==true", {"a"}),
    ("config.amp!=true", {"b"}),
    (["config.lr<1", "config.opt.name==adam"], {"a"}),
    ({"config.lr": (">", 0.01)}, {"b"}),
    ("config.missing<1", set()),
    ("config.amp==null", {"e"}),
    ("config.amp!=null", {"a", "b"}),
    ("config.lr!=0.1", {"a"}),
    ("config.lr!=high", set()),
    ("config.opt!=none", set()),
])
def test_config_filters(runs: Catalog, where: object, expected: set[str]) -> None:
    found = runs.list(where=where)
    assert {c.run for c in found} == expected
    assert len(found) == 2 * len(expected)


def test_config_listing_with_a_limit(runs: Catalog) -> None:
    # With a limit and many matching runs, the listing reads the order's index and keeps
    # the checkpoints of the matching runs (queries.QueriesMixin._config_runs, "scan").
    found = runs.list(where="config.lr>=0", order_by="-step", limit=3)
    assert [(c.run, c.step) for c in found] == [("b", 2), ("a", 2), ("b", 1)]
    assert [(c.run, c.step) for c in runs.list(where="config.opt.name==sgd", limit=5)] == [
        ("b", 1), ("b", 2)]


def test_cached_config_filters_keep_value_types_apart(runs: Catalog) -> None:
    # Filter texts share one statement per text; 1 == True in Python, so the mappings
    # (values of any type) must never share one: a boolean matches only a boolean.
    for _ in range(2):
        assert {c.run for c in runs.list(where="config.amp==true")} == {"a"}
        assert {c.run for c in runs.list(where={"config.amp": ("==", True)})} == {"a"}
        assert runs.list(where={"config.amp": ("==", 1)}) == []
        assert {c.run for c in runs.list(where=("config.lr<1", "config.amp==false"))} == {"b"}


@pytest.mark.parametrize("where", [
    "lr<1", "config.<1", "config.lr<", "config.lr~1", "config.a;drop table runs<1",
    "config.opt.name<adam", {"config.lr": ("like", 1)}, 42,
    "config.lr<NaN", "config.lr>-Infinity", {"config.lr": ("<", float("inf"))},
    "config.amp<true", "config.amp>=null", {"config.lr": ("==", [1])},
])
def test_bad_config_filters_are_clear_errors(runs: Catalog, where: object) -> None:
    with pytest.raises(InvalidNameError):
        runs.list(where=where)


def test_contexts_are_recorded_when_they_change(catalog: Catalog) -> None:
    catalog.ensure_run("r")
    lock = b"torch==2.0\n"
    digest = blob_digest(lock)
    doc = {"code": {"commit": "c1"}, "environment": {"lock": digest}, "config": {"lr": 1}}
    assert catalog.record_context("r", 1, doc, "d1", {digest: lock}, config={"lr": 1},
                                  code_version="git:c1")
    assert not catalog.record_context("r", 2, doc, "d1", {digest: lock})
    assert catalog.record_context("r", 3, {**doc, "config": {"lr": 2}}, "d2", {digest: lock})
    _first, second, third = (_commit(catalog, "r", s) for s in (1, 2, 3))
    assert [c.from_version for c in catalog.run_contexts("r")] == [1, 3]
    assert catalog.context_of(catalog.get(second)).digest == "d1"
    assert catalog.context_of(catalog.get(third)).digest == "d2"
    assert catalog.context_blob(digest) == lock
    run = catalog.get_run("r")
    assert run.config == {"lr": 1} and run.code_version == "git:c1"
    assert catalog.list(where="config.lr==1")[0].run == "r"


def test_a_blob_must_match_its_digest(catalog: Catalog) -> None:
    catalog.ensure_run("r")
    with pytest.raises(IntegrityError):
        catalog.record_context("r", 1, {}, "d", {blob_digest(b"x"): b"y"})
    assert catalog.run_contexts("r") == []



def test_numbers_beyond_a_double_compare_as_numbers(catalog: Catalog) -> None:
    # JSON numbers have no range; a config holding one must not break every numeric
    # filter on its key (a cast to double precision failed on PostgreSQL: "out of range").
    catalog.ensure_run("huge", config={"n": 10**400, "m": -(10**400)})
    catalog.ensure_run("small", config={"n": 5, "m": 5})
    for run in ("huge", "small"):
        _commit(catalog, run, 1)
    assert {c.run for c in catalog.list(where="config.n>1e300")} == {"huge"}
    assert {c.run for c in catalog.list(where="config.n<1e300")} == {"small"}
    assert {c.run for c in catalog.list(where="config.m<0")} == {"huge"}
    assert {c.run for c in catalog.list(where="config.n!=5")} == {"huge"}


@pytest.mark.parametrize(("where", "order_by"), [
    ("config.lr<1e-3", "step"),  # few matching runs: through the run_id index
    ("config.lr>=0", "-step"),  # many: through the order's index
    (["config.opt.name!=adam", "config.amp!=true"], "step"),  # a string, a boolean
])
def test_a_repeated_filter_is_one_statement_that_sees_new_runs(
    runs: Catalog, where: str | list[str], order_by: str
) -> None:
    # On PostgreSQL a filter listed again within seconds is read in ONE statement, the way
    # the last count of matching runs chose (queries.QueriesMixin.list); the statement still
    # selects the matching runs itself, so a run recorded meanwhile is listed at once.
    statements: list[str] = []

    def count(*args: object) -> None:
        if str(args[2]).startswith("SELECT"):
            statements.append(str(args[2]))

    first = runs.list(where=where, order_by=order_by, limit=10)
    assert first
    event.listen(runs._reader, "before_cursor_execute", count)
    try:
        assert runs.list(where=where, order_by=order_by, limit=10) == first
        assert len(statements) == (1 if runs.dialect == "postgresql" else 2), statements
        runs.ensure_run("f", config={"lr": 1e-5, "opt": {"name": "lamb"}, "amp": False})
        _commit(runs, "f", 3)
        again = runs.list(where=where, order_by=order_by, limit=10)
    finally:
        event.remove(runs._reader, "before_cursor_execute", count)
    assert {(c.run, c.step) for c in again} == {(c.run, c.step) for c in first} | {("f", 3)}


def test_filters_of_one_shape_share_a_statement_and_keep_their_values(runs: Catalog) -> None:
    # The one-statement form is built once per shape of filter, the values bound at
    # execution: a cached statement must never carry another filter's value.
    for _ in range(2):
        assert {c.run for c in runs.list(where="config.lr<1e-3")} == {"a"}
        assert {c.run for c in runs.list(where="config.lr<1")} == {"a", "b"}
        assert {c.run for c in runs.list(where="config.opt.name==sgd")} == {"b"}
        assert {c.run for c in runs.list(where="config.opt.name==adam")} == {"a"}
        assert {c.run for c in runs.list(where="config.opt.name!=sgd")} == {"a"}
        assert {c.run for c in runs.list(where="config.opt.name!=adam")} == {"b"}
        assert {c.run for c in runs.list(where="config.amp!=false")} == {"a"}
        assert {c.run for c in runs.list(where="config.amp!=true")} == {"b"}


def test_runs_config_is_indexed(catalog: Catalog) -> None:
    # PostgreSQL: a GIN index (jsonb_path_ops) that equality filters (containment) use.
    indexes = {ix["name"]: ix for ix in inspect(catalog.engine).get_indexes("runs")}
    assert indexes["ix_runs_config"]["column_names"] == ["config"]
    if catalog.dialect != "postgresql":
        return
    with catalog.engine.begin() as conn:
        conn.execute(text("SET LOCAL enable_seqscan = off"))  # a few runs: force the choice
        plan = "\n".join(row[0] for row in conn.execute(text(
            "EXPLAIN SELECT id FROM runs WHERE config @> '{\"optim\": \"sgd\"}'")))
    assert "ix_runs_config" in plan, plan
