"""``ckpt agent`` on two simulated nodes: one Prefect work pool, one work queue per host.

A real Prefect server (the session's), a PostgreSQL catalog, a moto S3 warm tier and two
nodes that share no directory (each its own ``CKPT_HOST`` and ``CKPT_HOT``). A checkpoint is
saved across both nodes (one rank each); each node runs ``ckpt agent --pool``. A training
process on node A triggers the archive: the trigger fans out one flow run per host, each on
that host's queue, and each node's agent uploads only its own host's part. Then hot retention
on node A leaves node B's part to node B's agent, which prunes it. Every wait is bounded;
every process runs in its own process group and is killed at teardown.
"""

from __future__ import annotations

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

from ckptstore import CheckpointStore
from ckptstore.catalog import migrate
from ckptstore.records import ReplicaState

if str(Path(__file__).parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).parent))
from pg_support import create_pg_database, drop_pg_database, require_pg
from process_support import acting_as_host, wait_sessions
from server_support import forget_pool, free_port, stop_all

pytestmark = [pytest.mark.prefect, pytest.mark.slow, pytest.mark.postgres, pytest.mark.s3]

POOL = "ckpt-multinode"
NODES = ("node-a", "node-b")
WORKER = Path(__file__).parents[1] / "ops" / "dcp" / "multinode_worker.py"
TERMINAL = {"COMPLETED", "FAILED", "CRASHED", "CANCELLED"}


@dataclass
class Nodes:
    """The two simulated nodes and what the tests need to reach them."""

    api: str
    config: Path
    hot: dict[str, Path]
    env: dict[str, dict[str, str]]
    logs: dict[str, Path]
    agents: dict[str, subprocess.Popen[bytes]]
    ckpt_id: str


def _tail(nodes: Nodes, lines: int = 40) -> str:
    out = []
    for name, path in nodes.logs.items():
        text = path.read_text(errors="replace").splitlines() if path.exists() else []
        out.append(f"--- {name} (exit {nodes.agents[name].poll()})\n" + "\n".join(text[-lines:]))
    return "\n".join(out)


@contextlib.contextmanager
def _api(url: str) -> Iterator[Any]:
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings({PREFECT_API_URL: url}), get_client(sync_client=True) as client:
        yield client


