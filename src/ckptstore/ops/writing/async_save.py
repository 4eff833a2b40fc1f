"""Asynchronous saves: stage the state into reused host buffers, write it in the background.

``AsyncSaver.submit`` blocks the training loop only while the state's tensors are copied into
host staging buffers. The buffers come from a pool keyed by (key path, shape, dtype) and are
reused across saves: copying into memory that is already faulted in runs at memcpy speed
(6-10 GB/s on the 2-vCPU development VM) while copying into fresh pages is bound by page
faults (~2 GB/s there), so only the first save of a state pays for allocation.

Host memory is bounded by ``staging_budget_bytes``: the pool never holds more than the budget
(buffers in use by unfinished saves plus idle buffers kept for reuse). When staging a state
would exceed it, ``submit`` waits for earlier saves to finish instead of allocating more.

``submit`` flattens the state once (refusing what cannot be stored, as a synchronous save
does), stages the flattened tensors, and hands the staged flat state to one background thread
per saver, which runs the save transaction on it in submission order
(:func:`~ckptstore.ops.writing.save.write_save`): the state is never walked again. A failed
save is never COMMITTED (it is marked FAILED); its exception is raised, once, by the next
``submit()`` or ``wait()`` and is available from its handle.

Example:
    >>> saver = AsyncSaver(store, staging_budget_bytes=8 * 2**30)    # doctest: +SKIP
    >>> handle = saver.submit("run-a", 100, state, metrics={"loss": 2.3})  # doctest: +SKIP
    >>> ... keep training, mutate ``state`` freely ...               # doctest: +SKIP
    >>> handle.result().ref                                          # doctest: +SKIP
    'run-a@v1'
"""

from __future__ import annotations

import atexit
import logging
import os
import queue
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from ckptstore.core import StoreCore, StoreService
from ckptstore.errors import CkptError, ConfigError
from ckptstore.format import FlatState, as_flat
from ckptstore.observability.timing import off_training_path
from ckptstore.ops.writing.save import check_save, write_save
from ckptstore.ops.writing.staging import (
    BufferKey,
    StagingPool,
    copy_into_buffers,
    key_nbytes,
    plan_staging,
    staged_state,
)
from ckptstore.save_options import SaveOptions, options_of

if TYPE_CHECKING:
    from ckptstore.records import Checkpoint

__all__ = [
    "AsyncSaver",
    "SaveHandle",
    "close_saver",
    "save_async",
    "saver_for",
    "wait_async",
]

logger = logging.getLogger(__name__)

#: Niceness added to the background save thread by default (see :class:`AsyncSaver`).
DEFAULT_NICE = 10

# --------------------------------------------------------------------------- handles
class SaveHandle:
    """The pending result of one asynchronous save.

    Attributes:
        run: Run name of the save.
        step: Training step of the save.
        staged_bytes: Tensor bytes copied into staging buffers.
        blocked_s: Seconds ``submit`` blocked the caller (budget wait + staging copy).
        waited_s: Part of ``blocked_s`` spent waiting for staging memory.
    """

    def __init__(self, run: str, step: int, future: Future[Checkpoint]) -> None:
        """Wrap ``future``; made by :meth:`AsyncSaver.submit`."""
        self.run = run
        self.step = step
        self._future = future
        self.staged_bytes = 0
        self.blocked_s = 0.0
        self.waited_s = 0.0

    def result(self, timeout: float | None = None) -> Checkpoint:
        """Wait for the save and return the COMMITTED checkpoint.

        Args:
            timeout: Seconds to wait (None waits until done).

        Returns:
            The committed checkpoint.

        Raises:
            TimeoutError: If the save is still running after ``timeout`` seconds.
            CkptError: The error the save failed with (nothing was committed).
        """
        return self._future.result(timeout)

    def done(self) -> bool:
        """Whether the save finished (committed or failed)."""
        return self._future.done()

    def exception(self, timeout: float | None = None) -> BaseException | None:
        """Wait for the save; return its error, or None if it was committed.

        Raises:
            TimeoutError: If the save is still running after ``timeout`` seconds.
        """
        return self._future.exception(timeout)

    def __repr__(self) -> str:
        """Show the run, step and whether it finished."""
        state = "done" if self.done() else "pending"
        return f"SaveHandle({self.run}@step{self.step}, {state})"


