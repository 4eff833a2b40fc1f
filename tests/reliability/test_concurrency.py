"""Concurrency on SQLite and PostgreSQL: savers, pruners, archivers and restorers at once.

Every worker is its own process (forkserver children) and runs for a bounded time. After
each test: no unexpected error in any worker, versions unique and gap-free, everything
committed and not pruned loads bit-exactly, and the store-wide invariants hold.
"""

from __future__ import annotations

import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import ckpt_reliability_checks as checks
import pytest
from ckpt_reliability_checks import FULL, join, start_child

from ckptstore.ops.tiering.archive import archive_checkpoints
from ckptstore.ops.tiering.retention import apply_retention
from ckptstore.records import CheckpointState, ReplicaState
from ckptstore.retention import RetentionPolicy
from ckptstore.store import CheckpointStore
from ckptstore.testing.invariants import check_invariants

NBYTES = 512 * 1024
SECONDS = 20.0 if FULL else 6.0
TABLES = ("leases", "events", "aliases", "lineage_edges", "replicas", "checkpoint_metrics",
          "checkpoint_tags", "checkpoints", "runs", "experiments", "store_meta")


@pytest.fixture(params=["sqlite", "postgresql"])
def backend(request: pytest.FixtureRequest, new_root: Any) -> tuple[Path, str | None]:
    """(store root, catalog URL): an embedded SQLite catalog, or an emptied PostgreSQL one."""
    root = new_root()
    if request.param == "sqlite":
        return root, None
    url = request.getfixturevalue("pg_url")
    from sqlalchemy import create_engine, text

    from ckptstore.catalog import migrate

    migrate.upgrade(url)  # once per module; a no-op afterwards
    engine = create_engine(url)
    with engine.begin() as conn:
        # store_meta too: the catalog then belongs to no store, and this test's adopts it.
        conn.execute(text("TRUNCATE " + ", ".join(TABLES) + " CASCADE"))
    engine.dispose()
    CheckpointStore.open(root, catalog_url=url).close()
    return root, url


def _open_kwargs(tmp_path: Path, url: str | None, **extra: Any) -> dict[str, Any]:
    opts: dict[str, Any] = {"chunk_bytes": 128 * 1024, **extra}
    if url is not None:
        opts["catalog_url"] = url
    return opts


def _collect(queue: Any, n: int) -> list[dict[str, Any]]:
    return [queue.get(timeout=SECONDS + 180) for _ in range(n)]


def _assert_versions(store: CheckpointStore, run: str) -> None:
    rows = store.catalog.list(run=run, state=None, order_by="version")
    versions = [ck.version for ck in rows]
    assert versions == list(range(1, len(versions) + 1)), versions


@pytest.mark.slow
def test_mixed_workload(tmp_path: Path, procs: Any, backend: Any, w: Any,
                        figures: Any) -> None:
    root, url = backend
    run = f"mix-{uuid.uuid4().hex[:6]}"
    opts = _open_kwargs(tmp_path, url, warm=str(tmp_path / "warm"))
    with CheckpointStore.open(root, **opts) as store:
        first = store.save(run, 0, w.make_state(0, NBYTES))
        assert first.version == 1
    queue, start = procs.Queue(), procs.Event()
    children = [
        start_child(procs, w.saver, str(root), opts, run,
                    SECONDS, 1, NBYTES, queue, start),
        start_child(procs, w.saver, str(root), opts, run,
                    SECONDS, 2, NBYTES, queue, start),
        start_child(procs, w.pruner, str(root), opts,
                    ["hot", "warm"], SECONDS, 3, queue, start),
        start_child(procs, w.archiver, str(root), opts,
                    SECONDS, 4, queue, start),
        start_child(procs, w.restorer, str(root), opts, run,
                    SECONDS, 5, queue, start),
    ]
    start.set()
    stats = _collect(queue, len(children))
    for child in children:
        assert join(child, 60) == 0
    errors = [e for s in stats for e in s["errors"]]
    assert errors == [], "\n".join(errors)
    by_role = Counter(s["role"] for s in stats)
    assert by_role == {"saver": 2, "pruner": 1, "archiver": 1, "restorer": 1}
    saved = {first.id: 0, **{cid: seed for s in stats for cid, seed in s["saved"]}}
    assert len(saved) >= 2, stats
    with CheckpointStore.open(root, **opts) as store:
        _assert_versions(store, run)
        states = Counter(str(ck.state) for ck in store.catalog.list(run=run, state=None))
        assert set(states) <= {"COMMITTED", "DELETED"}, states
        expected = {cid: (seed, NBYTES) for cid, seed in saved.items()
                    if store.catalog.get_any(cid).state == CheckpointState.COMMITTED}
        checks.assert_sound(store)
        assert checks.present_copies(store) == []
        assert checks.remote_claims(store, "warm") == []
        checks.assert_loads_bit_exact(store, expected)
        loaded = sum(len(s.get("loaded", [])) for s in stats)
        expected_errors: Counter[str] = Counter()
        for s in stats:
            for kind, n in s["expected"].items():
                expected_errors[kind] += n if isinstance(n, int) else len(n)
        figures.set(f"concurrency_{(url and 'postgresql') or 'sqlite'}", {
            "workers": len(children), "seconds": SECONDS, "saves": len(saved),
            "pruned": sum(s.get("pruned", 0) for s in stats),
            "archived": sum(s.get("archived", 0) for s in stats), "restored_loads": loaded,
            "typed_race_outcomes": dict(expected_errors), "lost": 0,
        })
    _assert_no_races(expected_errors)


