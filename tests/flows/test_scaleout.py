"""Scale-out: a real Prefect server, a process work pool and two ``prefect worker`` processes.

One module-scoped cluster (the server, a fresh PostgreSQL catalog, a moto S3 warm tier, the
deployments registered by ``ckpt serve --pool``, two workers) serves both tests:

* a burst of archive runs, then two concurrent retention runs, spread over the two workers:
  every checkpoint is copied exactly once and pruned at most once (catalog leases);
* the config's once-a-minute cron (``gc = "* * * * * S"``, croniter's trailing seconds field)
  makes the server's scheduler create a flow run that a worker completes. ``S`` is chosen
  when the cluster starts so that the run falls about when that test begins, instead of on
  the next minute boundary (half a minute's wait on average).

Each worker starts a fresh Python per flow run (importing torch and Prefect costs seconds on
2 cores), so the burst is small. Every process runs in its own process group and is killed
in the fixture's teardown; every wait is bounded.
"""

from __future__ import annotations

import collections
import contextlib
import os
import re
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from ckptstore import CheckpointStore
from ckptstore.catalog import migrate
from ckptstore.cli.app import main
from ckptstore.records import ReplicaState

if str(Path(__file__).parent) not in sys.path:
    # --import-mode=importlib does not put test directories on sys.path.
    sys.path.insert(0, str(Path(__file__).parent))
from pg_support import create_pg_database, drop_pg_database, require_pg
from server_support import forget_pool, stop_all

pytestmark = [pytest.mark.prefect, pytest.mark.slow, pytest.mark.postgres, pytest.mark.s3]

POOL = "ckpt-scaleout"
RUNS = {"a": 4, "b": 4}  # run -> checkpoints saved
ARCHIVE_BURST = 4
KEEP_LAST_HOT = 2
TERMINAL = {"COMPLETED", "FAILED", "CRASHED", "CANCELLED"}
#: Seconds from writing the config to the gc cron run: after the deployments are registered
#: (a few seconds), during or just after the burst test, so the cron test hardly waits.
CRON_LEAD_S = 20


@dataclass
class Cluster:
    """What the tests need to know about the running cluster."""

    api: str
    config: Path
    ids: dict[str, list[str]]  # run -> checkpoint ids, oldest first
    deployments: dict[str, str]  # "ckpt-<flow>/ckptstore" -> deployment id
    worker_logs: dict[str, Path]
    workers: dict[str, subprocess.Popen[bytes]]
    cron_second: int  # the second of each minute the gc cron fires at


@contextlib.contextmanager
def _api(url: str) -> Iterator[Any]:
    """A sync Prefect client on the real server (the session harness stays the default)."""
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings({PREFECT_API_URL: url}), get_client(sync_client=True) as client:
        yield client


def _worker_tail(cluster: Cluster, lines: int = 40) -> str:
    parts = []
    for name, path in cluster.worker_logs.items():
        text = path.read_text(errors="replace").splitlines() if path.exists() else []
        code = cluster.workers[name].poll()
        parts.append(f"--- {name} (exit {code})\n" + "\n".join(text[-lines:]))
    return "\n".join(parts)