@dataclass
class _Job:
    run: str
    step: int
    state: FlatState | None  # the staged copy; dropped once the save is done
    keys: list[BufferKey]
    buffers: list[torch.Tensor]
    options: SaveOptions
    progress: Callable[[int], None] | None
    on_commit: Callable[[Checkpoint], None] | None
    handle: SaveHandle
    future: Future[Checkpoint]
    # Frees memory the job reads that the pool does not own (a pinned snapshot slot).
    release: Callable[[], None] | None = None


# --------------------------------------------------------------------------- the saver
class AsyncSaver(StoreService):
    """Save states in the background after staging them into reused host buffers.

    Lifecycle: ``submit`` (any number of times) → ``wait`` (optional, raises the first
    unreported failure) → ``close``. One background thread writes the saves in submission
    order; it starts with the first submit.

    Thread-safe: ``submit`` may be called from several threads. ``submit``, ``wait`` and
    ``close`` refuse to run inside an ``on_commit`` callback (that runs on the background
    thread and would wait for itself).

    Attributes:
        store: The store saves go to.
        pool: The staging buffer pool (its budget bounds host memory).
    """

    def __init__(
        self,
        store: StoreCore,
        *,
        staging_budget_bytes: int,
        nice: int = DEFAULT_NICE,
    ) -> None:
        """Create a saver for ``store``.

        Args:
            store: An open store.
            staging_budget_bytes: Most host memory the staging buffers may use.
            nice: CPU niceness added to the background thread (and the writer threads it
                starts) on Linux, so that when cores are scarce the training loop wins and
                the save takes longer instead; 0 keeps the caller's priority.

        Raises:
            ConfigError: If the budget is not a positive int or ``nice`` is negative.
        """
        if isinstance(nice, bool) or not isinstance(nice, int) or nice < 0:
            raise ConfigError(f"nice must be an int >= 0, got {nice!r}")
        self.store = store
        self.nice = nice
        self.pool = StagingPool(staging_budget_bytes)
        self._lock = threading.Lock()
        self._queue: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._pending: set[Future[Checkpoint]] = set()
        self._unreported: list[tuple[SaveHandle, BaseException]] = []
        self._closed = False
        _LIVE.add(self)

    # ------------------------------------------------------------------ public
    def submit(
        self,
        run: str,
        step: int,
        state: Any,
        options: SaveOptions | None = None,
        *,
        on_commit: Callable[[Checkpoint], None] | None = None,
        progress: Callable[[int], None] | None = None,
        **fields: Any,
    ) -> SaveHandle:
        """Stage ``state`` and save it in the background.

        Blocks only while earlier saves hold the staging budget and while the tensors are
        copied into staging buffers; the caller may change ``state`` as soon as it returns.

        Args:
            run: Run name.
            step: Training step.
            state: Any nesting of dicts/lists/tuples of tensors and plain values, or its
                :class:`~ckptstore.format.FlatState` when the caller flattened it already.
            options: The save's options (metrics, tags, parent, codec, experiment, delta,
                base).
            on_commit: Called on the background thread with the committed checkpoint, before
                the handle completes (post-commit work such as pinning or pruning); its
                errors are logged, not raised.
            progress: Called on the background thread with the bytes of each chunk written.
            **fields: The options as keywords (the fields of :class:`SaveOptions`), for a
                caller that passes no ``options``.

        Returns:
            A handle on the pending save.

        Raises:
            CkptError: The error of an earlier background save that failed and was not
                reported yet (this state is then not submitted), or if the saver is closed.
            ConfigError: If the state alone is larger than the staging budget, or the hot
                tier is object storage.
            InvalidNameError: For a bad run name, tag, step or metric.
            UnsafeObjectError: If the state holds an object that would need pickle.
            TypeError: For both ``options`` and keywords, or a keyword that is no option.
        """
        options = options_of(options, **fields)
        self._check_not_worker("submit")
        self._raise_unreported()
        if self._closed:
            raise CkptError(
                f"cannot save {run}@{step}: the async saver is closed; open the store again"
            )
        started = time.perf_counter()
        # Like a synchronous save, refuse a bad step or metric now, not in the background.
        step, options = check_save(self.store, run, step, options)
        # The one walk of the state: it refuses pickle-only objects here, like a synchronous
        # save, and what it returns is what is staged and written (the tree is already a
        # snapshot of the plain values; the tensors are copied into the buffers below).
        flat = as_flat(state)
        plan = plan_staging(flat)
        buffers = self.pool.acquire(plan.keys, should_stop=lambda: self._closed)
        acquired = time.perf_counter()
        try:
            # An earlier save may have failed while we waited: report it before this one.
            self._raise_unreported()
            copy_into_buffers(buffers, plan.sources)
        except BaseException:
            self.pool.release(plan.keys, buffers)
            raise
        staged = staged_state(flat, buffers)
        future: Future[Checkpoint] = Future()
        handle = SaveHandle(run, step, future)
        handle.staged_bytes = sum(key_nbytes(key) for key in plan.keys)
        handle.waited_s = acquired - started
        handle.blocked_s = time.perf_counter() - started
        self.store.metrics.observe_blocked("save", handle.blocked_s, run=run, step=step)
        job = _Job(run, step, staged, plan.keys, buffers, options, progress, on_commit, handle,
                   future)
        with self._lock:
            self._pending.add(future)
            self._ensure_thread()
        self._queue.put(job)
        logger.debug(
            "staged %s@%s (%s bytes) in %.3fs", run, step, handle.staged_bytes, handle.blocked_s
        )
        return handle

    def submit_staged(
        self,
        run: str,
        step: int,
        flat: FlatState,
        options: SaveOptions,
        *,
        release: Callable[[], None],
        on_commit: Callable[[Checkpoint], None] | None = None,
    ) -> SaveHandle:
        """Save a state that already lies in stable host memory, without staging it again.

        The snapshot path (:mod:`ckptstore.ops.writing.snapshot`) hands over a pinned
        snapshot slot: ``flat``'s tensors are views of it and ``release`` unpins it once the
        save finished (committed or failed). Queued behind earlier saves, like
        :meth:`submit`.

        Raises:
            CkptError: As :meth:`submit` (``release`` is then called before raising).
            InvalidNameError: For a bad run name, tag, step or metric.
        """
        try:
            self._check_not_worker("submit_staged")
            self._raise_unreported()
            if self._closed:
                raise CkptError(
                    f"cannot save {run}@{step}: the async saver is closed; open the store again")
            step, options = check_save(self.store, run, step, options)
        except BaseException:
            release()
            raise
        future: Future[Checkpoint] = Future()
        handle = SaveHandle(run, step, future)
        job = _Job(run, step, flat, [], [], options, None, on_commit, handle, future,
                   release=release)
        with self._lock:
            self._pending.add(future)
            self._ensure_thread()
        self._queue.put(job)
        return handle

    def wait(self, handles: Iterable[SaveHandle] | None = None) -> None:
        """Wait for pending saves, then raise the first failure not yet reported.

        Args:
            handles: Only wait for (and report failures of) these saves; default all.

        Raises:
            CkptError: The error of a failed save (each failure is raised once).
        """
        self._check_not_worker("wait")
        if handles is None:
            with self._lock:
                futures = list(self._pending)
            for future in futures:
                future.exception()
            self._raise_unreported()
            return
        chosen = list(handles)
        for handle in chosen:
            handle.exception()
        self._raise_unreported(chosen)

    def pending(self) -> int:
        """Number of saves submitted and not finished."""
        with self._lock:
            return len(self._pending)

    def close(self) -> None:
        """Wait for pending saves, stop the background thread and drop the buffers.

        Raises:
            CkptError: The first unreported failure of a save (the saver is closed anyway).
        """
        if self._closed:
            return
        self._check_not_worker("close")
        try:
            self.wait()
        finally:
            self._closed = True
            with self._lock:
                thread, self._thread = self._thread, None
            if thread is not None:
                self._queue.put(None)
                thread.join()
            self.pool.clear()
            _LIVE.discard(self)

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return self._closed

    # ------------------------------------------------------------------ internals
    def _raise_unreported(self, handles: Sequence[SaveHandle] | None = None) -> None:
        """Raise (and forget) the oldest failure not yet raised, among ``handles`` if given."""
        with self._lock:
            found = next(
                (
                    i
                    for i, (handle, _) in enumerate(self._unreported)
                    if handles is None or any(handle is h for h in handles)
                ),
                None,
            )
            if found is None:
                return
            _, exc = self._unreported.pop(found)
        raise exc

    def _check_not_worker(self, what: str) -> None:
        # From the background thread (an on_commit callback) these would wait for themselves.
        if self._thread is not None and threading.current_thread() is self._thread:
            raise CkptError(
                f"AsyncSaver.{what}() was called from an on_commit callback; it would wait for "
                "itself. Do the work after handle.result() on another thread instead"
            )

    def _ensure_thread(self) -> None:
        if self._thread is None or not self._thread.is_alive():
            # Daemon: a hung save must not keep the process alive forever; the atexit hook
            # below waits for pending saves on a normal exit.
            self._thread = threading.Thread(
                target=self._run, name="ckptstore-async-save", daemon=True
            )
            self._thread.start()

    def _run(self) -> None:
        _lower_priority(self.nice)
        while True:
            job = self._queue.get()
            if job is None:
                return
            self._execute(job)

    def _execute(self, job: _Job) -> None:
        try:
            # The background write does not block training; submit() reported what did.
            with off_training_path():
                assert job.state is not None
                ck = write_save(self.store, job.run, job.step, job.state, job.options,
                                progress=job.progress)
        except BaseException as exc:  # every failure must reach the caller, not kill the thread
            job.state = None
            self.pool.release(job.keys, job.buffers)
            if job.release is not None:
                job.release()
            logger.error("async save of %s@%s failed: %s", job.run, job.step, exc)
            with self._lock:
                self._unreported.append((job.handle, exc))
                self._pending.discard(job.future)
            job.future.set_exception(exc)
            return
        # The buffers are free as soon as the data is durable; post-commit work does not
        # need them and must not hold back the next submit.
        job.state = None
        self.pool.release(job.keys, job.buffers)
        if job.release is not None:
            job.release()
        if job.on_commit is not None:
            try:
                job.on_commit(ck)
            except Exception:
                logger.exception("post-commit hook for %s failed", ck.ref)
        with self._lock:
            self._pending.discard(job.future)
        job.future.set_result(ck)

    def _close_at_exit(self) -> None:
        try:
            self.close()
        except BaseException:
            logger.exception("an async save failed before the interpreter exited")