def _assert_no_races(outcomes: Counter[str]) -> None:
    """Racing flows end in a result or a typed refusal (a lease held, a checkpoint pruned
    meanwhile), never in files vanishing under a restore, a load or a prune: those re-plan
    (tests/ops/reading/test_load_race.py, test_restore_inside_prune_window)."""
    raced = {k: v for k, v in outcomes.items()
             if k in ("StorageError", "IntegrityError", "MissingBaseError", "retention-failed",
                      "archive-failed")}
    assert not raced, f"failures from racing flows: {raced}"


def test_same_run_and_step_from_two_processes(tmp_path: Path, procs: Any, backend: Any,
                                              w: Any, figures: Any) -> None:
    root, url = backend
    opts = _open_kwargs(tmp_path, url)
    rounds = 6 if FULL else 2
    run = f"same-{uuid.uuid4().hex[:6]}"
    expected: checks.Expected = {}
    for r in range(rounds):
        queue, barrier = procs.Queue(), procs.Barrier(2)
        children = [start_child(procs, w.same_step_saver, str(root), opts, run, 7,
                                100 * r + i, NBYTES, barrier, queue) for i in range(2)]
        results = [queue.get(timeout=180) for _ in children]
        for child in children:
            assert join(child, 60) == 0
        assert [x[0] for x in results] == ["ok", "ok"], results
        for _, cid, _version, seed in results:
            expected[cid] = (seed, NBYTES)
    with CheckpointStore.open(root, **opts) as store:
        rows = store.catalog.list(run=run, state=None, order_by="version")
        assert [ck.version for ck in rows] == list(range(1, 2 * rounds + 1))
        assert {ck.step for ck in rows} == {7}
        assert all(ck.state == CheckpointState.COMMITTED for ck in rows)
        assert store.get(f"{run}@7").version == 2 * rounds  # newest version of the step
        checks.assert_loads_bit_exact(store, expected)
        checks.assert_sound(store)
    figures.add("same_step_races", rounds)


def test_prune_racing_restore(tmp_path: Path, procs: Any, backend: Any, w: Any,
                              figures: Any) -> None:
    """Restores of old checkpoints (only on warm) race retention deleting them."""
    root, url = backend
    opts = _open_kwargs(tmp_path, url, warm=str(tmp_path / "warm"))
    run = f"race-{uuid.uuid4().hex[:6]}"
    with CheckpointStore.open(root, **opts) as store:
        for i in range(4):
            store.save(run, i, w.make_state(i, NBYTES))
        archive_checkpoints(store, tier="warm", threads=2)
        apply_retention(store, tier="hot", policy=RetentionPolicy(keep_last=1))
        assert sum(ck.replica("hot").state == ReplicaState.PRESENT for ck in store.list()) == 1
    queue, start = procs.Queue(), procs.Event()
    children = [
        start_child(procs, w.restorer, str(root), opts, run, SECONDS / 2, 9, queue, start),
        start_child(procs, w.pruner, str(root), opts, ["warm", "hot"], SECONDS / 2, 8, queue,
                    start),
    ]
    start.set()
    stats = _collect(queue, 2)
    for child in children:
        assert join(child, 60) == 0
    errors = [e for s in stats for e in s["errors"]]
    assert errors == [], "\n".join(errors)
    outcomes = Counter({k: (v if isinstance(v, int) else len(v))
                        for s in stats for k, v in s["expected"].items()})
    with CheckpointStore.open(root, **opts) as store:
        checks.assert_sound(store)
        assert checks.present_copies(store) == []
        newest = store.latest(run)
        assert store.catalog.get(newest.id).state == CheckpointState.COMMITTED
    figures.add("prune_restore_races", sum(len(s.get("loaded", [])) for s in stats))
    figures.set("prune_restore_outcomes", dict(outcomes))
    # A restore either completes (and loads bit-exactly, checked in the child) or is told
    # the checkpoint is gone; a file vanishing mid-restore or mid-load is never the outcome.
    _assert_no_races(outcomes)


