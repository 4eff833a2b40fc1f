"""Resolving references: every kind, COMMITTED-only, and errors that list what exists."""

from __future__ import annotations

import uuid

import pytest

from ckptstore.catalog import Catalog
from ckptstore.errors import CheckpointNotFoundError, IncompleteCheckpointError, InvalidNameError
from ckptstore.records import CheckpointState
from ckptstore.refs import parse_ref


def test_every_ref_kind_resolves(catalog: Catalog, save) -> None:
    a = save("run-a", 9, metrics={"loss": 0.9, "acc": 0.1})
    b = save("run-a", 10, metrics={"loss": 0.2, "acc": 0.7})
    c = save("run-a", 100, metrics={"loss": 0.5, "acc": 0.9})
    catalog.alias(b.id, "prod")

    assert catalog.get(a.id) == a.__class__(**{**a.__dict__})  # by id (a plain record)
    assert catalog.get("run-a@latest").id == c.id
    assert catalog.get("run-a@10").id == b.id
    assert catalog.get("run-a@v1").id == a.id
    assert catalog.get("run-a@best:loss").id == b.id
    assert catalog.get("run-a@best:loss:min").id == b.id
    assert catalog.get("run-a@best:acc:max").id == c.id
    assert catalog.get("prod").id == b.id
    assert catalog.get(parse_ref("run-a@v2")).id == b.id
    assert catalog.latest("run-a").id == c.id
    assert catalog.best("run-a", "loss").id == b.id
    assert catalog.best("run-a", "acc", mode="max").id == c.id


def test_steps_sort_numerically(catalog: Catalog, save) -> None:
    # Saved out of order and across the 9 -> 10 digit boundary: text sorting would pick 9.
    save("r", 10)
    save("r", 9)
    assert catalog.get("r@latest").step == 9  # latest is the highest VERSION
    assert [c.step for c in catalog.list(run="r")] == [9, 10]
    assert [c.step for c in catalog.list(run="r", order_by="-step")] == [10, 9]
    save("r", 100)
    save("r", 11)
    assert [c.step for c in catalog.list(run="r")] == [9, 10, 11, 100]


def test_resaving_a_step_makes_a_new_version(catalog: Catalog, save) -> None:
    first = save("r", 5, metrics={"loss": 1.0})
    second = save("r", 5, metrics={"loss": 0.5})
    assert (first.version, second.version) == (1, 2)
    assert catalog.get("r@5").id == second.id  # newest version at that step
    assert catalog.get("r@v1").id == first.id
    assert catalog.get(first.id).metrics == {"loss": 1.0}


def test_best_ties_go_to_the_newest_version(catalog: Catalog, save) -> None:
    save("r", 1, metrics={"loss": 0.5})
    newer = save("r", 2, metrics={"loss": 0.5})
    assert catalog.best("r", "loss").id == newer.id
    assert catalog.best("r", "loss", mode="max").id == newer.id


def test_best_ignores_checkpoints_of_other_runs_and_uncommitted(catalog: Catalog, save) -> None:
    save("other", 1, metrics={"loss": 0.01})
    mine = save("r", 1, metrics={"loss": 0.5})
    catalog.begin_checkpoint("r", 2, metrics={"loss": 0.001})  # PENDING: never best
    assert catalog.best("r", "loss").id == mine.id


def test_pending_rows_are_invisible_to_refs(catalog: Catalog, save) -> None:
    done = save("r", 1)
    pending = catalog.begin_checkpoint("r", 2)
    assert catalog.get("r@latest").id == done.id
    with pytest.raises(CheckpointNotFoundError, match="never committed"):
        catalog.get("r@2")
    with pytest.raises(CheckpointNotFoundError, match="v2 is PENDING"):
        catalog.get(f"r@v{pending.version}")


