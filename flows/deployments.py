"""Server mode: serve every flow as a deployment, with the configured schedules.

``ckpt serve`` calls :func:`serve_all`. It needs a Prefect server (``PREFECT_API_URL``): cron
schedules and ``run_deployment`` do not work against Prefect's ephemeral in-process server.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from ckptstore.errors import ConfigError
from ckptstore.flows.embedded import _UNSCHEDULABLE, DEPLOYMENT_NAME
from ckptstore.flows.registry import FLOWS, get_flow
from ckptstore.flows.schedules import IntervalSchedule, parse_schedule

if TYPE_CHECKING:
    from ckptstore.config import Settings

__all__ = ["build_deployments", "serve_all"]

logger = logging.getLogger(__name__)


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
    """
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
    from prefect import serve

    deployments = build_deployments(settings, name=name)
    serve(*deployments, limit=limit, print_starting_message=False)
