"""Session-wide test settings.

Prefect reads its settings at import, so its home and noise settings are fixed here, before
any test module imports it. Flow tests share one harness in tests/flows/conftest.py; the tests
that need a real ``prefect server start`` share the session's ``real_prefect_server``.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import os
import re
import shutil
import tempfile
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

#: Where the run's temporary directories go when the command line names none (``--basetemp``):
#: the machine's memory file system, if it has :data:`MEMORY_TMP_MIN_FREE` bytes free.
MEMORY_TMP_PARENT = Path("/dev/shm")
#: A whole run holds at most about 1.1 GB there at a time (a passed test's directory is
#: removed when it ends: ``tmp_path_retention_policy`` in pyproject.toml).
MEMORY_TMP_MIN_FREE = 4 * 2**30


def _memory_tmp_usable(parent: Path) -> bool:
    """Whether ``parent`` exists, is writable and has :data:`MEMORY_TMP_MIN_FREE` free."""
    try:
        st = os.statvfs(parent)
    except OSError:
        return False
    return os.access(parent, os.W_OK) and st.f_bavail * st.f_frsize >= MEMORY_TMP_MIN_FREE


def _memory_tmp_prefix(kind: str) -> str:
    """The name of a temporary directory of this process in memory starts with this: the
    process id in it tells :func:`_sweep_memory_tmp` whether its owner still runs."""
    return f"ckpt-{kind}-{os.getpid()}-"


_PREFECT_HOME = tempfile.mkdtemp(
    prefix=_memory_tmp_prefix("prefect-home"),
    dir=MEMORY_TMP_PARENT if _memory_tmp_usable(MEMORY_TMP_PARENT) else None)
# Removed when this process exits (a Prefect database of about 5 MB where a test ran a flow,
# in memory like the tests' directories: the temporary Prefect servers of the processes the
# tests start write it): registered before Prefect is imported, so it runs after Prefect's own
# exit handlers, which stop the temporary server that writes there.
atexit.register(shutil.rmtree, _PREFECT_HOME, ignore_errors=True)
os.environ.setdefault("PREFECT_HOME", _PREFECT_HOME)
os.environ["PREFECT_SERVER_ANALYTICS_ENABLED"] = "false"
os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
# A loaded 2-core machine can take longer than the default 20 s to start the ephemeral API.
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")
# Tests must never reach outside the machine; AWS credentials are fakes for moto.
os.environ.setdefault("AWS_ACCESS_KEY_ID", "testing")
os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "testing")
os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
# Saves record their run's context (git state, package lock) unless told not to; the suite
# runs inside this repository, whose working tree every first save would otherwise read.
# Tests of the capture turn it on (tests/ops/writing/test_context.py: ``capture_on``).
os.environ.setdefault("CKPT_CAPTURE", "0")
for _var in ("CKPT_CONFIG", "CKPT_ROOT", "CKPT_CATALOG_URL", "CKPT_FAULT_POINT", "CKPT_RESUME"):
    os.environ.pop(_var, None)


#: How to end the session's Prefect resources (the server, the flow tests' client
#: settings) before the session ends, newest first: see :func:`pytest_runtest_teardown`.
PREFECT_CLOSERS: list[Callable[[], None]] = []


@pytest.fixture(scope="session")
def prefect_closers() -> list[Callable[[], None]]:
    """:data:`PREFECT_CLOSERS`, for the session fixtures of other directories' conftests."""
    return PREFECT_CLOSERS


@pytest.fixture(scope="session")
def real_prefect_server(
    tmp_path_factory: pytest.TempPathFactory, prefect_closers: list[Callable[[], None]],
) -> Iterator[tuple[str, dict[str, str]]]:
    """One real ``prefect server start`` on loopback for every test that needs one (~30 s to
    start on 2 cores; tests/flows and tests/deploy share it): ``(api_url, env)``, see
    ``server_support.prefect_server``. Stopped after the last of those tests, not at the end
    of the session (:func:`pytest_runtest_teardown`)."""
    import sys

    helpers = str(Path(__file__).parent / "flows")
    if helpers not in sys.path:
        sys.path.insert(0, helpers)
    from server_support import prefect_server

    with contextlib.ExitStack() as stack:
        server = stack.enter_context(prefect_server(tmp_path_factory.mktemp("prefect-server")))
        prefect_closers.append(stack.close)
        yield server


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    """After the last test that needs a Prefect server, stop it (and undo what was set up
    to use it) instead of at the end of the session.

    Those tests run first and in one process (:func:`pytest_collection_modifyitems`,
    :func:`pytest_xdist_make_scheduler`); a server left running the rest of the session
    spends CPU in its services' loops (about 2 CPU seconds a minute) that the other tests
    need. ``trylast``: after pytest's own teardown of the test's fixtures, which may still
    talk to the server. The session fixtures' own teardown later finds nothing left to do.
    """
    if _needs_prefect(item) and (nextitem is None or not _needs_prefect(nextitem)):
        while PREFECT_CLOSERS:
            PREFECT_CLOSERS.pop()()


