"""Prefect tasks that export checkpoints to plain formats and import them back."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from prefect import task
from prefect.cache_policies import NO_CACHE

from ckptstore.tasks.summary import to_jsonable

if TYPE_CHECKING:
    from ckptstore.store import CheckpointStore

__all__ = ["export_task", "import_task"]

logger = logging.getLogger(__name__)


@task(name="export-checkpoint", cache_policy=NO_CACHE)
def export_task(store: CheckpointStore, ref: str, fmt: str, out: str) -> dict[str, Any]:
    """Export ``ref`` as ``fmt`` (``pt``, ``safetensors``, ``hf``) to ``out``.

    Args:
        store: The open store.
        ref: The checkpoint reference.
        fmt: Output format.
        out: Output path.

    Returns:
        ``{"ref": ..., "format": ..., "path": ...}``.
    """
    from ckptstore.ops.upkeep.convert import export_checkpoint

    path = export_checkpoint(store, ref, fmt, out)
    return {"ref": ref, "format": fmt, "path": str(path)}


@task(name="import-checkpoint", cache_policy=NO_CACHE)
def import_task(
    store: CheckpointStore,
    path: str,
    run: str,
    step: int,
    fmt: str | None = None,
) -> dict[str, Any]:
    """Import a ``.pt`` / safetensors / HF folder / DCP checkpoint as a new checkpoint.

    Args:
        store: The open store.
        path: Source path.
        run: Run to file it under.
        step: Step to record.
        fmt: Source format (default: detected).

    Returns:
        The new checkpoint record as a dict.
    """
    from ckptstore.ops.upkeep.convert import import_checkpoint

    ck = import_checkpoint(store, path, run=run, step=step, fmt=fmt)
    return {"ref": ck.ref, "id": ck.id, "checkpoint": to_jsonable(ck)}
