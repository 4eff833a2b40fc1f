"""A batch of jobs on a thread pool: submit them all, wait for each in order, and on the first
failure cancel the ones not started.

The chunk readers and writers of both layouts (``format/reader.py``, ``format/chunkwriter.py``,
``format/dcp/chunks.py``, ``format/dcp/write.py``) work this way. Cancelling stops only the
queued jobs; the running ones finish before the pool's ``with`` block closes, so nothing is
read into the caller's tensors or written to disk after the caller has seen the failure.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Executor, Future
from contextlib import contextmanager
from typing import Any, TypeVar

__all__ = ["cancel_on_error", "run_all"]

_T = TypeVar("_T")


@contextmanager
def cancel_on_error(futures: Iterable[Future[Any]]) -> Iterator[None]:
    """Cancel every one of ``futures`` not started yet when the block raises (an interrupt
    included), then re-raise."""
    try:
        yield
    except BaseException:
        for future in futures:
            future.cancel()
        raise


def run_all(pool: Executor, jobs: Sequence[Callable[[], _T]]) -> list[_T]:
    """Run ``jobs`` on ``pool`` and return their results in order.

    Raises:
        BaseException: The first failure, in job order (the jobs not started are
            cancelled).
    """
    futures = [pool.submit(job) for job in jobs]
    with cancel_on_error(futures):
        return [future.result() for future in futures]