#: The run's directory in memory, once made (:func:`pytest_configure`).
_MEMORY_TMP: list[Path] = []
#: Holds True once the run has failed (:func:`pytest_sessionfinish`).
_RUN_FAILED: list[bool] = []


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config: pytest.Config) -> None:
    """Put the run's temporary directories (``tmp_path``) in memory, not on the disk.

    The tests write and fsync about 4.6 GB of small files, checkpoints and catalogs: on the
    2-core reference machine, two runs of the same tree one after the other took 546 s and
    871 CPU-s with them on the disk, 435 s and 700 CPU-s in /dev/shm. What is specific to a
    disk file system (hot and warm tiers on it beside a memory tier and snapshots in /dev/shm,
    hard links that cannot cross the two) is covered on purpose by
    tests/storage/test_disk_filesystem.py, on the disk.
    ``--basetemp DIR`` (``make test PYTEST_ARGS=--basetemp=DIR``) puts them where it says.

    Runs in the process that runs or leads the run, before pytest's own ``tmp_path``
    factory reads the option (``tryfirst``); pytest-xdist gives each test process a directory
    under it. :func:`_end_memory_tmp` removes it when the run ends.
    """
    if hasattr(config, "workerinput") or config.option.basetemp:
        return
    if not _memory_tmp_usable(MEMORY_TMP_PARENT):
        return
    _sweep_memory_tmp(MEMORY_TMP_PARENT)
    base = Path(tempfile.mkdtemp(prefix=_memory_tmp_prefix("pytest"), dir=MEMORY_TMP_PARENT))
    _MEMORY_TMP.append(base)
    config.option.basetemp = str(base)
    config.add_cleanup(_end_memory_tmp)


def _sweep_memory_tmp(parent: Path) -> None:
    """Remove what runs that were killed (no exit handler ran) left in memory: the
    directories of :func:`_memory_tmp_prefix` whose process is gone."""
    for entry in parent.glob("ckpt-*-*-*"):
        match = re.fullmatch(r"ckpt-(?:pytest|prefect-home)-(\d+)-\w+", entry.name)
        if match is None or not entry.is_dir() or entry.is_symlink():
            continue
        try:
            os.kill(int(match.group(1)), 0)
        except ProcessLookupError:
            shutil.rmtree(entry, ignore_errors=True)
        except PermissionError:
            pass  # another user's process: still running


def _end_memory_tmp() -> None:
    """Remove the run's directory from memory. After a failed run, what is left there (the
    failed tests' directories, kept for a post-mortem) is first copied to the disk."""
    base = _MEMORY_TMP.pop()
    try:
        if _RUN_FAILED and base.is_dir():
            disk = Path(tempfile.mkdtemp(prefix="ckpt-pytest-"))
            shutil.copytree(base, disk, symlinks=True, dirs_exist_ok=True)
            print(f"\nthe run's temporary directories (failed tests' kept) were copied to {disk}")
    finally:
        shutil.rmtree(base, ignore_errors=True)


#: The test module this process ran last (:func:`pytest_runtest_setup`).
_LAST_MODULE: list[Path | None] = [None]


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """Before each test module, collect the garbage once and freeze what is left
    (``gc.freeze``), so that later collections leave it out.

    A test process comes to hold over a million long-lived objects (torch, Prefect,
    botocore's service models, every module imported so far), and each of Python's full
    collections walks them all: 66 full collections took 39 CPU seconds of a whole run's two
    test processes, 0.4 to 0.5 s each. With the freeze, the run's full collections (283,
    counting these) took 13 s. A cycle of frozen objects that becomes unreachable later stays
    in memory until the process ends.
    """
    if item.path != _LAST_MODULE[0]:
        _LAST_MODULE[0] = item.path
        gc.collect()
        gc.freeze()


#: What the default memory directory held when the run began (:func:`pytest_sessionstart`).
_MEMORY_ROOT_BEFORE: list[set[str]] = []


