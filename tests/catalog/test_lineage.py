"""Lineage through parent_id (one recursive CTE), descendants, edges, reproduction records."""

from __future__ import annotations

import itertools
import json
import uuid

import pytest
from sqlalchemy import Engine, event

from ckptstore.catalog import Catalog
from ckptstore.errors import CheckpointNotFoundError, InvalidNameError
from ckptstore.records import CheckpointState


def test_lineage_depth_5_across_runs(catalog: Catalog, save) -> None:
    chain = [save("pretrain", 1000)]
    for i, run in enumerate(["ft-a", "ft-b", "ft-c", "ft-d", "ft-e"]):
        chain.append(save(run, 10 * (i + 1), parent_id=chain[-1].id))
    save("pretrain", 2000)  # a later save of the root run is not an ancestor
    leaf = chain[-1]

    ancestors = catalog.lineage(leaf.ref)
    assert [c.id for c in ancestors] == [c.id for c in reversed(chain[:-1])]  # nearest first
    assert [c.run for c in ancestors] == ["ft-d", "ft-c", "ft-b", "ft-a", "pretrain"]
    assert catalog.lineage(chain[0].id) == []

    below = catalog.descendants("pretrain@1000")
    assert [c.id for c in below] == [c.id for c in chain[1:]]
    assert catalog.descendants(leaf.id) == []
    assert [c.id for c in catalog.descendants(chain[3].id)] == [chain[4].id, chain[5].id]


def test_lineage_is_one_query_whatever_the_depth(catalog: Catalog, save) -> None:
    chain = [save("r", 0)]
    for step in range(1, 12):
        chain.append(save("r", step, parent_id=chain[-1].id))
    statements: list[str] = []

    def count(conn, cursor, statement, params, context, executemany) -> None:  # type: ignore[no-untyped-def]
        if statement.lstrip().upper().startswith(("SELECT", "WITH")):
            statements.append(statement)

    # Every engine: on PostgreSQL single-statement reads have an engine of their own.
    event.listen(Engine, "before_cursor_execute", count)
    try:
        assert len(catalog.lineage(chain[-1].id)) == 11
    finally:
        event.remove(Engine, "before_cursor_execute", count)
    # Resolve the ref, then walk (one WITH RECURSIVE; aliases and replicas ride along in
    # each row): 2, not 11+.
    assert len(statements) == 2, statements
    assert sum("RECURSIVE" in s.upper() for s in statements) == 1


def test_descendants_branch_and_include_every_state(catalog: Catalog, save) -> None:
    root = save("r", 1)
    left = save("left", 1, parent_id=root.id)
    right = save("right", 1, parent_id=root.id)
    grand = catalog.begin_checkpoint("left", 2, parent_id=left.id)  # PENDING child
    found = catalog.descendants(root.id)
    assert [c.id for c in found] == [left.id, right.id, grand.id]
    assert found[-1].state == CheckpointState.PENDING


def test_pruned_ancestors_stay_in_the_lineage(catalog: Catalog, save) -> None:
    root = save("r", 1)
    child = save("r", 2, parent_id=root.id)
    catalog.mark_deleting(root.id)
    catalog.mark_deleted(root.id)
    (ancestor,) = catalog.lineage(child.id)
    assert ancestor.id == root.id and ancestor.state == CheckpointState.DELETED


def test_edges(catalog: Catalog, save) -> None:
    src = save("r", 1)
    dst = save("converted", 1)
    other = save("merge", 1)
    catalog.add_edge(src.id, dst.id, "converted-from")
    catalog.add_edge(src.id, dst.id, "converted-from")  # idempotent
    catalog.add_edge("r@v1", "merge@latest", "merged-from")
    catalog.add_edge(dst.id, other.id, "merged-from")
    assert catalog.edges(dst.id) == [
        (src.id, dst.id, "converted-from"),
        (dst.id, other.id, "merged-from"),
    ]
    assert len(catalog.edges(src.id)) == 2
    with pytest.raises(InvalidNameError, match="edge kind"):
        catalog.add_edge(src.id, dst.id, "copied-from")
    with pytest.raises(InvalidNameError, match="itself"):
        catalog.add_edge(src.id, src.id, "resumed-from")
    with pytest.raises(CheckpointNotFoundError):
        catalog.add_edge(src.id, "ghost@latest", "resumed-from")


def test_edges_among_keeps_edges_with_both_ends_in_the_set(catalog: Catalog, save) -> None:
    a, b, c, d = (save(run, 1) for run in ("a", "b", "c", "d"))
    catalog.add_edge(a.id, b.id, "converted-from")
    catalog.add_edge(b.id, c.id, "merged-from")
    catalog.add_edge(a.id, d.id, "fine-tuned-from")
    catalog.mark_deleting(d.id)
    catalog.mark_deleted(d.id)  # edges outlive pruning
    assert catalog.edges_among([a.id, b.id, c.id, d.id]) == [
        (a.id, b.id, "converted-from"),
        (b.id, c.id, "merged-from"),
        (a.id, d.id, "fine-tuned-from"),
    ]
    assert catalog.edges_among({b.id, c.id}) == [(b.id, c.id, "merged-from")]
    assert catalog.edges_among([a.id, c.id]) == []  # a -> b -> c: b is outside the set
    assert catalog.edges_among([a.id.upper(), b.id]) == [(a.id, b.id, "converted-from")]
    assert catalog.edges_among([]) == []
    assert catalog.edges_among([str(uuid.uuid4())]) == []


