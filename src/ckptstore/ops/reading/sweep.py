"""Evaluation sweeps: load a run's checkpoints in order while the next ones are prefetched.

:class:`CheckpointSweep` (``store.iter_checkpoints(run, prefetch=2)``) yields
``(checkpoint, state)`` for each COMMITTED checkpoint of a run, oldest first. One background
thread brings the next ``prefetch`` checkpoints to the hot tier
(:func:`ckptstore.ops.reading.prefetch.prefetch_checkpoint`) while the caller evaluates the current
one, so a sweep over archived checkpoints waits for a transfer only at its start. With
``preload`` (the default when prefetching) a second thread also loads the *next* checkpoint's
state from the hot tier into memory while the caller evaluates the current one, so the
caller's wait between two evaluations is a hand-over, not a load: one more state is held in
memory, never more.

The prefetch thread never runs more than ``prefetch`` checkpoints ahead of the one being loaded, and
it stops when the sweep is exhausted, closed (``close()``, a ``with`` block) or dropped: the
thread holds no reference to the sweep, so an abandoned sweep is collected, and closing
joins the threads and gives back the prefetch leases of checkpoints never loaded.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator, Sequence
from types import TracebackType
from typing import Any

from ckptstore.core import StoreCore
from ckptstore.errors import InvalidNameError
from ckptstore.ops.leases import lease_owner
from ckptstore.ops.reading.load import load_checkpoint
from ckptstore.ops.reading.prefetch import DEFAULT_HOLD_S, prefetch_checkpoint, prefetch_purpose
from ckptstore.records import Checkpoint, CheckpointState

__all__ = ["LOAD_THREAD_NAME", "THREAD_NAME", "CheckpointSweep"]

logger = logging.getLogger(__name__)

#: Name of the background prefetch thread (tests look for leftovers by it).
THREAD_NAME = "ckpt-sweep-prefetch"
#: Name of the thread that loads the next checkpoint's state ahead of the caller.
LOAD_THREAD_NAME = "ckpt-sweep-load"

# Longest single wait of the consumer for the prefetcher; it then checks the thread is
# still alive, so a dead thread cannot hang the sweep.
_WAIT_S = 0.5


class _Shared:
    """What the consumer and the prefetch thread share (never the sweep itself)."""

    def __init__(self, count: int, owner: str) -> None:
        self.cond = threading.Condition()
        self.current = 0  # index of the checkpoint the consumer is on
        self.stop = False
        self.done = [threading.Event() for _ in range(count)]
        self.owner = owner


def _prefetch_ahead(core: StoreCore, ids: Sequence[str], shared: _Shared, ahead: int,
                    hold_s: float) -> None:
    for i, ckpt_id in enumerate(ids):
        with shared.cond:
            while not shared.stop and i > shared.current + ahead:
                shared.cond.wait()
            if shared.stop:
                return
        try:
            prefetch_checkpoint(core, ckpt_id, hold_s=hold_s, owner=shared.owner)
        except Exception as exc:
            # The consumer's own load of it raises the error where the caller sees it.
            logger.warning("prefetching %s for the sweep failed: %s", ckpt_id, exc)
        finally:
            shared.done[i].set()


class _Preload:
    """The next checkpoint's state, loaded on its own thread.

    The thread holds this object, never the sweep, so an abandoned sweep is collected.
    """

    def __init__(self, core: StoreCore, index: int, ckpt_id: str,
                 keys: Sequence[str] | None, shared: _Shared,
                 prefetcher: threading.Thread | None) -> None:
        self.index = index
        self.state: Any = None
        self.loaded = False
        self.thread = threading.Thread(
            target=self._run, name=LOAD_THREAD_NAME, daemon=True,
            args=(core, ckpt_id, keys, shared, prefetcher),
        )
        self.thread.start()

    def _run(self, core: StoreCore, ckpt_id: str, keys: Sequence[str] | None,
             shared: _Shared, prefetcher: threading.Thread | None) -> None:
        # Load from the hot copy the prefetch thread brings, not a second download.
        if prefetcher is not None:
            while not shared.done[self.index].wait(_WAIT_S):
                if shared.stop or not prefetcher.is_alive():
                    break
        if shared.stop:
            return
        try:
            self.state = load_checkpoint(core, ckpt_id, keys=keys)
            self.loaded = True
        except Exception as exc:
            # The consumer loads it again itself and raises the error where it is seen.
            logger.warning("loading %s ahead of the sweep failed: %s", ckpt_id, exc)

    def take(self) -> tuple[bool, Any]:
        """Wait for the load; ``(True, state)``, or ``(False, None)`` when it failed."""
        self.thread.join()
        state, self.state = self.state, None
        return self.loaded, state


class CheckpointSweep(Iterator[tuple[Checkpoint, Any]]):
    """Iterator of ``(checkpoint, state)`` over a run's checkpoints, oldest first.

    Args:
        core: The open store.
        run: The run.
        prefetch: How many checkpoints ahead of the current one to bring to the hot tier
            (0: plain sequential loads, no thread).
        keys: Load only these tensors (fnmatch patterns, as ``store.load``).
        hold_s: Lease lifetime of each prefetched copy when the sweep never loads it.
        preload: With ``prefetch > 0``, load the next checkpoint's state into memory while
            the caller holds the current one (one more state in memory); False to load
            each only when the caller asks for it.

    Raises:
        InvalidNameError: If ``prefetch`` is not a non-negative int or ``preload`` not a
            bool.
        CheckpointNotFoundError: If the run does not exist.
    """

    def __init__(self, core: StoreCore, run: str, *, prefetch: int = 2,
                 keys: Sequence[str] | None = None,
                 hold_s: float = DEFAULT_HOLD_S, preload: bool = True) -> None:
        if isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 0:
            raise InvalidNameError(f"prefetch must be a non-negative int, not {prefetch!r}")
        if not isinstance(preload, bool):
            raise InvalidNameError(f"preload must be True or False, not {preload!r}")
        core.catalog.get_run(run)  # CheckpointNotFoundError naming the runs that exist
        self._core = core
        self._keys = keys
        self._checkpoints = core.catalog.list(run=run, state=CheckpointState.COMMITTED,
                                              order_by="step", limit=None)
        self._shared = _Shared(len(self._checkpoints), lease_owner())
        self._next = 0
        self._closed = False
        self._thread: threading.Thread | None = None
        self._preload = preload and prefetch > 0
        self._pending: _Preload | None = None
        if prefetch > 0 and self._checkpoints:
            self._thread = threading.Thread(
                target=_prefetch_ahead, name=THREAD_NAME, daemon=True,
                args=(core, [ck.id for ck in self._checkpoints], self._shared, prefetch,
                      hold_s),
            )
            self._thread.start()

    @property
    def checkpoints(self) -> list[Checkpoint]:
        """The checkpoints the sweep walks, in order."""
        return list(self._checkpoints)

    def __iter__(self) -> CheckpointSweep:
        return self

    def __next__(self) -> tuple[Checkpoint, Any]:
        if self._closed or self._next >= len(self._checkpoints):
            self.close()
            raise StopIteration
        index = self._next
        ck = self._checkpoints[index]
        with self._shared.cond:
            self._shared.current = index
            self._shared.cond.notify_all()
        loaded, state = False, None
        pending, self._pending = self._pending, None
        if pending is not None and pending.index == index:
            loaded, state = pending.take()
        if not loaded:
            thread = self._thread
            if thread is not None:
                while not self._shared.done[index].wait(_WAIT_S) and thread.is_alive():
                    pass
            state = load_checkpoint(self._core, ck.id, keys=self._keys)
        self._next = index + 1
        if self._preload and self._next < len(self._checkpoints):
            self._pending = _Preload(self._core, self._next, self._checkpoints[self._next].id,
                                     self._keys, self._shared, self._thread)
        return ck, state

    def close(self) -> None:
        """Stop the prefetch thread, wait for it, give back the leases of unused prefetches.

        Idempotent; called on exhaustion, at the end of a ``with`` block and when the sweep
        is garbage-collected.
        """
        if self._closed:
            return
        self._closed = True
        with self._shared.cond:
            self._shared.stop = True
            self._shared.cond.notify_all()
        if self._thread is not None:
            # Bounded by one prefetch in flight: the thread checks ``stop`` between them.
            self._thread.join()
            self._thread = None
        if self._pending is not None:
            # Bounded by one load; its state is dropped.
            self._pending.take()
            self._pending = None
        purpose = prefetch_purpose()
        for ck in self._checkpoints[self._next:]:
            try:
                self._core.catalog.release_lease(ck.id, purpose, self._shared.owner)
            except Exception:  # the catalog may already be closed at interpreter exit
                logger.debug("could not release the prefetch lease on %s", ck.id,
                             exc_info=True)

    def __enter__(self) -> CheckpointSweep:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def __del__(self) -> None:
        # An abandoned sweep (a ``break`` out of the loop) must not leave its thread behind.
        if not getattr(self, "_closed", True):
            self.close()
