"""Session-wide test settings.

Prefect reads its settings at import, so its home and noise settings are fixed here, before
any test module imports it. Flow tests share one harness in tests/flows/conftest.py.
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
