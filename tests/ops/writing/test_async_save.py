"""AsyncSaver against a real store: staging, reuse, budget, failures."""

from __future__ import annotations

import shutil
import threading
import time
from collections import OrderedDict
from typing import Any

import pytest
import torch

from ckptstore.errors import CkptError, ConfigError, StorageError, UnsafeObjectError
from ckptstore.ops.writing.async_save import (
    AsyncSaver,
    SaveHandle,
    close_saver,
    save_async,
    saver_for,
)
from ckptstore.records import CheckpointState
from ckptstore.store import CheckpointStore


def make_state(seed: int = 0) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(64, 32, generator=gen)
    return {
        "model": OrderedDict(
            weight=weight,
            bias=torch.randn(32, generator=gen).to(torch.bfloat16),
            mask=torch.rand(10, generator=gen) > 0.5,
            scalar=torch.tensor(3.5),
            empty=torch.empty(0, 4),
            view=weight.t()[:5],  # non-contiguous view
        ),
        "optimizer": {"step": 7, "lr": [0.1, 0.01], "betas": (0.9, 0.999), "name": "adamw"},
        "shape": torch.Size([2, 3]),
        "none": None,
    }


def assert_same(a: Any, b: Any) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor)
        assert a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(a, b)
    elif isinstance(a, dict):
        assert list(a) == list(b)
        for key in a:
            assert_same(a[key], b[key])
    elif isinstance(a, list | tuple) and not isinstance(a, torch.Size):
        assert type(a) is type(b) and len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            assert_same(x, y)
    else:
        assert a == b


def snapshot(state: Any) -> Any:
    """An independent deep copy of a state (reference for comparisons)."""
    if isinstance(state, torch.Tensor):
        return state.detach().clone()
    if isinstance(state, dict):
        return type(state)((k, snapshot(v)) for k, v in state.items())
    if isinstance(state, list):
        return [snapshot(v) for v in state]
    if isinstance(state, tuple) and not isinstance(state, torch.Size):
        return tuple(snapshot(v) for v in state)
    return state


def test_mutation_right_after_submit_does_not_change_what_is_saved(
    store: CheckpointStore,
) -> None:
    state = make_state()
    expected = snapshot(state)
    saver = AsyncSaver(store, staging_budget_bytes=1 << 24)
    handle = saver.submit("mut", 1, state, metrics={"loss": 1.0}, tags=["a"])
    # Change everything the caller can reach, at once.
    with torch.no_grad():
        for tensor in state["model"].values():
            if tensor.numel():
                tensor.fill_(True) if tensor.dtype == torch.bool else tensor.fill_(999)
    state["optimizer"]["lr"].append(5.0)
    state["optimizer"]["step"] = 8
    ck = handle.result(timeout=60)
    assert ck.state == CheckpointState.COMMITTED
    assert (ck.run, ck.step, ck.metrics, ck.tags) == ("mut", 1, {"loss": 1.0}, ("a",))
    assert_same(store.load(ck.id), expected)
    saver.close()


def test_buffers_are_reused_across_saves(store: CheckpointStore) -> None:
    state = make_state()
    saver = AsyncSaver(store, staging_budget_bytes=1 << 24)
    saver.submit("reuse", 1, state).result(timeout=60)
    allocated = saver.pool.allocations
    for step in range(2, 5):
        with torch.no_grad():
            state["model"]["weight"].add_(1.0)
        saver.submit("reuse", step, state).result(timeout=60)
    assert saver.pool.allocations == allocated
    assert saver.pool.in_use_bytes == 0
    loaded = store.load("reuse@latest")
    assert torch.equal(loaded["model"]["weight"], state["model"]["weight"])
    assert [c.step for c in store.list(run="reuse", order_by="step")] == [1, 2, 3, 4]
    saver.close()


def test_tied_tensors_stay_tied(store: CheckpointStore) -> None:
    shared = torch.arange(12.0).reshape(3, 4)
    state = {"a": shared, "b": shared, "c": shared.detach()}  # same object and same view
    saver = AsyncSaver(store, staging_budget_bytes=1 << 20)
    handle = saver.submit("tied", 1, state)
    ck = handle.result(timeout=60)
    assert handle.staged_bytes == shared.numel() * 4  # staged once
    loaded = store.load(ck.id)
    assert loaded["a"] is loaded["b"] is loaded["c"]
    saver.close()


def test_submit_waits_for_budget_until_earlier_save_finishes(store: CheckpointStore) -> None:
    state = {"w": torch.ones(256, 256)}  # 256 KiB; the budget fits exactly one
    gate = threading.Event()
    entered = threading.Event()

    def hold(_: int) -> None:
        # Runs on the background thread while the first save writes its chunks.
        entered.set()
        assert gate.wait(timeout=30)

    saver = AsyncSaver(store, staging_budget_bytes=300 * 1024)
    first = saver.submit("budget", 1, state, progress=hold)
    assert entered.wait(timeout=30)
    second: list[SaveHandle] = []
    thread = threading.Thread(target=lambda: second.append(saver.submit("budget", 2, state)))
    thread.start()
    time.sleep(0.5)
    assert not second, "the second submit must wait while the first save holds the budget"
    assert saver.pool.in_use_bytes == 256 * 256 * 4
    gate.set()
    thread.join(timeout=60)
    assert second and not thread.is_alive()
    assert first.result(timeout=60).step == 1
    assert second[0].result(timeout=60).step == 2
    assert second[0].waited_s > 0.3
    saver.close()


def test_state_larger_than_budget_raises_config_error(store: CheckpointStore) -> None:
    saver = AsyncSaver(store, staging_budget_bytes=1024)
    with pytest.raises(ConfigError, match="staging_budget_bytes"):
        saver.submit("big", 1, {"w": torch.zeros(1024)})
    saver.close()


