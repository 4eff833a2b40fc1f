"""Starting background flows from a store, without waiting and without importing Prefect.

The launcher itself (an embedded worker, or ``run_deployment`` on a Prefect server) is found
through the core (:meth:`ckptstore.core.StoreCore.launcher`); this module only decides the
flow's parameters and its idempotency key.
"""

from __future__ import annotations

from typing import Any

from ckptstore.core import StoreCore
from ckptstore.errors import ConfigError
from ckptstore.records import Checkpoint

__all__ = ["trigger_flow"]

#: The tier parameters of the flows that move data between tiers, with their defaults
#: (flows/archive.py): starting one whose tier is not configured would only fail later, in
#: the background.
_TIER_PARAMS: dict[str, dict[str, str]] = {
    "archive": {"tier": "warm"},
    "demote": {"src": "warm", "dst": "cold"},
}


def trigger_flow(
    core: StoreCore, flow_name: str, checkpoint: Checkpoint | None = None, **params: Any
) -> None:
    """Start a background flow (``archive``, ``retention``, ``verify``, ...); never waits.

    Without a Prefect server the flow runs on this process's one embedded background worker
    (started on first use); with ``PREFECT_API_URL`` set it becomes a ``run_deployment`` of
    the deployment ``ckpt serve`` serves. The flow reopens the store from its root and config
    file, so settings given only as ``open()`` arguments do not reach it.

    Args:
        core: The open store.
        flow_name: Short flow name.
        checkpoint: The checkpoint the flow is about (passed as ``ref``; as ``run`` for
            retention).
        **params: Other flow parameters (plain values, never credentials).

    :meth:`~ckptstore.core.StoreCore.close` waits for the flows started here.

    Archiving a checkpoint saved across hosts starts one run per host, on that host's work
    queue (``ckpt agent`` serves it there); an embedded worker runs only its own host's, so
    call it on every host (every rank may: runs are deduplicated per host).

    Raises:
        ConfigError: For an unknown flow, when a tier the flow moves data to or from is not
            configured, or when no launcher can be loaded.
    """
    configured = core.settings.tier_urls()
    for param, default in _TIER_PARAMS.get(flow_name, {}).items():
        tier = params.get(param, default)
        if tier not in configured:
            raise ConfigError(
                f"cannot start the {flow_name} flow: tier {tier!r} is not configured; set it "
                "under [tiers] in the config"
            )
    key = None
    if checkpoint is not None:
        if flow_name == "retention":
            params.setdefault("run", checkpoint.run)
        else:
            params.setdefault("ref", checkpoint.id)
        key = f"{flow_name}:{checkpoint.id}"
    elif "ref" in params:
        key = f"{flow_name}:{params['ref']}"
    config = str(core.settings.source) if core.settings.source else None
    launcher = core.launcher()
    core.flows_launched = True
    if (flow_name == "archive" and checkpoint is not None and checkpoint.parted
            and params.get("src", "hot") == "hot" and core.settings.hot_remote is None):
        # Saved across hosts: each host uploads its own part, so one run per host, on that
        # host's work queue (its agent), deduplicated per host across every rank that asks.
        for part_host in checkpoint.hosts:
            launcher.launch(
                flow_name, params, store_root=str(core.settings.root), config=config,
                idempotency_key=f"{key}:{part_host}", work_queue=part_host,
            )
        return
    launcher.launch(
        flow_name, params, store_root=str(core.settings.root), config=config,
        idempotency_key=key,
    )