def test_edges_among_is_one_query(catalog: Catalog, save) -> None:
    cks = [save("r", step) for step in range(6)]
    for src, dst in itertools.pairwise(cks):
        catalog.add_edge(src.id, dst.id, "converted-from")
    statements: list[str] = []

    def count(conn, cursor, statement, params, context, executemany) -> None:  # type: ignore[no-untyped-def]
        if statement.lstrip().upper().startswith("SELECT"):
            statements.append(statement)

    event.listen(catalog.engine, "before_cursor_execute", count)
    try:
        assert len(catalog.edges_among(ck.id for ck in cks)) == 5
    finally:
        event.remove(catalog.engine, "before_cursor_execute", count)
    assert len(statements) == 1, statements


def test_edges_among_beyond_one_statement(
    catalog: Catalog, save, monkeypatch: pytest.MonkeyPatch
) -> None:
    import ckptstore.catalog.core as catalog_core

    cks = [save("r", step) for step in range(5)]
    catalog.add_edge(cks[0].id, cks[4].id, "merged-from")
    catalog.add_edge(cks[1].id, cks[2].id, "converted-from")
    # Ids fill several statements: an edge between two batches is still found.
    monkeypatch.setattr(catalog_core, "MAX_BOUND_IDS", 2)
    assert sorted(catalog.edges_among(ck.id for ck in cks)) == sorted([
        (cks[0].id, cks[4].id, "merged-from"),
        (cks[1].id, cks[2].id, "converted-from"),
    ])
    assert catalog.edges_among([cks[0].id, cks[2].id, cks[3].id]) == []


def test_edges_among_refuses_what_is_not_an_id_list(catalog: Catalog, save) -> None:
    ck = save("r", 1)
    with pytest.raises(InvalidNameError, match="not a uuid"):
        catalog.edges_among([ck.id, "r@latest"])
    with pytest.raises(InvalidNameError, match="single string"):
        catalog.edges_among(ck.id)


def test_run_record(catalog: Catalog, save) -> None:
    catalog.ensure_run(
        "base",
        experiment="e",
        config={"lr": 3e-4},
        code_version="c0ffee",
        data_version="d1",
        host="gpu-7",
    )
    parent = save("base", 100, metrics={"loss": 1.5})
    ck = save("base", 200, metrics={"loss": 0.5}, tags=["release"], parent_id=parent.id)
    catalog.set_replica(ck.id, "warm", uri="s3://bucket/base/x", state="PRESENT", bytes=99)
    catalog.add_edge(parent.id, ck.id, "resumed-from")
    record = catalog.run_record("base@200")

    json.dumps(record)  # JSON-ready
    assert record["run"]["config"] == {"lr": 3e-4}
    assert record["run"]["code_version"] == "c0ffee" and record["run"]["host"] == "gpu-7"
    assert record["checkpoint"]["id"] == ck.id and record["checkpoint"]["step"] == 200
    assert record["parents"] == [{"id": parent.id, "ref": "base@v1", "state": "COMMITTED"}]
    assert record["metrics"] == {"loss": 0.5} and record["tags"] == ["release"]
    assert [r["tier"] for r in record["replicas"]] == ["hot", "warm"]
    assert record["edges"] == [{"src": parent.id, "dst": ck.id, "kind": "resumed-from"}]


# --------------------------------------------------------------------------- merges
def test_record_merge_writes_every_parent_and_the_event_at_once(catalog: Catalog, save) -> None:
    a, b, c = (save(run, 1) for run in ("a", "b", "c"))
    merged = save("m", 1)
    catalog.record_merge(merged.id, [(a.id, 0.5), ("b@latest", 0.25), (c.id, 0.25)],
                         {"method": "weighted", "weights": [0.5, 0.25, 0.25]})
    inputs = catalog.merge_inputs("m@latest")
    assert [(i.src, i.weight, i.position) for i in inputs] == [
        (a.id, 0.5, 0), (b.id, 0.25, 1), (c.id, 0.25, 2)]
    assert catalog.edges(merged.id) == [(p.id, merged.id, "merged-from") for p in (a, b, c)]
    (event_row,) = catalog.events(merged.id, kind="merged")
    assert event_row.detail["method"] == "weighted" and event_row.run == "m"
    assert catalog.run_record(merged.id)["edges"][0] == {
        "src": a.id, "dst": merged.id, "kind": "merged-from", "weight": 0.5, "position": 0}
    assert catalog.merge_inputs(a.id) == []  # an input is not itself a merge
    # Recording it again changes nothing (idempotent edges).
    catalog.record_merge(merged.id, [(a.id, 0.5), (b.id, 0.25), (c.id, 0.25)], {})
    assert len(catalog.merge_inputs(merged.id)) == 3


