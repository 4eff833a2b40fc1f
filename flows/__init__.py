"""Prefect flows over ckptstore's operations: archive, retention, restore, verify, convert, gc.

Importing this package does not import Prefect: the flows live in submodules
(``ckptstore.flows.archive`` ...), and :mod:`ckptstore.flows.embedded` only imports Prefect on
its worker thread. Look flows up by short name with :func:`get_flow`.
"""

from ckptstore.flows.embedded import EmbeddedRunner, get_runner, shutdown_runners, trigger_flow
from ckptstore.flows.registry import FLOWS, get_flow

__all__ = [
    "FLOWS",
    "EmbeddedRunner",
    "get_flow",
    "get_runner",
    "shutdown_runners",
    "trigger_flow",
]
