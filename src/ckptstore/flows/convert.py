"""Convert flow: export a checkpoint to ``.pt`` / safetensors / an HF-style folder."""

from __future__ import annotations

import logging
from typing import Any

from prefect import flow

from ckptstore.flows.common import open_store
from ckptstore.tasks.convert import export_task, import_task

__all__ = ["convert_flow", "import_flow"]

logger = logging.getLogger(__name__)


@flow(name="ckpt-convert")
def convert_flow(
    ref: str,
    fmt: str,
    out: str,
    store_root: str | None = None,
    config: str | None = None,
) -> dict[str, Any]:
    """Export ``ref`` as ``fmt`` to ``out`` (memory-bounded streaming).

    Args:
        ref: Checkpoint reference.
        fmt: ``pt``, ``safetensors`` or ``hf``.
        out: Output file or directory.
        store_root: Store directory.
        config: Config file path.

    Returns:
        ``{"ref", "format", "path"}``.
    """
    with open_store(store_root, config) as store:
        result: dict[str, Any] = export_task(store, ref, fmt, out)
    return result


@flow(name="ckpt-import")
def import_flow(
    path: str,
    run: str,
    step: int,
    fmt: str | None = None,
    store_root: str | None = None,
    config: str | None = None,
) -> dict[str, Any]:
    """Import a plain checkpoint (``.pt``, safetensors, HF folder, DCP) as a new version.

    Args:
        path: Source file or directory.
        run: Run to file it under.
        step: Step to record.
        fmt: Source format (default: detected from the path).
        store_root: Store directory.
        config: Config file path.

    Returns:
        ``{"ref", "id", "checkpoint"}``.
    """
    with open_store(store_root, config) as store:
        result: dict[str, Any] = import_task(store, path, run, step, fmt=fmt)
    return result
