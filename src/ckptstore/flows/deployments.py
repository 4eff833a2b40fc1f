"""Server mode: every flow as a deployment, with the configured schedules.

Two ways to run them, both against a Prefect server (``PREFECT_API_URL``; cron schedules and
``run_deployment`` do not work against Prefect's ephemeral in-process server):

* ``ckpt serve`` → :func:`serve_all`: one long-lived process registers the deployments and
  runs their flow runs itself.
* ``ckpt serve --pool NAME`` → :func:`deploy_all`: registers the deployments on a Prefect
  *process* work pool and returns. Any number of ``prefect worker start --pool NAME`` processes,
  on any host with ckptstore installed and the same config file, run them (scale-out). The
  entry points are module paths (``ckptstore.flows.archive.archive_flow``), so no code is
  uploaded or pulled: a worker imports the installed package. Workers share the catalog
  (PostgreSQL) and the tiers; catalog leases keep two runs from copying or deleting the same
  checkpoint.

The pool ckptstore creates starts each flow run with :func:`flow_run_command` (this Python's
``-m prefect.engine``) set in its base job template. Without a command, a Prefect 3.9 process
worker first starts a workspace supervisor process (prefect/workers/process.py), which
prepares a project workspace (a ``uv`` project, pull steps) and only then starts the engine:
a second interpreter importing Prefect per flow run (about 2 CPU-seconds). Our entry points
are module paths of the installed package, so there is nothing to prepare. The command names
an absolute interpreter: every worker host must have ckptstore installed at the same path (one
image, or one environment at one path); ``ckpt agent`` checks that before serving.
"""

from __future__ import annotations

import logging
import shlex
import shutil
import sys
from typing import TYPE_CHECKING, Any

from ckptstore.errors import ConfigError
from ckptstore.flows.embedded import _UNSCHEDULABLE, DEPLOYMENT_NAME
from ckptstore.flows.registry import FLOWS, get_flow, need_prefect
from ckptstore.flows.schedules import IntervalSchedule, parse_schedule

if TYPE_CHECKING:
    from ckptstore.config import Settings

__all__ = [
    "WORK_POOL_TYPE",
    "base_job_template",
    "build_deployments",
    "check_flow_run_command",
    "deploy_all",
    "flow_run_command",
    "require_api_url",
    "serve_all",
]

logger = logging.getLogger(__name__)

#: The only pool type :func:`deploy_all` targets: workers run each flow run as a subprocess of
#: the installed package, which needs no image and no code storage.
WORK_POOL_TYPE = "process"


def _store_parameters(settings: Settings) -> dict[str, Any]:
    # Plain paths only: the serving process reads credentials from its own environment.
    params: dict[str, Any] = {"store_root": str(settings.root)}
    if settings.source is not None:
        params["config"] = str(settings.source)
    return params


def build_deployments(
    settings: Settings, *, name: str = DEPLOYMENT_NAME, flows: list[str] | None = None
) -> list[Any]:
    """One ``RunnerDeployment`` per flow, scheduled from ``settings.schedules``.

    Args:
        settings: The store's settings (root, config file, schedules).
        name: Deployment name (the trigger calls ``ckpt-<flow>/<name>``).
        flows: Short flow names to deploy (default: all).

    Returns:
        The deployments, ready for ``prefect.serve``.

    Raises:
        ConfigError: For an unknown flow or an invalid schedule.
        MissingExtraError: If Prefect is not installed.
    """
    need_prefect("ckpt serve")
    from prefect.types.entrypoint import EntrypointType

    wanted = flows or sorted(FLOWS)
    for flow_name in settings.schedules:
        if flow_name not in FLOWS or flow_name in _UNSCHEDULABLE:
            raise ConfigError(
                f"schedule for {flow_name!r} cannot be served; schedulable flows: "
                + ", ".join(sorted(set(FLOWS) - _UNSCHEDULABLE))
            )
    deployments = []
    for flow_name in wanted:
        text = settings.schedules.get(flow_name)
        kwargs: dict[str, Any] = {}
        if text is not None:
            schedule = parse_schedule(text)
            if isinstance(schedule, IntervalSchedule):
                kwargs["interval"] = schedule.seconds
            else:
                kwargs["cron"] = schedule.text
        deployments.append(
            get_flow(flow_name).to_deployment(
                name=name,
                parameters=_store_parameters(settings),
                entrypoint_type=EntrypointType.MODULE_PATH,
                description=f"ckptstore {flow_name} flow",
                tags=["ckptstore"],
                **kwargs,
            )
        )
        logger.info("deployment ckpt-%s/%s schedule=%s", flow_name, name, text or "none")
    return deployments


def serve_all(settings: Settings, *, name: str = DEPLOYMENT_NAME, limit: int | None = 4) -> None:
    """Serve every flow until interrupted (blocks; Ctrl-C / SIGINT stops it).

    Args:
        settings: The store's settings.
        name: Deployment name.
        limit: Most flow runs at once.

    Raises:
        ConfigError: For an invalid schedule.
    """
    need_prefect("ckpt serve")
    from prefect import serve

    deployments = build_deployments(settings, name=name)
    serve(*deployments, limit=limit, print_starting_message=False)


def require_api_url() -> str:
    """The Prefect API URL in effect (environment or Prefect profile).

    Returns:
        The URL.

    Raises:
        ConfigError: If none is set: deployments and work pools only exist on a server.
    """
    need_prefect("ckpt serve --pool NAME")
    from prefect.settings import get_current_settings

    url = get_current_settings().api.url
    if not url:
        raise ConfigError(
            "PREFECT_API_URL is not set: work-pool deployments need a Prefect server. Start one "
            "(`prefect server start`) and export PREFECT_API_URL=http://<host>:4200/api "
            "(or `prefect config set PREFECT_API_URL=...`)"
        )
    return str(url)