def _lower_priority(nice: int) -> None:
    """Raise this thread's niceness by ``nice`` (Linux: niceness is per thread, inherited by
    threads it starts); elsewhere, or when refused, keep the priority."""
    if nice <= 0 or not hasattr(os, "setpriority") or not sys.platform.startswith("linux"):
        return
    try:
        tid = threading.get_native_id()
        current = os.getpriority(os.PRIO_PROCESS, tid)
        os.setpriority(os.PRIO_PROCESS, tid, min(19, current + nice))
    except OSError:
        logger.debug("could not lower the priority of the async save thread", exc_info=True)


_LIVE: weakref.WeakSet[AsyncSaver] = weakref.WeakSet()


@atexit.register
def _drain_at_exit() -> None:
    # Daemon threads are still alive when atexit hooks run: let pending saves commit.
    for saver in list(_LIVE):
        saver._close_at_exit()


# --------------------------------------------------------------------------- store helpers
def saver_for(store: StoreCore) -> AsyncSaver:
    """The store's async saver, created on first use with the store's staging budget.

    Args:
        store: An open store.

    Returns:
        The saver kept on the store (one per store).
    """
    saver = store.saver
    if isinstance(saver, AsyncSaver) and not saver.closed:
        return saver
    saver = AsyncSaver(store, staging_budget_bytes=store.settings.staging_budget_bytes)
    store.saver = saver
    return saver


