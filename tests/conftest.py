"""Session-wide test settings.

Prefect reads its settings at import, so its home and noise settings are fixed here, before
any test module imports it. Flow tests share one harness in tests/flows/conftest.py; the tests
that need a real ``prefect server start`` share the session's ``real_prefect_server``.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

_PREFECT_HOME = tempfile.mkdtemp(prefix="ckpt-prefect-home-")
os.environ.setdefault("PREFECT_HOME", _PREFECT_HOME)
os.environ["PREFECT_SERVER_ANALYTICS_ENABLED"] = "false"
os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
# A loaded 2-core machine can take longer than the default 20 s to start the ephemeral API.
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")
# Tests must never reach outside the machine; AWS credentials are fakes for moto.
os.environ.setdefault("AWS_ACCESS_KEY_ID", "testing")
os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "testing")
os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
for _var in ("CKPT_CONFIG", "CKPT_ROOT", "CKPT_CATALOG_URL", "CKPT_FAULT_POINT"):
    os.environ.pop(_var, None)


@pytest.fixture(scope="session")
def real_prefect_server(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[str, dict[str, str]]]:
    """One real ``prefect server start`` on loopback for every test that needs one (~30 s to
    start on 2 cores; tests/flows and tests/deploy share it): ``(api_url, env)``, see
    ``server_support.prefect_server``."""
    import sys

    helpers = str(Path(__file__).parent / "flows")
    if helpers not in sys.path:
        sys.path.insert(0, helpers)
    from server_support import prefect_server

    with prefect_server(tmp_path_factory.mktemp("prefect-server")) as server:
        yield server


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


#: Fixtures that start a Prefect server: every module using one runs in the same test process
#: (see :func:`pytest_collection_modifyitems`), so the session starts it once.
PREFECT_SERVER_FIXTURES = frozenset({"real_prefect_server", "prefect_harness"})
#: The xdist group of those modules.
PREFECT_GROUP = "prefect-server"


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Keep each module in one test process, the Prefect modules in one, the longest first.

    ``make test`` runs pytest-xdist with ``--dist loadgroup --no-loadscope-reorder``: each
    group goes whole to one process, groups in collection order. Every module is its own group
    (its module-scoped fixtures start once), except the modules that need a Prefect server:
    they share the group :data:`PREFECT_GROUP`, so the one server of
    ``real_prefect_server`` (which tests/flows' harness also uses) starts once per run, not in
    both processes. Sorted first: that group (several minutes of work), then the modules that
    hold a test marked ``slow``, then the rest in collection order, so no minute-long module
    is left to run alone at the end while the other process idles.

    Runs before xdist's own hook (``tryfirst``), which reads the group marks.
    """
    prefect = {item.path for item in items
               if PREFECT_SERVER_FIXTURES & set(getattr(item, "fixturenames", ()))}
    slow = {item.path for item in items if item.get_closest_marker("slow") is not None}
    if config.getoption("dist", default="no") == "loadgroup":
        root = config.rootpath
        for item in items:
            group = PREFECT_GROUP if item.path in prefect else str(item.path.relative_to(root))
            item.add_marker(pytest.mark.xdist_group(group))
    items.sort(key=lambda item: (item.path not in prefect, item.path not in slow))
