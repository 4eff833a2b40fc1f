"""Prefect's settings for the processes ckptstore starts, and where its log lines go."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import pytest

from ckptstore.observability.prefect_env import (
    PREFECT_DEFAULTS,
    apply_prefect_defaults,
    flow_log_path,
    prefect_env,
    root_logging_kept,
    route_prefect_logs,
)


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A Prefect home of its own, and none of the defaults in the environment."""
    monkeypatch.setenv("PREFECT_HOME", str(tmp_path / "prefect"))
    for var in ("PREFECT_PROFILES_PATH", "PREFECT_PROFILE", *PREFECT_DEFAULTS):
        monkeypatch.delenv(var, raising=False)
    return tmp_path / "prefect"


def test_telemetry_is_off_unless_the_user_set_it(home: Path) -> None:
    env = prefect_env({"PATH": "/bin", "DO_NOT_TRACK": "0"})
    assert env["PATH"] == "/bin"
    assert env["DO_NOT_TRACK"] == "0"  # the user's own choice stays
    assert env["PREFECT_SERVER_ANALYTICS_ENABLED"] == "false"
    assert env["PREFECT_CLOUD_ENABLE_ORCHESTRATION_TELEMETRY"] == "false"
    assert env["PREFECT_TELEMETRY_ENABLE_RESOURCE_METRICS"] == "false"


def test_a_setting_of_the_active_profile_is_kept(home: Path) -> None:
    home.mkdir()
    (home / "profiles.toml").write_text(
        'active = "mine"\n'
        '[profiles.mine]\nPREFECT_SERVER_ANALYTICS_ENABLED = "true"\n'
        '[profiles.other]\nPREFECT_TELEMETRY_ENABLE_RESOURCE_METRICS = "true"\n',
        encoding="utf-8",
    )
    env = prefect_env({"PREFECT_HOME": str(home)})
    assert "PREFECT_SERVER_ANALYTICS_ENABLED" not in env  # Prefect reads it from the profile
    assert env["PREFECT_TELEMETRY_ENABLE_RESOURCE_METRICS"] == "false"  # not the active one
    # PREFECT_PROFILE picks another profile.
    env = prefect_env({"PREFECT_HOME": str(home), "PREFECT_PROFILE": "other"})
    assert env["PREFECT_SERVER_ANALYTICS_ENABLED"] == "false"
    assert "PREFECT_TELEMETRY_ENABLE_RESOURCE_METRICS" not in env


def test_apply_sets_only_what_is_missing(home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    monkeypatch.setenv("PREFECT_SERVER_ANALYTICS_ENABLED", "true")
    apply_prefect_defaults()
    assert os.environ["PREFECT_SERVER_ANALYTICS_ENABLED"] == "true"
    assert os.environ["DO_NOT_TRACK"] == "1"


@pytest.fixture
def prefect_logger() -> Iterator[logging.Logger]:
    """The ``prefect`` logger, as the test found it afterwards."""
    target = logging.getLogger("prefect")
    handlers, propagate, level = list(target.handlers), target.propagate, target.level
    target.setLevel(logging.INFO)  # as Prefect's logging config sets it
    yield target
    target.setLevel(level)
    for handler in target.handlers:
        if handler not in handlers:
            handler.close()
    target.handlers[:] = handlers
    target.propagate = propagate


def test_prefect_lines_go_to_the_store_log_only(
    tmp_path: Path, prefect_logger: logging.Logger
) -> None:
    root = logging.getLogger()
    before = (list(root.handlers), root.level)
    with root_logging_kept():
        root.addHandler(logging.StreamHandler())  # what Prefect's import does
        root.setLevel(logging.DEBUG)
    assert (list(root.handlers), root.level) == before
    path = flow_log_path(tmp_path / "store")
    assert path == tmp_path / "store" / "logs" / "flows.log"
    route_prefect_logs(path)
    route_prefect_logs(path)  # once per file
    # Other stores of this process may have routed theirs already: count this file's.
    assert sum(1 for h in prefect_logger.handlers if isinstance(h, logging.FileHandler)
               and Path(h.baseFilename) == path) == 1
    # pytest's capture handler makes the root logger "configured"; at WARNING it stays quiet.
    quiet = root.level
    try:
        root.setLevel(logging.WARNING)
        route_prefect_logs(path)
        assert prefect_logger.propagate is False
        root.setLevel(logging.INFO)  # --verbose
        route_prefect_logs(path)
        assert prefect_logger.propagate is bool(root.handlers)
    finally:
        root.setLevel(quiet)
    # A record made outside any flow run: where an earlier test of this process has loaded
    # Prefect's logging configuration, its API handler would warn that it has no run to send
    # it to (``send_to_api`` is the attribute that handler reads to leave a record alone).
    logging.getLogger("prefect.flow_runs").info(
        "Beginning flow run with s3://KEY:secret@host",
        extra={"flow_run_name": "brave-fox", "send_to_api": False})
    for handler in prefect_logger.handlers:
        handler.flush()
    text = path.read_text()
    assert "flow run 'brave-fox': Beginning flow run" in text
    assert "secret" not in text
