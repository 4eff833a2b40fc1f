"""Several processes on one catalog: runs are created once, versions stay unique and
gap-free, and a writer killed mid-save leaves an invisible PENDING row for gc."""

from __future__ import annotations

import multiprocessing
import os
import signal
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from process_support import preloaded_children

from ckptstore.catalog import Catalog, migrate
from ckptstore.errors import IncompleteCheckpointError
from ckptstore.records import CheckpointState

pytestmark = pytest.mark.slow

WRITERS = 4
SAVES_EACH = 25


#: What the children's forkserver imports once: a spawned child spent about 0.75 CPU-s
#: importing these before its first query, 14 children in this module.
_PRELOAD = ["sqlalchemy", "ckptstore.catalog", "concurrency_workers"]


@pytest.fixture(scope="module")
def ctx() -> Iterator[multiprocessing.context.BaseContext]:
    """Where the racing processes start: a forkserver with the catalog imported, stopped
    with the module. When another module's forkserver runs already, spawned children
    instead (tests/process_support.py). Either way each child is a process of its own."""
    yield from preloaded_children(_PRELOAD, Path(__file__).parent)


@pytest.fixture
def workers(ctx: multiprocessing.context.BaseContext) -> ModuleType:
    """The worker module, importable by the children through the inherited sys.path
    (``ctx`` put this directory there)."""
    import concurrency_workers

    return concurrency_workers


def _collect(results: Any, expected: int) -> list[tuple[Any, ...]]:
    return [results.get(timeout=180) for _ in range(expected)]


def test_concurrent_writers_get_unique_gap_free_versions(
    catalog: Catalog, catalog_url: str, workers: ModuleType,
    ctx: multiprocessing.context.BaseContext,
) -> None:
    # One set of processes covers both races (starting processes is the slow part):
    # WRITERS processes ensure_run() the same names at once, then save into one run.
    barrier = ctx.Barrier(WRITERS)
    results = ctx.Queue()
    race = [f"race-{i}" for i in range(10)]
    args = (catalog_url, "shared", SAVES_EACH, race, barrier, results)
    procs = [ctx.Process(target=workers.save_many, args=args) for _ in range(WRITERS)]
    for p in procs:
        p.start()
    reports = _collect(results, WRITERS)
    for p in procs:
        p.join(timeout=60)
    errors = [r for r in reports if r[0] != "ok"]
    assert not errors, errors

    # ensure_run: one row per name, no error, one of the racers' config.
    runs = {r.name: r for r in catalog.runs()}
    assert sorted(runs) == sorted([*race, "shared"])
    pids = {r[1] for r in reports}
    assert all(runs[name].config["pid"] in pids for name in race)
    assert {runs[name].experiment for name in race} == {"shared-exp"}

    # begin_checkpoint: versions unique and gap-free across all processes.
    total = WRITERS * SAVES_EACH
    versions = sorted(v for r in reports for v in r[2])
    assert versions == list(range(1, total + 1))
    rows = catalog.list(run="shared", state=None, order_by="version")
    assert [c.version for c in rows] == list(range(1, total + 1))
    assert all(c.state == CheckpointState.COMMITTED for c in rows)
    assert len({c.writer for c in rows}) == WRITERS
    assert catalog.get_run("shared").checkpoints == total
    assert catalog.latest("shared").version == total
    assert len(catalog.events(run="shared", limit=1000)) == total


def test_killed_writer_leaves_an_invisible_pending_row(
    catalog: Catalog, catalog_url: str, workers: ModuleType, save: Any,
    ctx: multiprocessing.context.BaseContext,
) -> None:
    committed = save("victim", 1)
    results = ctx.Queue()
    proc = ctx.Process(target=workers.begin_and_hang, args=(catalog_url, "victim", results))
    proc.start()
    try:
        ckpt_id, writer = results.get(timeout=120)
    finally:
        assert proc.pid is not None
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(timeout=30)
    assert proc.exitcode == -signal.SIGKILL
    assert writer == f"{socket.gethostname()}:{proc.pid}"

    row = catalog.get_any(ckpt_id)
    assert row.state == CheckpointState.PENDING and row.version == 2
    with pytest.raises(IncompleteCheckpointError, match="never committed"):
        catalog.get(ckpt_id)
    assert catalog.latest("victim").id == committed.id
    assert [c.id for c in catalog.list(run="victim")] == [committed.id]
    assert ckpt_id not in [c.id for c in catalog.list()]

    time.sleep(0.05)
    assert [c.id for c in catalog.stale_pending(older_than_s=0.01)] == [ckpt_id]
    assert [c.id for c in catalog.pending_by_writer(socket.gethostname())] == [ckpt_id]
    # gc's job from here: mark it FAILED, after which it stays out of every listing.
    catalog.fail_checkpoint(ckpt_id, f"writer {writer} is dead")
    assert catalog.stale_pending(older_than_s=0.01) == []
    assert catalog.begin_checkpoint("victim", 8).version == 3  # versions move on


def test_concurrent_first_open_creates_the_schema_once(
    empty_url: str, workers: ModuleType, ctx: multiprocessing.context.BaseContext,
) -> None:
    # Several processes opening a brand-new catalog at once: one runs the migrations, the
    # others wait for it (BEGIN IMMEDIATE / advisory lock) and then find the schema at head.
    barrier = ctx.Barrier(2)
    results = ctx.Queue()
    procs = [
        ctx.Process(target=workers.open_catalog, args=(empty_url, barrier, results))
        for _ in range(2)
    ]
    for p in procs:
        p.start()
    reports = _collect(results, 2)
    for p in procs:
        p.join(timeout=60)
    assert all(r[0] == "ok" for r in reports), reports
    assert migrate.current(empty_url) == migrate.head()
    with Catalog(empty_url, upgrade=False) as cat:
        assert len(cat.runs()) == 2
