"""Fixtures of the reliability suite: fast child processes, S3, PostgreSQL, figures.

* ``procs``: a ``forkserver`` multiprocessing context whose server preloaded torch and
  ckptstore, so every killed/racing child starts in milliseconds (importing torch costs
  seconds on the 2-core machine). Children run functions of ``ckpt_reliability_workers``.
* ``s3``: one moto server for the module; ``pg_url``: a fresh PostgreSQL database per
  module, dropped afterwards (skipped when the server does not answer, failed when
  ``CI=true``).
* ``figures``: records what a test injected and survived into ``$CKPT_RELIABILITY_REPORT``
  (JSON lines) for ``benchmarks/reliability.py``'s table.

``CKPT_RELIABILITY_FULL=1`` (set by ``make reliability``) turns the sampled cases into the
full matrix (more seeded random kill points, longer concurrency windows).
"""

from __future__ import annotations

import json
import multiprocessing
import multiprocessing.context
import os
import shutil
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

HERE = Path(__file__).parent
if str(HERE) not in sys.path:
    # Before the forkserver starts: it hands this sys.path to every child.
    sys.path.insert(0, str(HERE))

import ckpt_reliability_workers as workers  # noqa: E402
from pg_support import create_pg_database, drop_pg_database, require_pg  # noqa: E402
from process_support import end_children, preloaded_children  # noqa: E402

_PRELOAD = [
    "torch",
    "numpy",
    "zarr",
    "sqlalchemy",
    "ckptstore.store",
    "ckptstore.catalog",
    "ckptstore.ops.tiering.archive",
    "ckptstore.ops.tiering.restore",
    "ckptstore.ops.tiering.retention",
    "ckpt_reliability_workers",
]


@pytest.fixture(scope="session")
def procs() -> Iterator[multiprocessing.context.BaseContext]:
    """A multiprocessing context for the suite's child processes (forkserver, preloaded).

    The forkserver this starts is stopped when the session ends. It would otherwise live as
    long as any process holding its "alive" pipe: every child it forks gets one, so a single
    child left behind kept it running after the suite had ended.
    """
    yield from preloaded_children(_PRELOAD)


@pytest.fixture(autouse=True)
def _children_end_with_their_test() -> Iterator[None]:
    """Nothing a test starts outlives it: children still running when a test ends (a test
    that failed before joining them, or one that forgot to) are killed then."""
    yield
    end_children()


@pytest.fixture(scope="session")
def _catalog_template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An embedded catalog already upgraded to the newest schema (copied per test).

    Only migrated, never opened as a store: a store records its hot tier in its catalog, and
    a copy of that catalog would belong to the template's hot tier, not the test's.
    """
    from ckptstore.catalog import migrate

    path = tmp_path_factory.mktemp("catalog-template") / "catalog.db"
    migrate.upgrade(f"sqlite:///{path}")
    return path


@pytest.fixture
def new_root(tmp_path: Path, _catalog_template: Path) -> Callable[[str], Path]:
    """Make a store directory holding a ready catalog (skips the schema migration, which
    costs seconds on a loaded 2-core machine)."""

    def make(name: str = "store") -> Path:
        root = tmp_path / name
        root.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(_catalog_template, root / "catalog.db")
        return root

    return make


@pytest.fixture(scope="module")
def s3() -> Iterator[Any]:
    """A moto S3 server + bucket for the module (tests use distinct prefixes)."""
    from ckptstore.testing.s3 import MotoS3

    with MotoS3(fail_fast=False) as server:
        yield server


def fresh_pg_database() -> Iterator[str]:
    """Yield the URL of a new PostgreSQL database; drop it afterwards (fixture body)."""
    require_pg()
    url = create_pg_database("ckpt_rel")
    try:
        yield url
    finally:
        drop_pg_database(url)


@pytest.fixture(scope="module")
def pg_url() -> Iterator[str]:
    """URL of a fresh PostgreSQL database for this module; dropped afterwards."""
    yield from fresh_pg_database()


@pytest.fixture
def own_pg_url() -> Iterator[str]:
    """URL of a fresh PostgreSQL database for one test (``pg_url`` is shared by a module,
    and a catalog belongs to the first store that opened it)."""
    yield from fresh_pg_database()


class Figures:
    """Collects what one test injected and survived (written as one JSON line)."""

    def __init__(self, test: str) -> None:
        self.test = test
        self.data: dict[str, Any] = {}

    def add(self, key: str, value: Any = 1) -> None:
        """Add ``value`` to counter ``key`` (numbers add up; dicts merge)."""
        if isinstance(value, dict):
            target = self.data.setdefault(key, {})
            for k, v in value.items():
                target[k] = target.get(k, 0) + v
        else:
            self.data[key] = self.data.get(key, 0) + value

    def set(self, key: str, value: Any) -> None:
        """Set ``key`` to ``value``."""
        self.data[key] = value


@pytest.fixture
def figures(request: pytest.FixtureRequest) -> Iterator[Figures]:
    """Per-test figures, appended to ``$CKPT_RELIABILITY_REPORT`` (JSON lines)."""
    rec = Figures(request.node.nodeid)
    started = time.monotonic()
    yield rec
    path = os.environ.get("CKPT_RELIABILITY_REPORT")
    if path and rec.data:
        rec.data["seconds"] = round(time.monotonic() - started, 1)
        with open(path, "a", encoding="utf-8") as fh:
            fh.write(json.dumps({"test": rec.test, "figures": rec.data}) + "\n")


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """Record every test's outcome (passed / failed / xfailed / skipped) for the table."""
    path = os.environ.get("CKPT_RELIABILITY_REPORT")
    if not path or not (report.when == "call" or (report.when == "setup" and not report.passed)):
        return
    outcome = "xfailed" if hasattr(report, "wasxfail") else report.outcome
    reason = getattr(report, "wasxfail", "") or ""
    with open(path, "a", encoding="utf-8") as fh:
        fh.write(json.dumps({"test": report.nodeid, "outcome": outcome,
                             "reason": str(reason)[:300]}) + "\n")


@pytest.fixture
def w() -> Any:
    """The worker module (state builders, comparisons, child bodies)."""
    return workers
