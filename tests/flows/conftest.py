"""The one Prefect test harness of the session, plus store fixtures for the flow tests.

The harness (a throwaway Prefect database and server, ~10 s) starts once, when the first flow
test runs, and every flow test shares it. Heartbeats are off: they add ~1 s per flow run and
only matter for detecting crashed runs in production.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from ckptstore import CheckpointStore

# tests/conftest.py fixes PREFECT_HOME and the analytics switch before Prefect is imported;
# repeat the noise settings here in case this directory runs alone.
os.environ["PREFECT_SERVER_ANALYTICS_ENABLED"] = "false"
os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")


@pytest.fixture(scope="session", autouse=True)
def prefect_harness() -> Iterator[None]:
    """Run every flow test against one temporary Prefect server, heartbeats off."""
    import contextlib

    import prefect.context
    from prefect.settings import PREFECT_FLOWS_HEARTBEAT_FREQUENCY, temporary_settings
    from prefect.testing.utilities import prefect_test_harness

    with contextlib.ExitStack() as stack:
        stack.enter_context(prefect_test_harness(server_startup_timeout=60))
        stack.enter_context(temporary_settings({PREFECT_FLOWS_HEARTBEAT_FREQUENCY: None}))
        # Settings contexts are context variables, which new threads do not inherit; the
        # embedded runner's worker thread must see them too, so publish them process-wide the
        # way the harness does for its API URL.
        publish = getattr(prefect.context, "_temporary_global_settings_context", None)
        if publish is not None:
            stack.enter_context(publish(prefect.context.get_settings_context()))
        yield


@pytest.fixture
def flow_store(tmp_path: Path) -> Iterator[CheckpointStore]:
    """An embedded store whose root a flow can reopen from a plain path."""
    store = CheckpointStore.open(tmp_path / "store")
    try:
        yield store
    finally:
        store.close()


@pytest.fixture
def s3_config(tmp_path: Path) -> Iterator[tuple[Path, object]]:
    """A config file with warm/cold tiers on a fresh moto S3 bucket (credentials from env)."""
    from ckptstore.testing.s3 import MotoS3

    with MotoS3() as s3:
        prefix = uuid.uuid4().hex[:8]
        config = tmp_path / "ckpt.toml"
        config.write_text(s3.config_toml(tmp_path / "store", prefix, "STANDARD_IA"),
                          encoding="utf-8")
        yield config, s3


