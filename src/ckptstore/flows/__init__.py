"""Prefect flows over ckptstore's operations: archive, retention, restore, verify, convert, gc.

Importing this package does not import Prefect: the flows live in submodules
(``ckptstore.flows.archive`` ...), and :mod:`ckptstore.flows.embedded` only imports Prefect on
its worker thread. Look flows up by short name with :func:`get_flow`. Importing it sets
Prefect's settings for this process and those it starts (telemetry off; see
:mod:`ckptstore.observability.prefect_env`) unless the user set them.
"""

from ckptstore.flows.embedded import EmbeddedRunner, get_runner, shutdown_runners, trigger_flow
from ckptstore.flows.registry import FLOWS, get_flow
from ckptstore.observability.prefect_env import apply_prefect_defaults

apply_prefect_defaults()  # before any submodule imports Prefect

__all__ = [
    "FLOWS",
    "EmbeddedRunner",
    "get_flow",
    "get_runner",
    "shutdown_runners",
    "trigger_flow",
]
