"""The deployment of docker-compose.yml, run as plain processes through its entry points.

No container engine runs here, so this runs the compose topology without one: every service
that runs ckptstore is started through the same script its container runs (scripts/stack/),
with exactly the environment variables docker-compose.yml gives it (values rewritten to this
session's loopback services), against real services:

* PostgreSQL: a fresh database as the catalog (the compose ``postgres`` service);
* moto S3 as MinIO's stand-in; the warm and cold buckets do not exist until make-bucket.py
  creates them from ``CKPT_WARM`` / ``CKPT_COLD``;
* the session's real ``prefect server start``, started through prefect-server.sh
  (``real_prefect_server`` in tests/conftest.py; one server for every test that needs one).

Then: db-upgrade.sh; two agent.sh processes (``ckpt agent --shared-hot``: the deployments, a
worker on the node's own queue and the pool's default one, heartbeats) as two nodes with
their own ``CKPT_HOST`` and PREFECT_HOME; ui.sh; trainer.sh, which trains a
tiny model, saves checkpoints and triggers one archive run per checkpoint through the server;
the agents' flow runs copy them to the warm tier (warm replica PRESENT in the catalog); then
an operator's ``ckpt prune`` and ``ckpt restore``; and the UI answers on its index.

Bounded: every wait has a deadline, every process runs in its own process group and is killed
in teardown. Each flow run is a fresh Python on a worker (torch + Prefect imports, seconds on
2 busy cores), so the trainer saves only three checkpoints.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from ckptstore import CheckpointStore
from ckptstore.records import ReplicaState

if str(Path(__file__).parents[1] / "flows") not in sys.path:
    # --import-mode=importlib does not put test directories on sys.path.
    sys.path.insert(0, str(Path(__file__).parents[1] / "flows"))
from pg_support import create_pg_database, drop_pg_database, require_pg
from server_support import forget_pool, free_port, script_env, stop, wait_http

ROOT = Path(__file__).resolve().parents[2]
STACK = ROOT / "scripts" / "stack"

pytestmark = [pytest.mark.slow, pytest.mark.postgres, pytest.mark.s3, pytest.mark.prefect]

POOL = "ckpt-stack"
RUN = "mlp-stack"
NODES = {"agent-node-a": "node-a", "agent-node-b": "node-b"}  # compose service -> CKPT_HOST
STEPS, SAVE_EVERY = 30, 10  # three checkpoints
ONE_SHOT_S = 120.0  # longest a one-shot script may take (imports torch on a busy machine)


def _compose_env(service: str) -> dict[str, str]:
    """The environment docker-compose.yml gives ``service`` (anchors and merges resolved)."""
    data = yaml.safe_load((ROOT / "docker-compose.yml").read_text(encoding="utf-8"))
    env = data["services"][service].get("environment") or {}
    assert isinstance(env, dict), f"{service}: write environment as a mapping"
    return {str(k): str(v) for k, v in env.items()}


@contextlib.contextmanager
def _started(
    name: str, argv: list[str], env: dict[str, str], logs: Path
) -> Iterator[subprocess.Popen[bytes]]:
    """A long-running script in its own process group, output to ``logs/<name>.log``."""
    with (logs / f"{name}.log").open("wb") as out:
        proc = subprocess.Popen(argv, env=env, cwd=logs, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            yield proc
        finally:
            stop(proc)


def _tail(logs: Path, lines: int = 30) -> str:
    parts = []
    for path in sorted(logs.glob("*.log")):
        text = path.read_text(errors="replace").splitlines()
        parts.append(f"--- {path.name}\n" + "\n".join(text[-lines:]))
    return "\n".join(parts)


def _start(name: str, argv: list[str], env: dict[str, str], logs: Path) -> subprocess.Popen[bytes]:
    """Start a one-shot script; :func:`_finish` collects it."""
    with (logs / f"{name}.log").open("wb") as out:
        return subprocess.Popen(argv, env=env, cwd=logs, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)


def _finish(name: str, proc: subprocess.Popen[bytes], logs: Path) -> str:
    """Wait for a one-shot script; fail the test with its output unless it exits 0."""
    try:
        proc.wait(ONE_SHOT_S)
    except subprocess.TimeoutExpired:
        stop(proc)
        pytest.fail(f"{name} did not finish within {ONE_SHOT_S:.0f}s:\n{_tail(logs)}")
    output = (logs / f"{name}.log").read_text(errors="replace")
    assert proc.returncode == 0, f"{name} exited {proc.returncode}:\n{output}"
    return output


def _run(name: str, argv: list[str], env: dict[str, str], logs: Path) -> str:
    """Run a one-shot script to completion (see :func:`_finish`)."""
    return _finish(name, _start(name, argv, env, logs), logs)


def _deployed_on(api: str, deployment: str) -> str | None:
    """The work pool ``deployment`` is registered on, None while it does not exist."""
    import httpx

    try:
        answer = httpx.get(f"{api}/deployments/name/{deployment}", timeout=5)
    except httpx.HTTPError:
        return None
    return answer.json().get("work_pool_name") if answer.status_code == 200 else None


@contextlib.contextmanager
def _prefect(api: str) -> Iterator[Any]:
    """A sync Prefect client on the session's server."""
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings({PREFECT_API_URL: api}), get_client(sync_client=True) as client:
        yield client


