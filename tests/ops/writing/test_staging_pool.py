"""StagingPool accounting: reuse, budget waits, eviction, bounds (no store involved)."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from ckptstore.errors import CkptError, ConfigError
from ckptstore.ops.writing.staging import BufferKey, StagingPool

F32 = torch.float32


def key(name: str, n: int, dtype: torch.dtype = F32) -> BufferKey:
    return (name, (n,), dtype, False)


def test_buffers_are_reused_by_key() -> None:
    pool = StagingPool(10_000)
    keys = [key("a", 100), key("b", 50)]
    first = pool.acquire(keys)
    assert [b.shape for b in first] == [torch.Size([100]), torch.Size([50])]
    assert pool.in_use_bytes == 600
    pool.release(keys, first)
    assert (pool.in_use_bytes, pool.idle_bytes) == (0, 600)
    second = pool.acquire(keys)
    assert all(a.data_ptr() == b.data_ptr() for a, b in zip(first, second, strict=True))
    assert pool.allocations == 2


def test_same_key_twice_in_flight_gets_two_buffers() -> None:
    pool = StagingPool(10_000)
    keys = [key("a", 10)]
    one = pool.acquire(keys)
    two = pool.acquire(keys)
    assert one[0].data_ptr() != two[0].data_ptr()
    pool.release(keys, one)
    pool.release(keys, two)
    assert pool.idle_bytes == 80


def test_state_larger_than_budget_is_refused() -> None:
    pool = StagingPool(100)
    with pytest.raises(ConfigError, match="raise staging_budget_bytes"):
        pool.acquire([key("a", 26)])  # 104 bytes


def test_acquire_waits_until_release() -> None:
    pool = StagingPool(500)
    keys = [key("a", 100)]  # 400 bytes: only one set fits
    held = pool.acquire(keys)
    got: list[float] = []

    def second() -> None:
        pool.acquire(keys)
        got.append(time.monotonic())

    thread = threading.Thread(target=second)
    thread.start()
    time.sleep(0.3)
    assert not got, "the second acquire must wait while the budget is in use"
    released = time.monotonic()
    pool.release(keys, held)
    thread.join(timeout=10)
    assert got and got[0] >= released


def test_should_stop_ends_the_wait() -> None:
    pool = StagingPool(500)
    pool.acquire([key("a", 100)])
    stop = threading.Event()
    errors: list[BaseException] = []

    def waiter() -> None:
        try:
            pool.acquire([key("b", 100)], should_stop=stop.is_set)
        except CkptError as exc:
            errors.append(exc)

    thread = threading.Thread(target=waiter)
    thread.start()
    stop.set()
    thread.join(timeout=10)
    assert errors and "closed" in str(errors[0])


def test_idle_buffers_are_evicted_to_stay_in_budget() -> None:
    pool = StagingPool(1_000)
    old = [key("old", 200)]  # 800 bytes
    pool.release(old, pool.acquire(old))
    assert pool.idle_bytes == 800
    new = [key("new", 100)]  # 400 bytes: only fits if the old idle buffer goes
    bufs = pool.acquire(new)
    assert pool.in_use_bytes + pool.idle_bytes <= 1_000
    assert pool.idle_bytes == 0
    pool.release(new, bufs)
    assert pool.idle_bytes == 400


def test_bytes_account_for_dtype_width() -> None:
    pool = StagingPool(10_000)
    keys = [key("h", 10, torch.bfloat16), key("c", 10, torch.complex64), key("b", 10, torch.bool)]
    pool.acquire(keys)
    assert pool.in_use_bytes == 20 + 80 + 10


@pytest.mark.parametrize("bad", [0, -5, True, 1.5])
def test_budget_must_be_positive_int(bad: object) -> None:
    with pytest.raises(ConfigError):
        StagingPool(bad)  # type: ignore[arg-type]