def test_incomplete_by_id_says_so(catalog: Catalog, save) -> None:
    save("r", 1)
    pending = catalog.begin_checkpoint("r", 7)
    with pytest.raises(IncompleteCheckpointError) as info:
        catalog.get(pending.id)
    text = str(info.value)
    assert pending.id in text and "run 'r' step 7" in text and "PENDING" in text
    assert "ckpt gc" in text

    catalog.fail_checkpoint(pending.id, "disk full")
    with pytest.raises(IncompleteCheckpointError, match="FAILED"):
        catalog.get(pending.id)
    assert catalog.get_any(pending.id).state == CheckpointState.FAILED


def test_pruned_by_id_says_pruned(catalog: Catalog, save) -> None:
    ck = save("r", 1)
    catalog.mark_deleting(ck.id)
    with pytest.raises(CheckpointNotFoundError, match="being pruned"):
        catalog.get(ck.id)
    catalog.mark_deleted(ck.id)
    with pytest.raises(CheckpointNotFoundError, match="was pruned"):
        catalog.get(ck.id)
    assert catalog.get_any(ck.id).state == CheckpointState.DELETED


def test_not_found_lists_committed_steps(catalog: Catalog, save) -> None:
    save("a", 100)
    save("a", 200)
    save("a", 200)
    with pytest.raises(CheckpointNotFoundError) as info:
        catalog.get("a@7")
    assert str(info.value) == "run 'a' has no step 7; committed steps: 100, 200 (latest v3)"


def test_not_found_lists_versions_and_metrics(catalog: Catalog, save) -> None:
    save("a", 1, metrics={"loss": 1.0, "lr": 0.1})
    save("a", 2)
    with pytest.raises(CheckpointNotFoundError, match=r"no version v9; committed versions: v1, v2"):
        catalog.get("a@v9")
    with pytest.raises(CheckpointNotFoundError, match="metrics recorded: loss, lr"):
        catalog.get("a@best:acc")


def test_long_step_lists_are_shortened_around_the_request(catalog: Catalog, save) -> None:
    for step in range(0, 2500, 100):
        save("a", step)
    with pytest.raises(CheckpointNotFoundError) as info:
        catalog.get("a@1550")
    text = str(info.value)
    assert "1500, 1600" in text and "(25 in total)" in text and "..." in text


def test_unknown_run_lists_runs(catalog: Catalog, save) -> None:
    with pytest.raises(CheckpointNotFoundError, match="no runs exist yet"):
        catalog.get("ghost@latest")
    save("a", 1)
    save("b", 1)
    for ref in ("ghost@latest", "ghost@3", "ghost@v1", "ghost@best:loss"):
        with pytest.raises(
            CheckpointNotFoundError, match=r"run 'ghost' does not exist; runs: a, b"
        ):
            catalog.get(ref)
    with pytest.raises(CheckpointNotFoundError, match="runs: a, b"):
        catalog.latest("ghost")


def test_run_without_commits_says_what_it_has(catalog: Catalog) -> None:
    catalog.begin_checkpoint("r", 1)
    with pytest.raises(CheckpointNotFoundError, match=r"no committed checkpoints \(1 PENDING\)"):
        catalog.latest("r")


def test_unknown_id_and_alias(catalog: Catalog, save) -> None:
    save("a", 1)
    missing = str(uuid.uuid4())
    with pytest.raises(CheckpointNotFoundError, match=f"no checkpoint has id {missing}; runs: a"):
        catalog.get(missing)
    with pytest.raises(CheckpointNotFoundError, match=r"no alias 'prod'.*no aliases are defined"):
        catalog.get("prod")


def test_not_found_is_a_lookup_error(catalog: Catalog) -> None:
    with pytest.raises(LookupError):
        catalog.get("nothing@latest")


@pytest.mark.parametrize("bad", ["", "a@", "a@vx", "../etc@latest", "a@best:", 42, None])
def test_unparsable_refs_are_invalid(catalog: Catalog, bad: object) -> None:
    with pytest.raises(InvalidNameError):
        catalog.get(bad)  # type: ignore[arg-type]


def test_best_rejects_bad_mode_and_metric(catalog: Catalog) -> None:
    with pytest.raises(InvalidNameError):
        catalog.best("r", "loss", mode="median")
    with pytest.raises(InvalidNameError):
        catalog.best("r", "loss; DROP TABLE runs")
