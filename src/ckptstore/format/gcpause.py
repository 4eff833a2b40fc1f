"""Pause Python's cyclic garbage collector while a checkpoint is written or read.

A save creates tens of thousands of short-lived objects (manifest entries, views, futures);
each burst triggers collections that traverse every live object of the training process —
model, optimizer, data pipeline — which measured ~5% of a save's CPU time. Nothing a save
allocates forms reference cycles that must be freed before it returns, so the collector is
paused for its duration and resumed afterwards; a collection that came due meanwhile runs
at the next allocation. The same holds for parsing a manifest (``parse_manifest``) and for
the whole save transaction with its catalog work (``ckptstore.ops.writing.save``).
"""

from __future__ import annotations

import functools
import gc
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import ParamSpec, TypeVar

__all__ = ["gc_paused", "without_gc"]

_P = ParamSpec("_P")
_R = TypeVar("_R")

_lock = threading.Lock()
_depth = 0
_was_enabled = False


@contextmanager
def gc_paused() -> Iterator[None]:
    """Disable automatic collection inside the block; nested and concurrent uses compose.

    The collector is re-enabled when the last concurrent user leaves, and only if it was
    enabled when the first one entered (a caller that disabled it keeps it disabled).
    """
    global _depth, _was_enabled
    with _lock:
        if _depth == 0:
            _was_enabled = gc.isenabled()
            gc.disable()
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0 and _was_enabled:
                gc.enable()


def without_gc(func: Callable[_P, _R]) -> Callable[_P, _R]:
    """Decorator: run ``func`` inside :func:`gc_paused`."""

    @functools.wraps(func)
    def wrapper(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        with gc_paused():
            return func(*args, **kwargs)

    return wrapper