@pytest.fixture(scope="module")
def cluster(
    tmp_path_factory: pytest.TempPathFactory, real_prefect_server: tuple[str, dict[str, str]]
) -> Iterator[Cluster]:
    require_pg()
    from ckptstore.testing.s3 import MotoS3

    tmp = tmp_path_factory.mktemp("scaleout")
    t0 = time.monotonic()
    with contextlib.ExitStack() as stack:
        # MotoS3 puts fake credentials in os.environ: the server env copied below carries
        # them to the workers and their flow runs (never the config or flow parameters).
        s3 = stack.enter_context(MotoS3())
        catalog_url = create_pg_database("ckpt_scaleout")
        stack.callback(drop_pg_database, catalog_url)
        migrate.upgrade(catalog_url)
        config = tmp / "ckpt.toml"
        cron_second = (int(time.time()) + CRON_LEAD_S) % 60
        config.write_text(
            f'root = "{tmp / "store"}"\n'
            f'catalog_url = "{catalog_url}"\n'
            "[tiers]\n"
            f'warm = "{s3.url(uuid.uuid4().hex[:8] + "/warm")}"\n'
            "[storage_options]\n"
            f'endpoint_url = "{s3.endpoint_url}"\n'
            "[schedules]\n"
            f'gc = "* * * * * {cron_second}"\n',
            encoding="utf-8",
        )
        ids: dict[str, list[str]] = {}
        with CheckpointStore.open(config=config) as store:
            for run, count in RUNS.items():
                ids[run] = [
                    store.save(run, step, {"w": torch.full((64,), float(step))}).id
                    for step in range(count)
                ]

        api, server_env = real_prefect_server
        stack.callback(forget_pool, api, POOL)  # runs after the workers are stopped
        # Built now, not when the (session) server started: MotoS3 just put its credentials
        # in os.environ, and the workers' flow runs need them.
        env = {**os.environ, "PREFECT_HOME": server_env["PREFECT_HOME"],
               "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "PREFECT_API_URL": api}
        # The operator's step: register every flow on the work pool through the CLI.
        from prefect.settings import PREFECT_API_URL, temporary_settings

        with temporary_settings({PREFECT_API_URL: api}):
            assert main(["--config", str(config), "serve", "--pool", POOL]) == 0
        with _api(api) as client:
            flows = {str(f.id): f.name for f in client.read_flows()}
            deployments = {
                f"{flows[str(d.flow_id)]}/{d.name}": str(d.id) for d in client.read_deployments()
            }
            assert all(d.work_pool_name == POOL for d in client.read_deployments())
            work_pool = client.read_work_pool(POOL)
            assert work_pool.type == "process"
            # Flow runs start straight from this Python, not through a workspace supervisor.
            command = work_pool.base_job_template["variables"]["properties"]["command"]
            assert command["default"] == f"{sys.executable} -m prefect.engine"

        worker_env = {
            **env,
            # Poll every second and start runs at most 2 s early (defaults: 10 s and 10 s).
            "PREFECT_WORKER_QUERY_SECONDS": "1",
            "PREFECT_WORKER_PREFETCH_SECONDS": "2",
            "PREFECT_WORKER_HEARTBEAT_SECONDS": "5",
            # INFO: the worker logs "submitting flow run <id>", which tells who ran what.
            "PREFECT_LOGGING_LEVEL": "INFO",
        }
        for var in ("CKPT_CONFIG", "CKPT_ROOT", "CKPT_CATALOG_URL"):
            worker_env.pop(var, None)
        workers: dict[str, subprocess.Popen[bytes]] = {}
        # Stopped together: their shutdowns overlap.
        stack.callback(lambda: stop_all(list(workers.values())))
        logs: dict[str, Path] = {}
        for name in ("w1", "w2"):
            logs[name] = tmp / f"{name}.log"
            out = stack.enter_context(logs[name].open("wb"))
            workers[name] = subprocess.Popen(
                [sys.executable, "-m", "prefect", "worker", "start", "--pool", POOL,
                 "--type", "process", "--name", name],
                env=worker_env, cwd=tmp, stdout=out, stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        cluster = Cluster(api, config, ids, deployments, logs, workers, cron_second)
        # Both workers must be polling before the burst, or one might take everything.
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            with _api(api) as client:
                online = {w.name for w in client.read_workers_for_work_pool(POOL)
                          if str(w.status).endswith("ONLINE")}
            if {"w1", "w2"} <= online:
                break
            if any(w.poll() is not None for w in workers.values()):
                pytest.fail("a worker exited:\n" + _worker_tail(cluster))
            time.sleep(0.5)
        else:
            pytest.fail(f"workers not online after 90 s (online: {online})\n"
                        + _worker_tail(cluster))
        print(f"\nscale-out cluster up in {time.monotonic() - t0:.1f}s")
        yield cluster


def _submit(cluster: Cluster, flow: str, count: int, **parameters: Any) -> list[str]:
    """``count`` runs of ``ckpt-<flow>/ckptstore`` at once, the way a trigger does it."""
    from prefect.deployments import run_deployment
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings({PREFECT_API_URL: cluster.api}):
        runs = [run_deployment(f"ckpt-{flow}/ckptstore", parameters=parameters, timeout=0)
                for _ in range(count)]
    return [str(r.id) for r in runs]


def _wait_terminal(cluster: Cluster, run_ids: list[str], timeout: float) -> dict[str, Any]:
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    deadline = time.monotonic() + timeout
    while True:
        with _api(cluster.api) as client:
            wanted = FlowRunFilterId(any_=[uuid.UUID(i) for i in run_ids])
            runs = client.read_flow_runs(flow_run_filter=FlowRunFilter(id=wanted))
        states = {str(r.id): r for r in runs}
        if len(states) == len(run_ids) and all(
            r.state is not None and r.state.type.value in TERMINAL for r in runs
        ):
            return states
        if time.monotonic() > deadline:
            summary = {i: (r.state.type.value if r.state else None) for i, r in states.items()}
            pytest.fail(f"flow runs not finished after {timeout:.0f}s: {summary}\n"
                        + _worker_tail(cluster))
        time.sleep(1)


def _assert_completed(cluster: Cluster, runs: dict[str, Any]) -> None:
    bad = {i: f"{r.state.type.value}: {r.state.message}" for i, r in runs.items()
           if r.state.type.value != "COMPLETED"}
    assert not bad, f"{bad}\n{_worker_tail(cluster)}"


def _executed_by(cluster: Cluster) -> tuple[dict[str, list[str]], int]:
    """Flow-run id -> the workers that ran it, and how many submissions the server refused.

    Both workers see every scheduled run and both try to submit it; the server lets one
    move the run to PENDING and tells the other to abort, which its log says.
    """
    submitting = re.compile(r"Worker '([^']+)' submitting flow run '([0-9a-f-]{36})'")
    aborted = re.compile(r"Aborted submission of flow run '([0-9a-f-]{36})'")
    ran: dict[str, list[str]] = collections.defaultdict(list)
    refused = 0
    for path in cluster.worker_logs.values():
        text = path.read_text(errors="replace")
        lost = collections.Counter(aborted.findall(text))
        refused += sum(lost.values())
        for worker, run_id in submitting.findall(text):
            if lost[run_id]:
                lost[run_id] -= 1
            else:
                ran[run_id].append(worker)
    return ran, refused


def test_two_workers_copy_and_prune_each_checkpoint_once(cluster: Cluster) -> None:
    started = time.monotonic()
    archive_runs = _submit(cluster, "archive", ARCHIVE_BURST)
    archived = _wait_terminal(cluster, archive_runs, timeout=150)
    _assert_completed(cluster, archived)
    archive_s = time.monotonic() - started

    # Second wave, once everything has a warm copy: two retention runs race for the same
    # hot copies (keep the newest KEEP_LAST_HOT per run on hot; warm copies stay).
    retention_runs = _submit(cluster, "retention", 2, tier="hot", keep_last=KEEP_LAST_HOT)
    pruned = _wait_terminal(cluster, retention_runs, timeout=90)
    _assert_completed(cluster, pruned)

    every = [cid for run_ids in cluster.ids.values() for cid in run_ids]
    with CheckpointStore.open(config=cluster.config) as store:
        for run, run_ids in cluster.ids.items():
            for index, cid in enumerate(run_ids):
                ck = store.catalog.get_any(cid)
                kinds = collections.Counter(e.kind for e in store.catalog.events(cid, limit=50))
                warm = ck.replica("warm")
                assert warm is not None and warm.state == ReplicaState.PRESENT, (cid, warm)
                assert kinds["archived"] == 1, f"{run}#{index} archived {kinds['archived']}x"
                hot = ck.replica("hot")
                if index < len(run_ids) - KEEP_LAST_HOT:
                    assert kinds["pruned"] == 1, f"{run}#{index} pruned {kinds['pruned']}x"
                    assert hot is None or hot.state == ReplicaState.DELETED, (cid, hot)
                else:
                    assert kinds["pruned"] == 0, f"{run}#{index} pruned {kinds['pruned']}x"
                    assert hot is not None and hot.state == ReplicaState.PRESENT, (cid, hot)
        # A pruned-from-hot checkpoint still loads, from S3.
        oldest = cluster.ids["a"][0]
        assert torch.equal(store.load(oldest)["w"], torch.full((64,), 0.0))

    # Each flow run ran on exactly one worker (Prefect's own hand-off), spread over both.
    ran, refused = _executed_by(cluster)
    ours = archive_runs + retention_runs
    assert all(len(ran.get(i, [])) == 1 for i in ours), {i: ran.get(i) for i in ours}
    per_worker = collections.Counter(ran[i][0] for i in ours)
    print(f"\nscale-out: {ARCHIVE_BURST} archive runs over {len(every)} checkpoints in "
          f"{archive_s:.1f}s, 2 retention runs in {time.monotonic() - started - archive_s:.1f}s;"
          f" runs per worker {dict(per_worker)}; {refused} duplicate submissions refused")


def test_one_minute_cron_fires_on_the_workers(cluster: Cluster) -> None:
    from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterId

    waited = time.monotonic()
    gc_id = uuid.UUID(cluster.deployments["ckpt-gc/ckptstore"])
    deadline = time.monotonic() + 90
    while True:
        with _api(cluster.api) as client:
            runs = [
                r for r in client.read_flow_runs(
                    deployment_filter=DeploymentFilter(id=DeploymentFilterId(any_=[gc_id]))
                )
                # Created by the server's scheduler from the cron, not by anyone's call.
                if r.auto_scheduled
            ]
        done = [r for r in runs if r.state is not None and r.state.type.value == "COMPLETED"]
        if done:
            break
        failed = [f"{r.state.type.value}: {r.state.message}" for r in runs
                  if r.state is not None and r.state.type.value in TERMINAL]
        assert not failed, f"{failed}\n{_worker_tail(cluster)}"
        if time.monotonic() > deadline:
            pytest.fail(
                f"no scheduled gc run completed within 90 s; runs: "
                f"{[(r.name, r.state.type.value if r.state else None) for r in runs]}\n"
                + _worker_tail(cluster)
            )
        time.sleep(1)
    run = done[0]
    assert run.auto_scheduled
    # The cron schedule placed it on its second of a minute.
    assert run.expected_start_time is not None
    assert run.expected_start_time.second == cluster.cron_second
    assert len(_executed_by(cluster)[0].get(str(run.id), [])) == 1, _worker_tail(cluster)
    print(f"\ncron: scheduled gc run {run.name} for {run.expected_start_time:%H:%M:%S} "
          f"completed; waited {time.monotonic() - waited:.1f}s in this test")
