"""Bounded staging for ``dcp.async_save``: copy local shards into reused host buffers.

``dcp.async_save`` first "stages" the state (a copy the training loop cannot change), then
saves the copy on a background thread. DCP's default stager allocates a fresh copy every
time and has no memory bound. Our writer stages instead (it implements DCP's
``AsyncStager``): every plain tensor and every DTensor's *local* shard is copied into a
buffer from the store's :class:`~ckptstore.ops.writing.async_save.StagingPool`, reused across
saves and bounded by ``staging_budget_bytes``: when earlier saves still hold the budget,
staging waits for them instead of allocating more. DTensors are rebuilt around the staged
local tensor with the same mesh and placements, so DCP plans exactly the same shards.
"""

from __future__ import annotations

import copy
import logging
import weakref
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from ckptstore.core import StoreCore
from ckptstore.ops.writing.staging import BufferKey, StagingPool

__all__ = ["StagedSet", "pool_for", "stage_state"]

logger = logging.getLogger(__name__)

_POOLS: weakref.WeakKeyDictionary[Any, StagingPool] = weakref.WeakKeyDictionary()


def pool_for(store: StoreCore) -> StagingPool:
    """The store's staging pool for DCP saves (created on first use)."""
    pool = _POOLS.get(store)
    if pool is None:
        pool = _POOLS[store] = StagingPool(store.settings.staging_budget_bytes)
    return pool


@dataclass
class StagedSet:
    """Buffers one staged state holds; return them with :meth:`release` once written.

    Attributes:
        pool: The pool they came from.
        keys: Their pool keys.
        buffers: The buffers.
    """

    pool: StagingPool
    keys: list[BufferKey] = field(default_factory=list)
    buffers: list[torch.Tensor] = field(default_factory=list)
    released: bool = False

    def release(self) -> None:
        """Give the buffers back to the pool (idempotent)."""
        if not self.released:
            self.released = True
            self.pool.release(self.keys, self.buffers)


@dataclass
class _Slot:
    index: int
    source: DTensor | None  # the DTensor to rebuild around the staged local tensor


def _plain(t: torch.Tensor) -> bool:
    return (
        type(t) in (torch.Tensor, torch.nn.Parameter)
        and t.layout == torch.strided
        and not t.is_quantized
        and t.device.type != "meta"
    )


def _pinned(t: torch.Tensor) -> bool:
    # Pinned host buffers let device-to-host copies run asynchronously.
    return t.device.type == "cuda" and torch.cuda.is_available()


def _collect(obj: Any, path: str, keys: list[BufferKey], sources: list[torch.Tensor]) -> Any:
    """Copy of the structure with a :class:`_Slot` where each stageable tensor was."""
    if isinstance(obj, DTensor):
        local = obj.to_local()
        if not _plain(local):
            raise TypeError(f"{path}: DTensor with a {type(local).__name__} local tensor")
        keys.append((path, tuple(local.shape), local.dtype, _pinned(local)))
        sources.append(local)
        return _Slot(len(keys) - 1, obj)
    if isinstance(obj, torch.Tensor):
        if not _plain(obj):
            raise TypeError(f"{path}: {type(obj).__name__} tensors are staged by DCP's stager")
        keys.append((path, tuple(obj.shape), obj.dtype, _pinned(obj)))
        sources.append(obj)
        return _Slot(len(keys) - 1, None)
    if isinstance(obj, Mapping):
        return {k: _collect(v, f"{path}/{k}", keys, sources) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_collect(v, f"{path}/{i}", keys, sources) for i, v in enumerate(obj)]
    if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
        return tuple(_collect(v, f"{path}/{i}", keys, sources) for i, v in enumerate(obj))
    return copy.deepcopy(obj)


def _rebuild(node: Any, buffers: list[torch.Tensor]) -> Any:
    if isinstance(node, _Slot):
        buf = buffers[node.index]
        if node.source is None:
            return buf
        src = node.source
        try:
            # The private constructor keeps the staged tensor on the host; from_local would
            # move it back to the mesh's device.
            return DTensor(buf, src._spec, requires_grad=False)  # type: ignore[call-arg,no-untyped-call]
        except TypeError:  # pragma: no cover - torch changed the constructor
            return DTensor.from_local(
                buf, src.device_mesh, src.placements, run_check=False, shape=src.shape,
                stride=src.stride(),
            )
    if isinstance(node, dict):
        return {k: _rebuild(v, buffers) for k, v in node.items()}
    if isinstance(node, list):
        return [_rebuild(v, buffers) for v in node]
    if isinstance(node, tuple):
        return tuple(_rebuild(v, buffers) for v in node)
    return node


def stage_state(state: Mapping[str, Any], pool: StagingPool) -> tuple[dict[str, Any], StagedSet]:
    """Copy ``state``'s tensors (DTensors: their local shards) into pooled host buffers.

    Blocks while earlier saves hold the pool's budget.

    Returns:
        The staged state (same structure; tensors are the buffers) and the buffers to release.

    Raises:
        TypeError: If the state holds tensors other than plain tensors and DTensors (the
            caller then falls back to DCP's own stager).
        ConfigError: If the state alone is larger than the staging budget.
    """
    keys: list[BufferKey] = []
    sources: list[torch.Tensor] = []
    template = _collect(state, "", keys, sources)
    buffers = pool.acquire(keys)
    staged = StagedSet(pool, keys, buffers)
    try:
        devices = set()
        with torch.no_grad():
            for buf, src in zip(buffers, sources, strict=True):
                buf.copy_(src.detach(), non_blocking=src.device.type == "cuda")
                if src.device.type == "cuda":
                    devices.add(src.device)
        for device in devices:
            torch.cuda.synchronize(device)
    except BaseException:
        staged.release()
        raise
    result = _rebuild(template, buffers)
    assert isinstance(result, dict)
    return result, staged