@pytest.mark.parametrize(
    ("parents", "words"),
    [
        ([("a", 1.0)], "two or more"),
        ([("a", 0.5), ("a", 0.5)], "two or more distinct"),
        ([("a", 0.5), ("m", 0.5)], "itself"),
        ([("a", 1.5), ("b", 0.5)], "in \\[0, 1\\]"),
        ([("a", float("nan")), ("b", 0.5)], "in \\[0, 1\\]"),
        ([("a", 0.5), ("ghost", 0.5)], "ghost"),
    ],
)
def test_record_merge_refuses_bad_parents_and_writes_nothing(
    catalog: Catalog, save, parents: list[tuple[str, float]], words: str
) -> None:
    ids = {run: save(run, 1).id for run in ("a", "b", "m")}
    resolved = [(ids.get(p, "ghost@latest"), w) for p, w in parents]
    with pytest.raises((InvalidNameError, CheckpointNotFoundError), match=words):
        catalog.record_merge(ids["m"], resolved, {"method": "mean"})
    assert catalog.edges(ids["m"]) == [] and catalog.events(ids["m"], kind="merged") == []


def test_only_merge_edges_carry_weights(catalog: Catalog, save) -> None:
    a, b = save("a", 1), save("b", 1)
    with pytest.raises(InvalidNameError, match="only merged-from"):
        catalog.add_edge(a.id, b.id, "converted-from", weight=0.5)
    catalog.add_edge(a.id, b.id, "merged-from", weight=0.5, position=1)  # a copied edge
    assert [(link.weight, link.position) for link in catalog.links(b.id)] == [(0.5, 1)]
    assert [(link.weight, link.position) for link in catalog.links_among([a.id, b.id])] == [
        (0.5, 1)]


def test_lineage_graph_follows_parents_and_merges_as_a_dag(catalog: Catalog, save) -> None:
    """base -> {a, b} (fine-tuned); m1 = merge(a, b); m2 = merge(m1, a): a is reached by
    two paths and listed once, at its nearest distance."""
    base = save("base", 1)
    a = save("a", 1, parent_id=base.id)
    b = save("b", 1, parent_id=base.id)
    m1 = save("m", 1)
    catalog.record_merge(m1.id, [(a.id, 0.5), (b.id, 0.5)], {})
    m2 = save("m", 2)
    catalog.record_merge(m2.id, [(m1.id, 0.75), (a.id, 0.25)], {})
    after = save("ft", 1, parent_id=m2.id)
    save("unrelated", 1)

    up = catalog.lineage_graph(after.ref)
    assert up.root.id == after.id
    assert [n.id for n in up.nodes[:1]] == [m2.id]
    assert {n.id for n in up.nodes} == {m2.id, m1.id, a.id, b.id, base.id}
    assert len(up.nodes) == 5
    depth_of = {n.id: i for i, n in enumerate(up.nodes)}
    assert depth_of[a.id] < depth_of[b.id]  # a at distance 2 (via m2), b at 3 (via m1)
    assert {(link.src, link.dst, link.kind, link.weight) for link in up.links} == {
        (m2.id, after.id, "parent", None), (m1.id, m2.id, "merged-from", 0.75),
        (a.id, m2.id, "merged-from", 0.25), (a.id, m1.id, "merged-from", 0.5),
        (b.id, m1.id, "merged-from", 0.5), (base.id, a.id, "parent", None),
        (base.id, b.id, "parent", None)}

    down = catalog.lineage_graph(base.id, descendants=True)
    assert {n.id for n in down.nodes} == {a.id, b.id, m1.id, m2.id, after.id}
    assert [n.id for n in down.nodes[-1:]] == [after.id]
    assert catalog.lineage_graph("unrelated@latest").nodes == []


def test_lineage_graph_is_one_walk_whatever_the_depth(catalog: Catalog, save) -> None:
    chain = [save("r", 0)]
    for step in range(1, 12):
        chain.append(save("r", step, parent_id=chain[-1].id))
    side = save("side", 1)
    merged = save("m", 1)
    catalog.record_merge(merged.id, [(chain[-1].id, 0.5), (side.id, 0.5)], {})
    statements: list[str] = []

    def count(conn, cursor, statement, params, context, executemany) -> None:  # type: ignore[no-untyped-def]
        if "WITH RECURSIVE" in statement.upper():
            statements.append(statement)

    event.listen(catalog.engine, "before_cursor_execute", count)
    try:
        graph = catalog.lineage_graph(merged.id)
    finally:
        event.remove(catalog.engine, "before_cursor_execute", count)
    assert len(graph.nodes) == 13 and len(statements) == 1
