"""The one Prefect server of the session for every flow test, plus store fixtures.

Flow tests run their flows in this process against the session's real ``prefect server
start`` (``real_prefect_server`` in tests/conftest.py, ~10 s to start), the same server the
serve/worker/agent tests and tests/deploy use: one server per test process, not a second
(a test harness) beside it. Heartbeats are off: they add ~1 s per flow run and only matter
for detecting crashed runs in production.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from ckptstore import CheckpointStore

# tests/conftest.py fixes PREFECT_HOME and the analytics switch before Prefect is imported;
# repeat the noise settings here in case this directory runs alone.
os.environ["PREFECT_SERVER_ANALYTICS_ENABLED"] = "false"
os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")


@pytest.fixture(scope="session", autouse=True)
def prefect_harness(real_prefect_server: tuple[str, dict[str, str]],
                    prefect_closers: list[Callable[[], None]]) -> Iterator[None]:
    """Point this process's Prefect client at the session's server, heartbeats off.

    Only Prefect's settings name the server, never ``os.environ``: the embedded runner takes
    ``PREFECT_API_URL`` in the environment to mean server mode (flows/embedded.py), and these
    tests run flows embedded.
    """
    import contextlib

    import prefect.context
    from prefect.settings import (
        PREFECT_API_URL,
        PREFECT_FLOWS_HEARTBEAT_FREQUENCY,
        temporary_settings,
    )

    api, _env = real_prefect_server
    with contextlib.ExitStack() as stack:
        stack.enter_context(temporary_settings(
            {PREFECT_API_URL: api, PREFECT_FLOWS_HEARTBEAT_FREQUENCY: None}))
        # Settings contexts are context variables, which new threads do not inherit; the
        # embedded runner's worker thread must see them too, so publish them process-wide.
        publish = getattr(prefect.context, "_temporary_global_settings_context", None)
        if publish is not None:
            stack.enter_context(publish(prefect.context.get_settings_context()))
        # Closed newest first: the logs drained, then the settings undone, before the server
        # stops (after the last flow test: tests/conftest.py's pytest_runtest_teardown).
        stack.callback(_drain_logs_and_events)
        prefect_closers.append(stack.close)
        yield


def _drain_logs_and_events() -> None:
    """Send what Prefect's background log and event workers still hold before the server
    stops (the harness Prefect ships does the same), so nothing is sent to a closed port."""
    import inspect

    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker
    from prefect.utilities.asyncutils import run_coro_as_sync

    async def drain() -> None:
        try:
            result = APILogWorker.instance().drain()
            if inspect.isawaitable(result):
                await result
        except RuntimeError:  # never started
            pass
        result = EventsWorker.drain_all()
        if inspect.isawaitable(result):
            await result

    run_coro_as_sync(drain())


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


