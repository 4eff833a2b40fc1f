"""Server mode: deployments built from the config, and (slow) served for real."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from ckptstore import CheckpointStore
from ckptstore.config import load_settings
from ckptstore.errors import ConfigError
from ckptstore.flows.deployments import build_deployments
from ckptstore.flows.registry import FLOWS
from ckptstore.records import CheckpointState

if str(Path(__file__).parent) not in sys.path:
    # --import-mode=importlib does not put test directories on sys.path.
    sys.path.insert(0, str(Path(__file__).parent))
from server_support import stop as _stop
from server_support import wait_http as _wait_http

pytestmark = pytest.mark.prefect


def test_build_deployments_from_config(tmp_path: Path) -> None:
    config = tmp_path / "ckpt.toml"
    config.write_text(
        f'root = "{tmp_path / "store"}"\n'
        "[schedules]\n"
        'retention = "0 3 * * *"\n'
        'gc = "every 10 minutes"\n',
        encoding="utf-8",
    )
    deployments = {d.flow_name: d for d in build_deployments(load_settings(config))}
    assert set(deployments) == {f"ckpt-{name}" for name in FLOWS}
    retention = deployments["ckpt-retention"]
    assert retention.name == "ckptstore"
    assert retention.entrypoint == "ckptstore.flows.retention.retention_flow"
    assert retention.parameters == {"store_root": str(tmp_path / "store"), "config": str(config)}
    assert [s.schedule.cron for s in retention.schedules] == ["0 3 * * *"]
    gc = deployments["ckpt-gc"]
    assert [s.schedule.interval.total_seconds() for s in gc.schedules] == [600.0]
    assert deployments["ckpt-archive"].schedules == []
    # No credentials can travel: only the store root and the config path are parameters.
    assert all(set(d.parameters) <= {"store_root", "config"} for d in deployments.values())


def test_unschedulable_flow_is_refused(tmp_path: Path) -> None:
    config = tmp_path / "ckpt.toml"
    config.write_text('[schedules]\nrestore = "every 1s"\n', encoding="utf-8")
    with pytest.raises(ConfigError, match="cannot be served"):
        build_deployments(load_settings(config, root=tmp_path))


# ---------------------------------------------------------------------- slow: a real server
@pytest.fixture
def prefect_server(
    real_prefect_server: tuple[str, dict[str, str]],
) -> tuple[str, dict[str, str]]:
    return real_prefect_server


@pytest.mark.slow
def test_serve_and_trigger_against_a_real_server(
    tmp_path: Path, prefect_server: tuple[str, dict[str, str]]
) -> None:
    api, env = prefect_server
    config = tmp_path / "ckpt.toml"
    config.write_text(f'root = "{tmp_path / "store"}"\n', encoding="utf-8")
    with CheckpointStore.open(config=config) as store:
        ids = [store.save("r", i, {"w": torch.full((4,), float(i))}).id for i in range(3)]
    env = {**env, "PREFECT_RUNNER_POLL_FREQUENCY": "1"}
    serve = subprocess.Popen(
        [sys.executable, "-c",
         "import sys; from ckptstore.config import load_settings; "
         "from ckptstore.flows.deployments import serve_all; "
         "serve_all(load_settings(sys.argv[1]))", str(config)],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )
    try:
        _wait_http(f"{api}/deployments/name/ckpt-retention/ckptstore", 120, serve)
        # The "trainer": trigger_flow in server mode only enqueues run_deployment(timeout=0).
        trainer = subprocess.run(
            [sys.executable, "-c",
             "import json, sys, time; from ckptstore.flows.embedded import get_runner, "
             "trigger_flow\n"
             "t = time.perf_counter(); trigger_flow(None, 'retention', {'keep_last': 1}, "
             "config=sys.argv[1]); took = time.perf_counter() - t\n"
             "runner = get_runner(None, sys.argv[1]); runner.close(wait=True, timeout=60)\n"
             "r = runner.results[-1]\n"
             "print(json.dumps({'mode': runner.mode, 'ok': r.ok, 'error': r.error, "
             "'took': took}))",
             str(config)],
            env=env, capture_output=True, timeout=180, check=True,
        )
        outcome = json.loads(trainer.stdout.decode().strip().splitlines()[-1])
        assert outcome["mode"] == "server" and outcome["ok"], outcome
        assert outcome["took"] < 0.05
        deadline = time.monotonic() + 120
        with CheckpointStore.open(config=config) as store:
            while time.monotonic() < deadline:
                states = [store.catalog.get_any(i).state for i in ids]
                if states[:2] == [CheckpointState.DELETED] * 2:
                    break
                time.sleep(1)
            assert states == [CheckpointState.DELETED] * 2 + [CheckpointState.COMMITTED]
    finally:
        _stop(serve)


def test_pools_we_create_start_flow_runs_with_this_python(
    prefect_server: tuple[str, dict[str, str]],
) -> None:
    """The pool's command skips Prefect's workspace supervisor (a second interpreter per flow
    run); an agent refuses a pool whose command names a program its host lacks."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.settings import PREFECT_API_URL, temporary_settings
    from server_support import forget_pool

    from ckptstore.flows.deployments import (
        _ensure_pool,
        base_job_template,
        check_flow_run_command,
        flow_run_command,
    )

    api, _env = prefect_server
    assert flow_run_command() == f"{sys.executable} -m prefect.engine"
    elsewhere = base_job_template()
    elsewhere["variables"]["properties"]["command"]["default"] = (
        "/nowhere/bin/python -m prefect.engine"
    )
    try:
        with temporary_settings({PREFECT_API_URL: api}):
            with get_client(sync_client=True) as client:
                _ensure_pool(client, "ckpt-command")
                template = client.read_work_pool("ckpt-command").base_job_template
                client.create_work_pool(WorkPoolCreate(
                    name="ckpt-elsewhere", type="process", base_job_template=elsewhere))
            assert template["variables"]["properties"]["command"]["default"] == flow_run_command()
            check_flow_run_command("ckpt-command")
            with pytest.raises(ConfigError, match="/nowhere/bin/python does not exist"):
                check_flow_run_command("ckpt-elsewhere")
    finally:
        forget_pool(api, "ckpt-command")
        forget_pool(api, "ckpt-elsewhere")
