"""A save walks its state once: the flattened state is handed down (async staging, the
writer, the memory tier) instead of each of them flattening it again."""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import FrameType
from typing import Any

import pytest
import torch

from ckptstore.format.flatten import flatten_state
from ckptstore.ops.writing.memory import MEMORY_TIER, attach_memory_tier
from ckptstore.store import CheckpointStore


@contextmanager
def counting_flattens() -> Iterator[list[str]]:
    """Record every call of ``flatten_state`` on any thread, whatever name a module imported
    it under (a profile hook sees the function's code, not the name it was called by)."""
    code = flatten_state.__code__
    calls: list[str] = []

    def profile(frame: FrameType, event: str, arg: Any) -> None:
        if event == "call" and frame.f_code is code:
            calls.append(threading.current_thread().name)

    # Threads started inside the block (the async saver's) get the hook too.
    threading.setprofile(profile)
    sys.setprofile(profile)
    try:
        yield calls
    finally:
        sys.setprofile(None)
        threading.setprofile(None)  # type: ignore[arg-type]


def _state() -> dict[str, Any]:
    gen = torch.Generator().manual_seed(3)
    weight = torch.randn(64, 32, generator=gen)
    return {
        "model": {"weight": weight, "bias": torch.randn(32, generator=gen)},
        "tied": weight,
        "optimizer": {"step": 7, "lr": [0.1, 0.01], "name": "adam"},
    }


@pytest.mark.parametrize("memory", [False, True], ids=["hot", "hot+memory"])
@pytest.mark.parametrize("mode", ["save", "save_async"])
def test_a_save_flattens_its_state_once(
    store: CheckpointStore, tmp_path: Path, mode: str, memory: bool
) -> None:
    if memory:
        # Any directory serves: the test counts walks of the state, not where copies live.
        attach_memory_tier(store, 64 * 2**20, root=tmp_path / "memory")
    state = _state()
    with counting_flattens() as calls:
        if mode == "save":
            ck = store.save("flat", 1, state, metrics={"loss": 1.0})
        else:
            ck = store.save_async("flat", 1, state, metrics={"loss": 1.0}).result(timeout=60)
    assert len(calls) == 1, calls
    # Flattened where the caller called, before anything was staged or written.
    assert calls == [threading.current_thread().name]
    assert (ck.replica(MEMORY_TIER) is not None) == memory
    loaded = store.load(ck.id)
    assert torch.equal(loaded["model"]["weight"], state["model"]["weight"])
    assert loaded["tied"] is loaded["model"]["weight"]
    assert loaded["optimizer"] == state["optimizer"]