def test_restore_inside_prune_window(tmp_path: Path, procs: Any, backend: Any, w: Any,
                                     figures: Any) -> None:
    """Deterministic interleaving: retention has checked the leases and is about to delete
    the checkpoint when a restore of it starts; the deletion then runs mid-restore. The
    restore must finish, or be refused (lease held / checkpoint gone) - never die half way
    on vanished files."""
    root, url = backend
    opts = _open_kwargs(tmp_path, url, warm=str(tmp_path / "warm"))
    run = f"window-{uuid.uuid4().hex[:6]}"
    with CheckpointStore.open(root, **opts) as store:
        for i in range(2):
            store.save(run, i, w.make_state(i, w.NBYTES_RACE))
        archive_checkpoints(store, tier="warm", threads=2)
        apply_retention(store, tier="hot", policy=RetentionPolicy(keep_last=1))
        oldest = store.list(run=run, order_by="step")[0]
    queue = procs.Queue()
    checked, go, mid, resume, blocked = (procs.Event() for _ in range(5))
    pruner = start_child(procs, w.prune_paused, str(root), opts, "warm", 1, checked, go, queue)
    assert checked.wait(60), "retention never reached the deletion"
    restorer = start_child(procs, w.restore_paused, str(root), opts, oldest.id, mid, resume,
                           queue, blocked)
    # The restore is copying (``mid``), waiting for the lease retention holds (``blocked``:
    # then it never gets to ``mid`` before ``go``), or refused up front (it ends): whichever
    # comes first.
    deadline = time.monotonic() + 60
    while not (mid.wait(0.02) or blocked.is_set()) and restorer.is_alive():
        assert time.monotonic() < deadline, "the restore neither copied, waited nor ended"
    go.set()
    results = {}
    results.update({r[0]: r[1:] for r in [queue.get(timeout=120)]})
    resume.set()
    results.update({r[0]: r[1:] for r in [queue.get(timeout=120)]})
    for child in (pruner, restorer):
        assert join(child, 60) == 0
    assert "pruner-error" not in results and "restorer-error" not in results, results
    outcome, message = results["restorer"]
    assert outcome != "WRONG TENSOR"
    figures.add("prune_restore_races", 1)
    with CheckpointStore.open(root, **opts) as store:
        assert checks.present_copies(store) == []
        problems = check_invariants(store)
        assert problems == [], problems
    assert outcome in ("ok", "CheckpointNotFoundError", "LeaseHeldError"), (outcome, message)


def test_two_archivers_at_once(tmp_path: Path, procs: Any, backend: Any, w: Any, s3: Any,
                               figures: Any) -> None:
    root, url = backend
    opts = _open_kwargs(tmp_path, url, warm=s3.url(f"{uuid.uuid4().hex[:10]}/warm"),
                        storage_options=s3.storage_options)
    run = f"arch-{uuid.uuid4().hex[:6]}"
    with CheckpointStore.open(root, **opts) as store:
        ids = [store.save(run, i, w.make_state(i, NBYTES)).id for i in range(4)]
    queue, start = procs.Queue(), procs.Event()
    children = [start_child(procs, w.archiver, str(root), opts, 0.5, i, queue, start)
                for i in range(2)]
    start.set()
    stats = _collect(queue, 2)
    for child in children:
        assert join(child, 60) == 0
    assert [e for s in stats for e in s["errors"]] == []
    assert sum(s.get("archived", 0) for s in stats) == len(ids)  # each copied exactly once
    with CheckpointStore.open(root, **opts) as store:
        for cid in ids:
            assert store.catalog.get(cid).replica("warm").state == ReplicaState.PRESENT
            archived = [e for e in store.events(cid) if e.kind == "archived"]
            assert len(archived) == 1, archived
        assert checks.remote_claims(store, "warm") == []
        checks.assert_sound(store)
    figures.add("archive_races", 1)