def _save_across_nodes(tmp: Path, env: dict[str, dict[str, str]]) -> str:
    """One parted checkpoint, one rank per node (no torchrun: two plain processes)."""
    out = tmp / "save-out"
    out.mkdir()
    port = free_port()
    procs = []
    for rank, node in enumerate(NODES):
        penv = {**env[node], "RANK": str(rank), "LOCAL_RANK": "0", "WORLD_SIZE": "2",
                "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}
        penv.pop("PREFECT_API_URL", None)
        procs.append(subprocess.Popen([sys.executable, str(WORKER), "tiny", str(out)],
                                      env=penv, stderr=subprocess.PIPE,
                                      start_new_session=True))
    wait_sessions(procs, 180)
    for p in procs:
        assert p.returncode == 0, p.stderr.read().decode()[-3000:] if p.stderr else ""
    import json

    report = json.loads((out / "tiny-ws2-rank0.json").read_text())
    assert report["ok"], report
    return str(report["id"])


@pytest.fixture(scope="module")
def nodes(tmp_path_factory: pytest.TempPathFactory,
          real_prefect_server: tuple[str, dict[str, str]]) -> Iterator[Nodes]:
    require_pg()
    from ckptstore.testing.s3 import MotoS3

    tmp = tmp_path_factory.mktemp("agents")
    with contextlib.ExitStack() as stack:
        s3 = stack.enter_context(MotoS3())
        url = create_pg_database("ckpt_agents")
        stack.callback(drop_pg_database, url)
        migrate.upgrade(url)
        config = tmp / "ckpt.toml"
        config.write_text(
            f'root = "{tmp / "root"}"\n'
            f'catalog_url = "{url}"\n'
            "[tiers]\n"
            f'warm = "{s3.url(uuid.uuid4().hex[:8] + "/warm")}"\n'
            "[storage_options]\n"
            f'endpoint_url = "{s3.endpoint_url}"\n',
            encoding="utf-8",
        )
        api, server_env = real_prefect_server
        stack.callback(forget_pool, api, POOL)  # runs after the agents are stopped
        hot = {n: tmp / f"hot-{n}" for n in NODES}
        env: dict[str, dict[str, str]] = {}
        for node in NODES:
            e = {**os.environ, "PREFECT_HOME": server_env["PREFECT_HOME"],
                 "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "PREFECT_API_URL": api,
                 "CKPT_CONFIG": str(config), "CKPT_HOST": node, "CKPT_HOT": str(hot[node]),
                 "PREFECT_WORKER_QUERY_SECONDS": "1", "PREFECT_WORKER_PREFETCH_SECONDS": "2",
                 "PREFECT_LOGGING_LEVEL": "INFO"}
            for var in ("CKPT_ROOT", "CKPT_CATALOG_URL", "CKPT_FAULT_POINT", "CKPT_REPLICAS"):
                e.pop(var, None)
            env[node] = e
        ckpt_id = _save_across_nodes(tmp, env)
        logs: dict[str, Path] = {}
        agents: dict[str, subprocess.Popen[bytes]] = {}
        # Stopped together: their shutdowns overlap.
        stack.callback(lambda: stop_all(list(agents.values())))
        for node in NODES:
            logs[node] = tmp / f"agent-{node}.log"
            out = stack.enter_context(logs[node].open("wb"))
            # The operator's step on every node: one agent, the same config file.
            agents[node] = subprocess.Popen(
                [sys.executable, "-m", "ckptstore", "agent", "--pool", POOL, "--interval", "1",
                 "--maintenance-interval", "2"],
                env=env[node], cwd=tmp, stdout=out, stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        result = Nodes(api, config, hot, env, logs, agents, ckpt_id)
        deadline = time.monotonic() + 120
        wanted = {f"ckpt-agent-{n}" for n in NODES}
        online: set[str] = set()
        while time.monotonic() < deadline:
            with contextlib.suppress(Exception), _api(api) as client:
                online = {w.name for w in client.read_workers_for_work_pool(POOL)
                          if str(w.status).endswith("ONLINE")}
            if wanted <= online:
                break
            if any(a.poll() is not None for a in agents.values()):
                pytest.fail("an agent exited:\n" + _tail(result))
            time.sleep(1)
        else:
            pytest.fail(f"agents not online after 120 s ({online})\n" + _tail(result))
        yield result


def test_each_agent_uploads_only_its_own_hosts_part(nodes: Nodes) -> None:
    # A training process on node A asks for the archive, as CheckpointManager does.
    script = (
        "from ckptstore import CheckpointStore\n"
        "with CheckpointStore.open() as store:\n"
        f"    store.trigger('archive', store.get({nodes.ckpt_id!r}))\n"
    )
    subprocess.run([sys.executable, "-c", script], env=nodes.env["node-a"], check=True,
                   timeout=120)
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterParentTaskRunId

    deadline = time.monotonic() + 180
    runs: list[Any] = []
    while time.monotonic() < deadline:
        with _api(nodes.api) as client:
            runs = [r for r in client.read_flow_runs(
                flow_run_filter=FlowRunFilter(parent_task_run_id=FlowRunFilterParentTaskRunId(
                    is_null_=True)))
                if (r.parameters or {}).get("ref") == nodes.ckpt_id]
        if len(runs) == 2 and all(r.state and r.state.type.value in TERMINAL for r in runs):
            break
        time.sleep(1)
    else:
        pytest.fail(f"archive runs not finished: {[(r.work_queue_name, r.state) for r in runs]}"
                    + "\n" + _tail(nodes))
    assert sorted(r.work_queue_name for r in runs) == list(NODES)
    bad = [f"{r.work_queue_name}: {r.state.message}" for r in runs
           if r.state.type.value != "COMPLETED"]
    assert not bad, f"{bad}\n{_tail(nodes)}"
    # Each run was taken by the agent of its own host (Prefect's hand-off, per queue).
    for node in NODES:
        text = nodes.logs[node].read_text(errors="replace")
        taken = set(re.findall(r"submitting flow run '([0-9a-f-]{36})'", text))
        mine = {str(r.id) for r in runs if r.work_queue_name == node}
        assert taken & {str(r.id) for r in runs} == mine, (node, taken, mine)
    with CheckpointStore.open(config=nodes.config) as store:
        ck = store.get(nodes.ckpt_id)
        warm = ck.replica("warm")
        assert warm is not None and warm.state == ReplicaState.PRESENT and warm.verified_at
        uploads = {e.detail["part"]: e.detail["host"] for e in store.catalog.events(ck.id)
                   if e.kind == "part_archived"}
        assert uploads == {n: n for n in NODES}  # each part uploaded from its own host
        seen = {h.name: h.role for h in store.catalog.hosts()}
        assert seen == dict.fromkeys(NODES, "agent")


def test_each_agent_prunes_its_own_parts(nodes: Nodes) -> None:
    from ckptstore.ops.tiering.retention import apply_retention
    from ckptstore.retention import RetentionPolicy

    with acting_as_host("node-a"), \
            CheckpointStore.open(config=nodes.config, hot=str(nodes.hot["node-a"])) as store:
        ck = store.get(nodes.ckpt_id)
        # The newest of its run is kept by every policy: save a newer one here, plainly.
        store.save("agents", 2, {"x": __import__("torch").ones(4)})
        report = apply_retention(store, tier="hot", policy=RetentionPolicy(keep_last=1))
        assert [a.checkpoint_id for a in report.executed] == [ck.id], report.to_dict()
    assert not (nodes.hot["node-a"] / "agents" / nodes.ckpt_id).exists()
    deadline = time.monotonic() + 60
    with CheckpointStore.open(config=nodes.config) as store:
        while time.monotonic() < deadline:
            hot = store.get(nodes.ckpt_id).replica("hot")
            if hot is not None and hot.state == ReplicaState.DELETED:
                break
            time.sleep(1)
        else:
            pytest.fail(f"node B's agent did not prune its part: {hot}\n" + _tail(nodes))
    assert not (nodes.hot["node-b"] / "agents" / nodes.ckpt_id).exists()


def test_an_agent_on_a_shared_hot_tier_also_serves_the_default_queue() -> None:
    from ckptstore.flows.agent import worker_command

    own = worker_command("pool", "node-a")
    assert own[own.index("--work-queue") + 1] == "node-a" and own.count("--work-queue") == 1
    shared = worker_command("pool", "node-a", shared_hot=True)
    queues = [shared[i + 1] for i, arg in enumerate(shared) if arg == "--work-queue"]
    assert queues == ["node-a", "default"]
    assert shared[shared.index("--name") + 1] == "ckpt-agent-node-a"