def _memory_root_entries() -> set[str]:
    from ckptstore.storage.shm import DEFAULT_MEMORY_ROOT

    return set(os.listdir(DEFAULT_MEMORY_ROOT)) if DEFAULT_MEMORY_ROOT.is_dir() else set()


def pytest_sessionstart(session: pytest.Session) -> None:
    """Note what the default memory directory (/dev/shm/ckptstore) holds before any test."""
    if not hasattr(session.config, "workerinput"):  # the process that runs or leads the run
        _MEMORY_ROOT_BEFORE.append(_memory_root_entries())


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Fail the run if a test left anything new in the default memory directory; note a
    failed run for :func:`_end_memory_tmp`.

    Memory tiers and snapshots stay there after their store closes, on purpose (they outlive
    a crashed process), so a test that does not pass its own ``memory_tier_dir``
    (``shm_root``) leaves them in the machine's memory after the suite ends. Checked once, in
    the process that runs or leads the run, after every test has finished.
    """
    if not _MEMORY_ROOT_BEFORE:
        return
    left = sorted(_memory_root_entries() - _MEMORY_ROOT_BEFORE[0])
    if left:
        from ckptstore.storage.shm import DEFAULT_MEMORY_ROOT

        print(f"\nERROR: tests left {left} in {DEFAULT_MEMORY_ROOT}: give the store that "
              "made them a memory_tier_dir under the test's own directory (shm_root)")
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
    if session.exitstatus != 0:
        _RUN_FAILED.append(True)


@pytest.fixture
def store_root(tmp_path: Path) -> Path:
    """An empty directory for a store."""
    return tmp_path / "store"


@pytest.fixture
def tmp_store(store_root: Path) -> Iterator[object]:
    """A fresh embedded store (SQLite catalog + local hot tier), closed afterwards."""
    from ckptstore import CheckpointStore

    store = CheckpointStore.open(store_root)
    try:
        yield store
    finally:
        store.close()


#: The modules under these directories need a Prefect server (tests/flows' autouse harness,
#: ``real_prefect_server``): under ``make test`` they all run in one test process, so the
#: session's one server starts once per run, not in both processes.
PREFECT_DIRS = ("tests/flows/", "tests/deploy/")
#: The xdist work unit of those modules.
PREFECT_GROUP = "prefect-server"


def _needs_prefect(item: pytest.Item) -> bool:
    return item.nodeid.startswith(PREFECT_DIRS)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Run the modules that need a Prefect server first, then the modules that hold a test
    marked ``slow``, then the rest (order otherwise unchanged).

    ``make test`` spreads whole modules over two processes (pytest-xdist, ``--dist
    loadfile``, scheduled by :func:`pytest_xdist_make_scheduler`) in collection order: a
    minute-long module collected last would run alone at the end while the other process
    idles.
    """
    slow = {item.path for item in items if item.get_closest_marker("slow") is not None}
    items.sort(key=lambda item: (not _needs_prefect(item), item.path not in slow))


def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """``--dist loadfile`` with two changes: the modules under :data:`PREFECT_DIRS` form one
    work unit (one process, one Prefect server), and units go out in collection order
    (:func:`pytest_collection_modifyitems`), not re-sorted by their number of tests, which
    sent the one-test, minute-long modules last."""
    if config.getoption("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class PrefectTogether(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module = super()._split_scope(nodeid)
            return PREFECT_GROUP if module.startswith(PREFECT_DIRS) else module

    config.option.loadscopereorder = False
    return PrefectTogether(config, log)


@pytest.fixture
def shm_root(tmp_path: Path) -> Iterator[Path]:
    """A private parent directory in /dev/shm for memory tiers and snapshots (under
    ``tmp_path`` where there is no /dev/shm), removed after the test."""
    base = Path("/dev/shm")
    root = base / f"ckptstore-test-{uuid.uuid4().hex[:10]}" if base.is_dir() else tmp_path / "shm"
    try:
        yield root
    finally:
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def snap_store(tmp_path: Path, shm_root: Path) -> Iterator[Any]:
    """An embedded store whose snapshots (and memory tier) go to ``shm_root``."""
    from ckptstore.ops.writing.async_save import close_saver
    from ckptstore.store import CheckpointStore

    st = CheckpointStore.open(tmp_path / "store", memory_tier_dir=str(shm_root))
    try:
        yield st
    finally:
        try:
            close_saver(st)
        finally:
            st.close()
