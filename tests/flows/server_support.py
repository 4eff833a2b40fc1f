"""Helpers for the tests that run a real ``prefect server start`` (and workers) on 127.0.0.1.

Shared by test_deployments.py, test_scaleout.py and tests/deploy/test_stack.py. Not a
conftest: the tests import it by putting this directory on ``sys.path`` (pytest runs with
``--import-mode=importlib``).
Every process started here gets its own process group, so :func:`stop` ends it with its
children (a Prefect worker's flow-run subprocesses, the server's services).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from ckptstore.testing.ports import free_port

__all__ = [
    "SERVER_SCRIPT",
    "forget_pool",
    "free_port",
    "prefect_server",
    "script_env",
    "stop",
    "stop_all",
    "wait_http",
]


def stop(proc: subprocess.Popen[bytes], timeout: float = 15.0) -> None:
    """SIGINT the process group (Prefect's processes ignore SIGTERM for a while), then SIGKILL."""
    if proc.poll() is not None:
        # The leader is gone; its children may not be (a worker's flow-run subprocesses).
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        return
    try:
        os.killpg(proc.pid, signal.SIGINT)
        proc.wait(timeout)
    except (subprocess.TimeoutExpired, ProcessLookupError):
        pass
    # Whatever is left of the group (children that outlived the leader) goes now.
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(10)


def stop_all(procs: list[subprocess.Popen[bytes]], timeout: float = 5.0) -> None:
    """:func:`stop` several processes at once: every group gets SIGINT first, so their
    shutdowns overlap (one after the other, two Prefect workers took 30 s), then whatever is
    left after ``timeout`` is killed."""
    for proc in procs:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGINT)
    deadline = time.monotonic() + timeout
    for proc in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(max(0.0, deadline - time.monotonic()))
    for proc in procs:
        stop(proc, timeout=0.0)


def forget_pool(api: str, pool: str) -> None:
    """Delete work pool ``pool`` and every deployment on it from the server at ``api``.

    Leaves the session's shared server as the test found it: deployment names are global
    (``ckpt-<flow>/ckptstore``), and a later test that waits for its own registration of one
    must not find ours, on a pool nobody polls any more (nor its cron still creating runs).
    """
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import WorkPoolFilter, WorkPoolFilterName
    from prefect.exceptions import ObjectNotFound
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings({PREFECT_API_URL: api}), get_client(sync_client=True) as client:
        ours = WorkPoolFilter(name=WorkPoolFilterName(any_=[pool]))
        for deployment in client.read_deployments(work_pool_filter=ours):
            with contextlib.suppress(ObjectNotFound):
                client.delete_deployment(deployment.id)
        with contextlib.suppress(ObjectNotFound):
            client.delete_work_pool(pool)


def wait_http(url: str, timeout: float, proc: subprocess.Popen[bytes],
              log: Path | None = None) -> None:
    """Poll ``url`` until it answers 200; fail if ``proc`` exits or time runs out.

    Args:
        url: What to poll.
        timeout: Longest wait in seconds.
        proc: The process that should answer.
        log: Where ``proc`` writes its output: the failure quotes its end.
    """
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(
                f"process exited early with {proc.returncode}{_log_tail(log)}")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise AssertionError(f"{url} did not answer within {timeout}s{_log_tail(log)}")


def _log_tail(log: Path | None, nbytes: int = 4000) -> str:
    if log is None or not log.exists():
        return ""
    data = log.read_bytes()[-nbytes:].decode("utf-8", "replace")
    return f"; the end of its output ({log}):\n{data}"


#: The stack's entry point for the server (docker-compose.yml runs the same script).
SERVER_SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "stack" / "prefect-server.sh"


def script_env(base: dict[str, str] | None = None) -> dict[str, str]:
    """``base`` (default this process's environment) with this interpreter's ``bin/`` first on
    PATH, so the stack scripts' ``ckpt`` / ``prefect`` / ``python`` are the tested ones."""
    env = dict(os.environ if base is None else base)
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    return env


@contextlib.contextmanager
def prefect_server(home: Path, *, startup_s: float = 120) -> Iterator[tuple[str, dict[str, str]]]:
    """Run ``prefect server start`` through scripts/stack/prefect-server.sh on a free loopback
    port with its own PREFECT_HOME.

    Args:
        home: PREFECT_HOME of the server (its SQLite database lives there).
        startup_s: Longest wait for ``/api/health``.

    Yields:
        ``(api_url, env)``: ``env`` is this process's environment plus that PREFECT_HOME and
        ``PREFECT_API_URL``, for the subprocesses that talk to the server.
    """
    port = free_port()
    env = {
        **os.environ,
        "PREFECT_HOME": str(home),
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_LOGGING_LEVEL": "WARNING",
    }
    env.pop("PREFECT_API_URL", None)
    # Where it listens comes from Prefect's own settings, as in docker-compose.yml.
    server_env = script_env(
        {**env, "PREFECT_SERVER_API_HOST": "127.0.0.1", "PREFECT_SERVER_API_PORT": str(port)}
    )
    log = home / "server.log"
    with log.open("wb") as out:
        server = subprocess.Popen(
            [str(SERVER_SCRIPT)],
            env=server_env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
        )
    try:
        api = f"http://127.0.0.1:{port}/api"
        wait_http(f"{api}/health", startup_s, server, log)
        yield api, {**env, "PREFECT_API_URL": api}
    finally:
        stop(server)