def break_hot_tier(store: CheckpointStore, run: str) -> None:
    """Put a file where the run's directory goes: every save of ``run`` then fails."""
    run_dir = store.hot / run
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.write_text("not a directory")


def repair_hot_tier(store: CheckpointStore, run: str) -> None:
    (store.hot / run).unlink()


def test_failed_save_surfaces_once_on_next_submit(store: CheckpointStore) -> None:
    saver = AsyncSaver(store, staging_budget_bytes=1 << 24)
    saver.submit("fail", 1, make_state()).result(timeout=60)
    break_hot_tier(store, "fail")
    bad = saver.submit("fail", 2, make_state())
    error = bad.exception(timeout=60)
    assert isinstance(error, StorageError)
    repair_hot_tier(store, "fail")
    with pytest.raises(StorageError) as raised:
        saver.submit("fail", 3, make_state())
    assert raised.value is error
    # Raised once: the next submit goes through.
    assert saver.submit("fail", 3, make_state()).result(timeout=60).step == 3
    # The failed save was never committed.
    committed = [c.step for c in store.list(run="fail", order_by="step")]
    assert committed == [1, 3]
    states = {c.step: c.state for c in store.list(run="fail", state=None)}
    assert states[2] == CheckpointState.FAILED
    with pytest.raises(CkptError):
        store.load("fail@2")
    saver.close()


def test_failed_save_surfaces_once_on_wait(store: CheckpointStore) -> None:
    saver = AsyncSaver(store, staging_budget_bytes=1 << 24)
    break_hot_tier(store, "failwait")
    handle = saver.submit("failwait", 1, {"w": torch.ones(4)})
    with pytest.raises(StorageError, match="failwait"):
        saver.wait()
    saver.wait()  # reported already: no second raise
    assert handle.done() and isinstance(handle.exception(), StorageError)
    with pytest.raises(StorageError):
        handle.result()
    # Buffers of the failed save went back to the pool.
    assert saver.pool.in_use_bytes == 0
    saver.close()


def test_on_commit_runs_before_the_handle_completes(store: CheckpointStore) -> None:
    seen: list[str] = []
    saver = AsyncSaver(store, staging_budget_bytes=1 << 20)
    handle = saver.submit("hook", 1, {"w": torch.ones(4)}, on_commit=lambda ck: seen.append(ck.ref))
    assert handle.result(timeout=60).ref == "hook@v1"
    assert seen == ["hook@v1"]
    # A failing hook is logged, the save still counts.
    handle = saver.submit("hook", 2, {"w": torch.ones(4)}, on_commit=lambda ck: 1 / 0)
    assert handle.result(timeout=60).step == 2
    saver.close()


def test_close_waits_for_pending_and_refuses_new_saves(store: CheckpointStore) -> None:
    saver = AsyncSaver(store, staging_budget_bytes=1 << 24)
    handles = [saver.submit("close", step, make_state(step)) for step in range(1, 4)]
    saver.close()
    assert all(h.done() for h in handles)
    assert [c.step for c in store.list(run="close", order_by="step")] == [1, 2, 3]
    with pytest.raises(CkptError, match="closed"):
        saver.submit("close", 4, make_state())


def test_store_helpers_share_one_saver(store: CheckpointStore) -> None:
    first = save_async(store, "helper", 1, {"w": torch.ones(3)})
    saver = saver_for(store)
    assert saver is saver_for(store)
    assert saver.pool.budget_bytes == store.settings.staging_budget_bytes
    second = save_async(store, "helper", 2, {"w": torch.ones(3)})
    close_saver(store)
    assert first.done() and second.done()
    assert saver.closed and saver_for(store) is not saver


def test_refused_object_raises_at_submit_like_a_sync_save(store: CheckpointStore) -> None:
    saver = AsyncSaver(store, staging_budget_bytes=1 << 20)
    with pytest.raises(UnsafeObjectError, match="bad"):
        saver.submit("unsafe", 1, {"w": torch.ones(2), "bad": {1, 2}})
    assert saver.pool.in_use_bytes == 0 and saver.pending() == 0
    saver.wait()  # nothing was queued, nothing to report
    saver.close()
    assert store.list(run="unsafe", state=None) == []


def test_background_thread_runs_at_lower_priority(store: CheckpointStore) -> None:
    import os
    import sys

    seen: list[int] = []
    saver = AsyncSaver(store, staging_budget_bytes=1 << 20, nice=7)
    base = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    saver.submit(
        "nice", 1, {"w": torch.ones(2)},
        on_commit=lambda ck: seen.append(
            os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
        ),
    ).result(timeout=60)
    saver.close()
    if sys.platform.startswith("linux"):
        assert seen == [min(19, base + 7)]
    # The caller's own priority is untouched.
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == base


@pytest.mark.parametrize("bad", [-1, True, 1.5])
def test_nice_must_be_non_negative_int(store: CheckpointStore, bad: object) -> None:
    with pytest.raises(ConfigError, match="nice"):
        AsyncSaver(store, staging_budget_bytes=1024, nice=bad)  # type: ignore[arg-type]


def test_saver_calls_from_on_commit_are_refused(store: CheckpointStore) -> None:
    errors: list[BaseException] = []
    saver = AsyncSaver(store, staging_budget_bytes=1 << 20)

    def reenter(_: object) -> None:
        for call in (saver.wait, saver.close, lambda: saver.submit("x", 2, {})):
            try:
                call()
            except CkptError as exc:
                errors.append(exc)

    saver.submit("reenter", 1, {"w": torch.ones(1)}, on_commit=reenter).result(timeout=60)
    saver.close()
    assert len(errors) == 3 and all("on_commit" in str(e) for e in errors)
