"""The flows by short name (``archive``, ``retention``, ...), imported on first use."""

from __future__ import annotations

import importlib
import logging
from typing import Any

from ckptstore.errors import ConfigError
from ckptstore.extras import require

__all__ = ["FLOWS", "entrypoint", "get_flow", "need_prefect"]

logger = logging.getLogger(__name__)

#: short name → (module, attribute)
FLOWS: dict[str, tuple[str, str]] = {
    "archive": ("ckptstore.flows.archive", "archive_flow"),
    "demote": ("ckptstore.flows.archive", "demote_flow"),
    "retention": ("ckptstore.flows.retention", "retention_flow"),
    "restore": ("ckptstore.flows.restore", "restore_flow"),
    "prefetch": ("ckptstore.flows.prefetch", "prefetch_flow"),
    "thaw": ("ckptstore.flows.prefetch", "thaw_flow"),
    "verify": ("ckptstore.flows.verify", "verify_flow"),
    "convert": ("ckptstore.flows.convert", "convert_flow"),
    "import": ("ckptstore.flows.convert", "import_flow"),
    "gc": ("ckptstore.flows.gc", "gc_flow"),
    "compact": ("ckptstore.flows.compact", "compact_flow"),
    "merge": ("ckptstore.flows.merge", "merge_flow"),
    "sync": ("ckptstore.flows.sync", "sync_flow"),
}


def need_prefect(feature: str = "Prefect flows") -> None:
    """Raise the error naming the 'flows' extra when Prefect is not installed.

    Raises:
        MissingExtraError: If ``prefect`` cannot be imported.
    """
    require("prefect", feature)


def get_flow(name: str) -> Any:
    """The Prefect flow object for a short name.

    Args:
        name: One of :data:`FLOWS`.

    Returns:
        The flow.

    Raises:
        ConfigError: For an unknown name.
        MissingExtraError: If Prefect is not installed.
    """
    if name not in FLOWS:
        raise ConfigError(f"unknown flow {name!r}; known flows: {', '.join(sorted(FLOWS))}")
    need_prefect(f"the {name} flow")
    module, attr = FLOWS[name]
    return getattr(importlib.import_module(module), attr)


def entrypoint(name: str) -> str:
    """The module-path entrypoint of a flow (``ckptstore.flows.archive.archive_flow``)."""
    if name not in FLOWS:
        raise ConfigError(f"unknown flow {name!r}; known flows: {', '.join(sorted(FLOWS))}")
    module, attr = FLOWS[name]
    return f"{module}.{attr}"
