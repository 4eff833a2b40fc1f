"""The flow launcher the core finds through the ``ckptstore.launchers`` entry point.

``store.trigger(...)`` reaches this class without the core importing Prefect or this package
(see ``ckptstore.core.StoreCore.launcher``). It hands the run to this process's embedded
worker, which runs it in-process, or, with ``PREFECT_API_URL`` set, calls
``run_deployment(..., timeout=0)`` for the deployment ``ckpt serve`` serves.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ckptstore.core import FlowLauncher
from ckptstore.flows.embedded import get_runner, wait_for_flows

__all__ = ["PrefectLauncher"]


class PrefectLauncher(FlowLauncher):
    """Launches flows on the embedded worker or a Prefect server; never waits."""

    def launch(
        self,
        flow_name: str,
        params: Mapping[str, Any],
        *,
        store_root: str,
        config: str | None,
        idempotency_key: str | None,
        work_queue: str | None = None,
    ) -> None:
        """Enqueue one run; see :meth:`ckptstore.core.FlowLauncher.launch`."""
        get_runner(store_root, config).submit(flow_name, key=idempotency_key,
                                              work_queue=work_queue, **dict(params))

    def wait_idle(self, *, store_root: str, config: str | None) -> bool:
        """Wait for this process's runner of the store; see :func:`wait_for_flows`."""
        return wait_for_flows(store_root, config)