def save_async(
    store: StoreCore,
    run: str,
    step: int,
    state: Any,
    options: SaveOptions | None = None,
    *,
    on_commit: Callable[[Checkpoint], None] | None = None,
) -> SaveHandle:
    """Save through the store's async saver; see :meth:`AsyncSaver.submit`.

    Args:
        store: An open store.
        run: Run name.
        step: Training step.
        state: The training state; may be changed as soon as this returns.
        options: The save's options.
        on_commit: Post-commit callback, run on the background thread.

    Returns:
        A handle on the pending save.

    Raises:
        CkptError: An earlier async save's failure (raised once), or a closed saver.
        ConfigError: If the state is larger than ``staging_budget_bytes``.
    """
    return saver_for(store).submit(run, step, state, options, on_commit=on_commit)


def wait_async(store: StoreCore) -> None:
    """Wait for the store's pending async saves (no-op if it never saved asynchronously).

    Raises:
        CkptError: The first failure not yet reported.
    """
    saver = store.saver
    if isinstance(saver, AsyncSaver):
        saver.wait()


def close_saver(store: StoreCore) -> None:
    """Wait for and close the store's async saver; call before closing the catalog.

    Raises:
        CkptError: The first failure not yet reported.
    """
    saver, store.saver = store.saver, None
    if saver is not None:
        saver.close()
