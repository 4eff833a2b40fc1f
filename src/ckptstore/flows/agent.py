"""``ckpt agent``: one per node, the node's hands for the work only it can do.

On a cluster whose nodes keep their hot tier on local disks, some work must run on one
particular host: uploading the part of a checkpoint its disk holds, pruning those parts,
removing a failed save's files there. Routing is Prefect's own: one work pool, one work
queue per host (named after the host, ``CKPT_HOST``); triggers for a host's part call
``run_deployment(..., work_queue_name=<host>)`` (see :mod:`ckptstore.ops.trigger`). The
agent of a host:

1. registers every flow's deployment on the pool (idempotent, as ``ckpt serve --pool NAME``);
2. makes sure the pool has this host's queue, and that the program the pool starts flow runs
   with (see :mod:`ckptstore.flows.deployments`) exists on this host;
3. runs ``prefect worker start --pool P --work-queue <host>`` as a child process, so this
   host runs exactly the flow runs queued for it, in subprocesses that know their host;
   with ``shared_hot`` (nodes that mount one hot tier: a volume, NFS) the worker also pulls
   the pool's ``default`` queue, where every other run lands (schedules, checkpoints saved
   by one process), since any such node can do that work;
4. records a heartbeat for the host in the catalog every ``interval_s`` (``ckpt doctor``
   reports parts on hosts silent for longer than ``host_timeout_s``), and every
   ``maintenance_s`` runs this host's gc: its parts of pruned checkpoints and the files of
   failed saves on its disk go.

It stops on SIGINT/SIGTERM (or when the worker exits), stopping the worker with it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

from ckptstore.errors import CkptError, ConfigError
from ckptstore.flows.deployments import check_flow_run_command, deploy_all, require_api_url
from ckptstore.flows.registry import need_prefect
from ckptstore.identity import HOST_ENV, host
from ckptstore.observability.prefect_env import prefect_env
from ckptstore.ops.tiering.gc import gc_hot
from ckptstore.store import CheckpointStore

if TYPE_CHECKING:
    from ckptstore.config import Settings

__all__ = ["DEFAULT_QUEUE", "ensure_work_queue", "run_agent", "worker_command"]

logger = logging.getLogger(__name__)

#: The work queue every process work pool has, where runs without a queue of their own land.
DEFAULT_QUEUE = "default"
#: How long the worker gets to stop after SIGINT before it is killed.
_STOP_S = 15.0


def ensure_work_queue(pool: str, queue: str) -> None:
    """Create work queue ``queue`` in work pool ``pool`` if it is missing.

    Raises:
        ConfigError: If the server cannot be reached or refuses.
    """
    need_prefect("ckpt agent")
    from prefect.client.orchestration import get_client
    from prefect.exceptions import ObjectAlreadyExists, ObjectNotFound

    with get_client(sync_client=True) as client:
        try:
            client.read_work_queue_by_name(queue, work_pool_name=pool)
            return
        except ObjectNotFound:
            pass
        with contextlib.suppress(ObjectAlreadyExists):  # another agent of this host won
            client.create_work_queue(
                name=queue, work_pool_name=pool,
                description=f"ckptstore work for host {queue} (its `ckpt agent`)",
            )
            logger.info("created work queue %s in work pool %s", queue, pool)


def worker_command(pool: str, queue: str, *, shared_hot: bool = False) -> list[str]:
    """The ``prefect worker`` command line serving one host's queue (and, with
    ``shared_hot``, the pool's default queue too)."""
    queues = [queue, DEFAULT_QUEUE] if shared_hot and queue != DEFAULT_QUEUE else [queue]
    return [sys.executable, "-m", "prefect", "worker", "start", "--pool", pool,
            *(arg for q in queues for arg in ("--work-queue", q)), "--type", "process",
            "--name", f"ckpt-agent-{queue}"]


@contextlib.contextmanager
def _worker(pool: str, queue: str, shared_hot: bool) -> Iterator[subprocess.Popen[bytes]]:
    env = prefect_env()  # telemetry off for the worker and its flow runs, unless set
    # The flow runs this worker starts must know they run on this host, whatever its
    # hostname says (one simulated node per value on a single machine, stable names).
    env[HOST_ENV] = queue
    proc = subprocess.Popen(worker_command(pool, queue, shared_hot=shared_hot), env=env,
                            start_new_session=True)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGINT)
            try:
                proc.wait(_STOP_S)
            except subprocess.TimeoutExpired:
                pass
        # What is left of its group (flow-run subprocesses) goes now.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(_STOP_S)


def _tick(settings: Settings, name: str, maintain: bool) -> None:
    """One heartbeat (and this host's gc when ``maintain``); failures are logged, not fatal."""
    try:
        with CheckpointStore.open(settings.root, config=settings.source) as store:
            store.catalog.heartbeat(name, "agent")
            if maintain:
                report = gc_hot(store)
                if not report.empty:
                    logger.info("agent %s: gc removed %d directories, pruned parts %s", name,
                                len(report.removed_dirs), report.pruned_parts)
    except CkptError as exc:  # the catalog or a disk is down: say so, keep serving
        logger.warning("agent %s: heartbeat or maintenance failed: %s", name, exc)


def run_agent(
    settings: Settings,
    pool: str,
    *,
    interval_s: float = 30.0,
    maintenance_s: float = 300.0,
    deploy: bool = True,
    shared_hot: bool = False,
    stop: threading.Event | None = None,
) -> int:
    """Serve this host's work queue until stopped; see the module docstring.

    Args:
        settings: The store's settings (the same config file on every node).
        pool: Prefect work pool.
        interval_s: Seconds between heartbeats.
        maintenance_s: Seconds between two runs of this host's gc.
        deploy: Register the deployments on the pool first.
        shared_hot: This node mounts the hot tier every node mounts: also serve the pool's
            default queue.
        stop: Set it to stop the agent (SIGINT and SIGTERM set it too, on the main thread).

    Returns:
        0 when stopped, the worker's exit status when it ended on its own.

    Raises:
        ConfigError: If PREFECT_API_URL is not set or the server refuses.
        MissingExtraError: If Prefect is not installed.
    """
    need_prefect("ckpt agent")
    require_api_url()
    if interval_s <= 0 or maintenance_s <= 0:
        raise ConfigError("agent intervals must be positive seconds")
    name = host()
    if deploy:
        deploy_all(settings, pool)
    ensure_work_queue(pool, name)
    check_flow_run_command(pool)
    stop = stop or threading.Event()
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: stop.set())
    logger.info("agent %s serving work queue %s%s of pool %s", name, name,
                f" and {DEFAULT_QUEUE}" if shared_hot else "", pool)
    last_maintenance = 0.0
    with _worker(pool, name, shared_hot) as worker:
        while not stop.is_set():
            now = time.monotonic()
            maintain = now - last_maintenance >= maintenance_s
            _tick(settings, name, maintain)
            if maintain:
                last_maintenance = now
            if worker.poll() is not None:
                logger.warning("agent %s: the Prefect worker exited with %s", name,
                               worker.returncode)
                return int(worker.returncode or 1)
            stop.wait(interval_s)
    return 0