def flow_run_command() -> str:
    """The command a worker starts each flow run with: this interpreter's Prefect engine."""
    return shlex.join([sys.executable, "-m", "prefect.engine"])


def base_job_template() -> dict[str, Any]:
    """Prefect's process work pool template, with :func:`flow_run_command` as the command.

    The command is the default of the template's ``command`` variable, so a deployment's
    or a flow run's job variables may still replace it.
    """
    from prefect.workers.process import ProcessWorker

    template: dict[str, Any] = ProcessWorker.get_default_base_job_template()
    template["variables"]["properties"]["command"]["default"] = flow_run_command()
    return template


def check_flow_run_command(pool: str) -> None:
    """Refuse to serve a pool whose flow runs would start a program this host lacks.

    Raises:
        ConfigError: If the pool's command names a program that is not here (another
            install path on this host), or the server cannot be reached.
    """
    need_prefect("ckpt agent")
    import httpx
    from prefect.client.orchestration import get_client

    try:
        with get_client(sync_client=True) as client:
            template = client.read_work_pool(pool).base_job_template
    except httpx.TransportError as exc:
        raise ConfigError(
            f"cannot reach the Prefect API to read work pool {pool!r}: {exc}"
        ) from exc
    command = template.get("variables", {}).get("properties", {}).get("command", {}).get("default")
    if not command:
        return  # Prefect's own default: the worker's interpreter
    program = shlex.split(str(command))[0]
    if shutil.which(program) is None:
        raise ConfigError(
            f"work pool {pool!r} starts flow runs with {command!r}, but {program} does not "
            "exist on this host: install ckptstore at that path (every worker host the same), "
            "or give the pool another command (`prefect work-pool update --base-job-template`)"
        )


def _ensure_pool(client: Any, pool: str) -> None:
    """Create the process work pool ``pool`` if missing; refuse a pool of another type."""
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.exceptions import ObjectAlreadyExists, ObjectNotFound

    try:
        work_pool = client.read_work_pool(pool)
    except ObjectNotFound:
        try:
            # What `prefect work-pool create --type process` stores, plus the command. A pool
            # that exists keeps its template: its owner may have set it on purpose.
            work_pool = client.create_work_pool(
                WorkPoolCreate(
                    name=pool,
                    type=WORK_POOL_TYPE,
                    base_job_template=base_job_template(),
                    description="ckptstore flows (created by `ckpt serve --pool NAME`)",
                )
            )
            logger.info("created process work pool %s", pool)
        except ObjectAlreadyExists:
            # Another `ckpt serve --pool NAME` (e.g. a second worker host) created it meanwhile.
            work_pool = client.read_work_pool(pool)
    if work_pool.type != WORK_POOL_TYPE:
        raise ConfigError(
            f"work pool {pool!r} has type {work_pool.type!r}; ckptstore deploys to a "
            f"{WORK_POOL_TYPE!r} pool (workers import the installed package, no image). Pick "
            "another pool name or delete that pool"
        )


def deploy_all(
    settings: Settings,
    pool: str,
    *,
    name: str = DEPLOYMENT_NAME,
    flows: list[str] | None = None,
) -> dict[str, str]:
    """Register every flow's deployment on a Prefect process work pool, then return.

    Same parameters and schedules as :func:`build_deployments`. The pool is created when
    missing. Running it again updates the deployments in place (idempotent), so every
    worker host may run it at start-up. Flow runs then wait for
    ``prefect worker start --pool <pool>`` processes; each runs a flow run in a subprocess
    that imports ``ckptstore.flows.<module>`` and reads credentials from its environment.

    Args:
        settings: The store's settings (root, config file, schedules).
        pool: Work pool name.
        name: Deployment name (the trigger calls ``ckpt-<flow>/<name>``).
        flows: Short flow names to deploy (default: all).

    Returns:
        ``ckpt-<flow>/<name>`` → deployment id, for every deployment registered.

    Raises:
        ConfigError: If PREFECT_API_URL is not set, the server cannot be reached or refuses
            a deployment, the pool exists with another type, or a schedule is invalid.
    """
    need_prefect("ckpt serve --pool NAME")
    import httpx
    from prefect.client.orchestration import get_client
    from prefect.deployments.runner import DeploymentApplyError

    if not pool or not pool.strip():
        raise ConfigError("work pool name is empty; pass --pool NAME")
    api_url = require_api_url()
    deployments = build_deployments(settings, name=name, flows=flows)
    registered: dict[str, str] = {}
    try:
        with get_client(sync_client=True) as client:
            _ensure_pool(client, pool)
        for deployment in deployments:
            deployment_id = deployment.apply(work_pool_name=pool)
            registered[f"{deployment.flow_name}/{deployment.name}"] = str(deployment_id)
            logger.info("deployment %s/%s on work pool %s", deployment.flow_name, name, pool)
    except httpx.TransportError as exc:
        raise ConfigError(
            f"cannot reach the Prefect API at {api_url}: {exc}; start the server or fix "
            "PREFECT_API_URL"
        ) from exc
    except (DeploymentApplyError, httpx.HTTPStatusError) as exc:
        raise ConfigError(
            f"the Prefect server refused a deployment on work pool {pool!r}: {exc}"
        ) from exc
    return registered
