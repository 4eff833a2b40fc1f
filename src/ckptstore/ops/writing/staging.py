"""Staging a state into host memory: the plan, the copy, and the pool of reused buffers.

Copying into memory that is already faulted in runs at memcpy speed while copying into fresh
pages runs several times slower (docs/ARCHITECTURE.md, "The path of a save"), so the buffers
of one save are kept for the next save of the same shapes. The async saver
(:mod:`ckptstore.ops.writing.async_save`) stages the tensors of the state it flattened, so
staging never walks the state itself; ``dcp.async_save`` staging
(:mod:`ckptstore.ops.dcp.stage`) uses the pool.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from ckptstore.errors import CkptError, ConfigError
from ckptstore.format import FlatState

__all__ = [
    "BufferKey",
    "StagingPlan",
    "StagingPool",
    "copy_into_buffers",
    "key_nbytes",
    "plan_staging",
    "staged_state",
]

logger = logging.getLogger(__name__)

#: Pool key of one staging buffer: (key path, shape, dtype, pinned).
BufferKey = tuple[str, tuple[int, ...], torch.dtype, bool]


class StagingPool:
    """Host buffers for staging, reused across saves, bounded by a byte budget.

    Lifecycle: :meth:`acquire` reserves the bytes of one staging set (waiting while the
    budget is taken by unfinished saves) and hands out one buffer per key, reusing idle ones;
    :meth:`release` returns the set once its save finished. Idle buffers stay in the pool for
    the next save and are evicted (least recently used first) only when a new allocation
    would push the pool over the budget.

    Thread-safe.

    Attributes:
        budget_bytes: Most bytes the pool may hold (in use and idle together).
    """

    def __init__(self, budget_bytes: int) -> None:
        """Create an empty pool.

        Args:
            budget_bytes: Most bytes the pool may hold.

        Raises:
            ConfigError: If the budget is not a positive int.
        """
        if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int) or budget_bytes <= 0:
            raise ConfigError(
                f"staging_budget_bytes must be a positive int, got {budget_bytes!r}; "
                "set it to a few times the size of the training state"
            )
        self.budget_bytes = budget_bytes
        self._cond = threading.Condition()
        self._idle: OrderedDict[BufferKey, list[torch.Tensor]] = OrderedDict()
        self._idle_bytes = 0
        self._in_use_bytes = 0
        self._allocated = 0  # buffers created over the pool's life (reuse shows as no growth)

    @property
    def in_use_bytes(self) -> int:
        """Bytes reserved by staging sets whose saves have not finished."""
        with self._cond:
            return self._in_use_bytes

    @property
    def idle_bytes(self) -> int:
        """Bytes of idle buffers kept for reuse."""
        with self._cond:
            return self._idle_bytes

    @property
    def allocations(self) -> int:
        """Number of buffers allocated so far (constant once a state's buffers are reused)."""
        with self._cond:
            return self._allocated

    def acquire(
        self,
        keys: Sequence[BufferKey],
        *,
        should_stop: Callable[[], bool] | None = None,
    ) -> list[torch.Tensor]:
        """Reserve and return one buffer per key, waiting while the budget is in use.

        Args:
            keys: The buffers wanted, in order.
            should_stop: Polled while waiting; when it returns True the wait ends with a
                CkptError (the saver uses it to stop waiting once it is closed).

        Returns:
            Buffers matching ``keys`` (contents undefined), in the same order.

        Raises:
            ConfigError: If the set alone is larger than the budget.
            CkptError: If ``should_stop`` ended the wait.
        """
        sizes = [key_nbytes(key) for key in keys]
        total = sum(sizes)
        if total > self.budget_bytes:
            raise ConfigError(
                f"staging this state needs {total} bytes of host memory but "
                f"staging_budget_bytes is {self.budget_bytes}; raise staging_budget_bytes "
                "(CKPT_STAGING_BUDGET_BYTES) to at least the state size, or save synchronously"
            )
        out: list[torch.Tensor | None] = []
        missing: list[int] = []
        with self._cond:
            waited = False
            while self._in_use_bytes + total > self.budget_bytes:
                if should_stop is not None and should_stop():
                    raise CkptError("the async saver was closed while waiting for staging memory")
                if not waited:
                    logger.info(
                        "staging %s bytes waits for earlier saves (%s of %s bytes in use)",
                        total, self._in_use_bytes, self.budget_bytes,
                    )
                    waited = True
                # Bounded wait so should_stop is polled even if no release ever comes.
                self._cond.wait(timeout=0.5)
            self._in_use_bytes += total
            for i, key in enumerate(keys):
                idle = self._idle.get(key)
                if idle:
                    out.append(idle.pop())
                    self._idle_bytes -= sizes[i]
                    if not idle:
                        del self._idle[key]
                else:
                    out.append(None)
                    missing.append(i)
            # Make room for the new buffers by dropping idle ones nobody asked for this time.
            while self._idle and self._in_use_bytes + self._idle_bytes > self.budget_bytes:
                key, idle = next(iter(self._idle.items()))
                idle.pop()
                self._idle_bytes -= key_nbytes(key)
                if not idle:
                    del self._idle[key]
            self._allocated += len(missing)
        # Allocation happens outside the lock: the bytes are already reserved, and pinned
        # allocations can take milliseconds.
        for i in missing:
            _, shape, dtype, pinned = keys[i]
            out[i] = torch.empty(shape, dtype=dtype, pin_memory=pinned)
        return [buf for buf in out if buf is not None]

    def release(self, keys: Sequence[BufferKey], buffers: Sequence[torch.Tensor]) -> None:
        """Return a staging set to the pool and wake waiting ``acquire`` calls.

        Args:
            keys: The keys the set was acquired with.
            buffers: The buffers returned by :meth:`acquire`.
        """
        with self._cond:
            for key, buf in zip(keys, buffers, strict=True):
                self._idle.setdefault(key, []).append(buf)
                self._idle.move_to_end(key)
                self._idle_bytes += key_nbytes(key)
            self._in_use_bytes -= sum(key_nbytes(key) for key in keys)
            # A release may leave the pool over budget only if buffers were dropped for size
            # elsewhere; trim idle buffers so the bound always holds.
            while self._idle and self._in_use_bytes + self._idle_bytes > self.budget_bytes:
                key, idle = next(iter(self._idle.items()))
                idle.pop()
                self._idle_bytes -= key_nbytes(key)
                if not idle:
                    del self._idle[key]
            self._cond.notify_all()

    def clear(self) -> None:
        """Drop every idle buffer (buffers in use are returned normally later)."""
        with self._cond:
            self._idle.clear()
            self._idle_bytes = 0


def key_nbytes(key: BufferKey) -> int:
    _, shape, dtype, _ = key
    numel = 1
    for dim in shape:
        numel *= dim
    return numel * dtype.itemsize


@dataclass(frozen=True)
class StagingPlan:
    """Where every tensor of a flattened state goes.

    Attributes:
        keys: One buffer key per tensor, in the flattened state's order.
        sources: The tensor each buffer is filled from.
    """

    keys: list[BufferKey]
    sources: list[torch.Tensor]


def plan_staging(flat: FlatState) -> StagingPlan:
    """One buffer per tensor of ``flat``.

    The flattener already stored every tensor, and every exact view of one (tied weights in
    a ``state_dict``), once, and refused the tensors it cannot store; so each buffer stands
    for one stored tensor and the staged copy is stored exactly as the state would be.
    """
    keys: list[BufferKey] = []
    for key, tensor in flat.tensors.items():
        pinned = tensor.device.type == "cuda" and torch.cuda.is_available()
        keys.append((key, tuple(tensor.shape), tensor.dtype, pinned))
    return StagingPlan(keys, list(flat.tensors.values()))


def staged_state(flat: FlatState, buffers: Sequence[torch.Tensor]) -> FlatState:
    """``flat`` with each tensor replaced by its filled staging buffer.

    The tree is shared: the flattener built it from fresh JSON values, so nothing the
    caller changes later reaches it.
    """
    return FlatState(dict(zip(flat.tensors, buffers, strict=True)), flat.tree)


def copy_into_buffers(buffers: Sequence[torch.Tensor], sources: Sequence[torch.Tensor]) -> None:
    """Copy every source tensor into its buffer; return once the bytes are on the host."""
    devices: set[torch.device] = set()
    with torch.no_grad():
        for buf, src in zip(buffers, sources, strict=True):
            if src.device.type == "cuda":
                # Non-blocking device-to-pinned copies overlap; one sync per device below.
                buf.copy_(src.detach(), non_blocking=True)
                devices.add(src.device)
            else:
                buf.copy_(src.detach())
    for device in devices:
        # The caller may change the tensors as soon as submit returns, possibly from another
        # stream, so the host copy must be complete before then.
        torch.cuda.synchronize(device)