def _online_workers(api: str) -> set[str]:
    with _prefect(api) as client:
        try:
            workers = client.read_workers_for_work_pool(POOL)
        except Exception:  # the pool does not exist until the first `ckpt serve --pool`
            return set()
    return {w.name for w in workers if str(w.status).endswith("ONLINE")}


def test_compose_topology_as_processes(
    tmp_path: Path, real_prefect_server: tuple[str, dict[str, str]]
) -> None:
    require_pg()
    from ckptstore.testing.s3 import MotoS3

    api, _server_env = real_prefect_server
    logs = tmp_path / "logs"
    logs.mkdir()
    timings: dict[str, float] = {}
    t0 = mark = time.monotonic()

    def lap(what: str) -> None:
        nonlocal mark
        now = time.monotonic()
        timings[what] = now - mark
        mark = now

    with contextlib.ExitStack() as stack:
        # MotoS3 puts its fake credentials in os.environ; the scripts get them from there,
        # as the containers get theirs from the compose file.
        s3 = stack.enter_context(MotoS3())
        catalog_url = create_pg_database("ckpt_stack")
        stack.callback(drop_pg_database, catalog_url)
        suffix = uuid.uuid4().hex[:8]
        warm = f"s3://ckpt-stack-warm-{suffix}/checkpoints"
        cold = f"s3://ckpt-stack-cold-{suffix}/checkpoints"
        root, hot = tmp_path / "ckpt", tmp_path / "hot"
        # docker-compose.yml's variables, with this session's loopback services as values.
        values = {
            "CKPT_CONFIG": str(STACK / "ckptstore.toml"),  # compose mounts the same file
            "CKPT_ROOT": str(root),
            "CKPT_HOT": str(hot),
            "CKPT_CATALOG_URL": catalog_url,
            "CKPT_WARM": warm,
            "CKPT_COLD": cold,
            "CKPT_S3_ENDPOINT_URL": s3.endpoint_url,
            "AWS_ACCESS_KEY_ID": os.environ["AWS_ACCESS_KEY_ID"],
            "AWS_SECRET_ACCESS_KEY": os.environ["AWS_SECRET_ACCESS_KEY"],
            "AWS_DEFAULT_REGION": os.environ["AWS_DEFAULT_REGION"],
            "PREFECT_API_URL": api,
            "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        }
        # Only what a container has besides its compose environment: a PATH (with this
        # interpreter's ckpt / prefect / python first) and a HOME.
        (tmp_path / "home").mkdir()
        bare = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"),
                "HOME": str(tmp_path / "home")}

        def env_of(service: str, **extra: str) -> dict[str, str]:
            compose = _compose_env(service)
            # A node's name is no address: it is taken as the compose file says it.
            literal = {k: v for k, v in compose.items() if k == "CKPT_HOST"}
            unknown = set(compose) - set(values) - set(literal) - set(extra)
            assert not unknown, f"{service}: the test has no value for {sorted(unknown)}"
            env = {k: extra.get(k, literal.get(k, values.get(k, ""))) for k in compose}
            return script_env({**bare, **env, **extra})

        # The two one-shots need nothing of each other (in compose make-bucket also waits for
        # db-upgrade, a rule every ckptstore service follows): run them side by side.
        one_shots = {
            "db-upgrade": _start("db-upgrade", [str(STACK / "db-upgrade.sh")],
                                 env_of("db-upgrade"), logs),
            "make-bucket": _start("make-bucket", [str(STACK / "make-bucket.py")],
                                  env_of("make-bucket"), logs),
        }
        for name, proc in one_shots.items():
            stack.callback(stop, proc)
            _finish(name, proc, logs)
        client = s3.client()
        for url in (warm, cold):
            client.head_bucket(Bucket=url.split("/")[2])  # raises unless it was created
        lap("db-upgrade.sh + make-bucket.py")

        stack.callback(forget_pool, api, POOL)  # runs after the agents below are stopped
        agents: dict[str, subprocess.Popen[bytes]] = {}
        for service, host in NODES.items():
            assert _compose_env(service)["CKPT_HOST"] == host
            env = env_of(
                service,
                # Prefect's own settings, for a short test only: poll every second (default
                # 10 s), start runs at most 2 s early, and log which worker submits what.
                PREFECT_HOME=str(tmp_path / f"prefect-{host}"),
                PREFECT_WORKER_QUERY_SECONDS="1", PREFECT_WORKER_PREFETCH_SECONDS="2",
                PREFECT_WORKER_HEARTBEAT_SECONDS="5", PREFECT_LOGGING_LEVEL="INFO",
            )
            agents[host] = stack.enter_context(
                _started(service, [str(STACK / "agent.sh"), POOL], env, logs)
            )
        ui_port = free_port()
        ui = stack.enter_context(
            _started("ui", [str(STACK / "ui.sh"), "--port", str(ui_port)], env_of("ui"), logs)
        )

        def agents_alive() -> None:
            dead = {h: p.returncode for h, p in agents.items() if p.poll() is not None}
            assert not dead, f"agents exited {dead}\n{_tail(logs)}"

        # The trainer starts once the archive deployment is on the pool (compose: it waits
        # for agent-node-a's healthcheck); the workers come online meanwhile.
        deadline = time.monotonic() + 120
        while _deployed_on(api, "ckpt-archive/ckptstore") != POOL:
            agents_alive()
            if time.monotonic() > deadline:
                pytest.fail(f"no ckpt-archive deployment on {POOL} after 120 s\n{_tail(logs)}")
            time.sleep(1)
        lap("deployments registered")
        trained = _run(
            "trainer",
            [str(STACK / "trainer.sh"), "--run", RUN, "--steps", str(STEPS),
             "--save-every", str(SAVE_EVERY)],
            env_of("trainer"), logs,
        )
        assert trained.count("flow run ") == STEPS // SAVE_EVERY, trained
        lap("trainer.sh")
        deadline = time.monotonic() + 90
        online = _online_workers(api)
        workers = {f"ckpt-agent-{h}" for h in NODES.values()}  # `ckpt agent` names them
        while not workers <= online:
            agents_alive()
            if time.monotonic() > deadline:
                pytest.fail(f"workers online after 90 s: {online}\n{_tail(logs)}")
            time.sleep(1)
            online = _online_workers(api)

        store = stack.enter_context(
            CheckpointStore.open(root, catalog_url=catalog_url, hot=str(hot), warm=warm,
                                 storage_options={"endpoint_url": s3.endpoint_url})
        )
        saved = store.list(run=RUN, order_by="step")
        assert [ck.step for ck in saved] == [10, 20, 30]
        # Each agent records its node's heartbeat (`ckpt doctor` reports nodes gone silent);
        # node-b never saves, so only its agent can have recorded it.
        seen = {h.name: h.role for h in store.catalog.hosts()}
        assert set(NODES.values()) <= set(seen) and seen["node-b"] == "agent", seen
        deadline = time.monotonic() + 150
        while True:
            fresh = [store.catalog.get_any(ck.id) for ck in saved]
            states = [ck.replica("warm").state if ck.replica("warm") else None for ck in fresh]
            if all(state == ReplicaState.PRESENT for state in states):
                break
            if time.monotonic() > deadline:
                pytest.fail(f"warm replicas after 150 s: {states}\n{_tail(logs)}")
            agents_alive()
            time.sleep(1)
        lap("archive runs on the agents")
        archived_by: list[str] = []
        for ck in saved:
            events = [e for e in store.catalog.events(ck.id, limit=50) if e.kind == "archived"]
            assert len(events) == 1, (ck.ref, events)
            # The agents tag their work with their CKPT_HOST (``[purpose:]host:pid:tag``).
            hosts = [h for h in NODES.values() if f":{h}:" in f":{events[0].actor}"]
            assert len(hosts) == 1, (ck.ref, events[0].actor)
            archived_by.append(hosts[0])

        pruned = _run("ckpt-prune", ["ckpt", "prune", "--tier", "hot", "--keep-last", "1"],
                      env_of("agent-node-a"), logs)
        hot_states = [store.catalog.get_any(ck.id).replica("hot") for ck in saved]
        assert [r.state if r else None for r in hot_states[:2]] in (
            [ReplicaState.DELETED] * 2, [None, None]), (hot_states, pruned)
        assert hot_states[2] is not None and hot_states[2].state == ReplicaState.PRESENT
        lap("ckpt prune")

        oldest = saved[0]
        _run("ckpt-restore", ["ckpt", "restore", oldest.id],
             env_of("agent-node-b"), logs)
        restored = store.catalog.get_any(oldest.id).replica("hot")
        assert restored is not None and restored.state == ReplicaState.PRESENT
        state: Any = store.load(oldest.id)
        assert int(state["step"]) == oldest.step
        lap("ckpt restore")

        wait_http(f"http://127.0.0.1:{ui_port}/", 60, ui)
        import httpx

        page = httpx.get(f"http://127.0.0.1:{ui_port}/", timeout=10)
        assert page.status_code == 200 and RUN in page.text
        lap("ui answers")

    total = time.monotonic() - t0
    print(f"\nstack as processes in {total:.1f}s: "
          + ", ".join(f"{k} {v:.1f}s" for k, v in timings.items())
          + f"; archived by {archived_by}")
