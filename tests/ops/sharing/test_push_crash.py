"""A push killed (SIGKILL, src/ckptstore/faultpoints.py) at each of its phase boundaries
leaves nothing visible at the destination, and rerunning it completes the push.

Each pusher is its own process, killed by its fault point: a child of a forkserver that
preloaded torch and ckptstore (tests/ops/sharing/push_worker.py), so that a pusher does not
pay seconds of imports before it gets to the push, as a fresh interpreter would.
"""

from __future__ import annotations

import multiprocessing
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from process_support import add_test_dir, preloaded_children

from ckptstore.errors import CheckpointNotFoundError, IncompleteCheckpointError
from ckptstore.ops.sharing.push import push_checkpoints
from ckptstore.records import CheckpointState

HERE = Path(__file__).parent
add_test_dir(HERE)  # before importing its helper scripts; the children get it too

import push_worker  # noqa: E402

pytestmark = [pytest.mark.postgres, pytest.mark.s3]

# Before the commit: nothing may be visible afterwards. After it: the rerun finishes the rest.
BEFORE_COMMIT = ["push.begun", "push.foreign_copied", "push.copied", "push.verified"]
#: Installed packages only: the server does not get this directory on its path (the children
#: do, and import push_worker.py themselves).
_PRELOAD = ["torch", "sqlalchemy", "ckptstore.core", "ckptstore.ops.sharing.push"]


@pytest.fixture(scope="module")
def pushers() -> Iterator[multiprocessing.context.BaseContext]:
    """Where the pushers start: a forkserver with torch and ckptstore imported, stopped with
    the module. When another module's forkserver runs already (without this directory on its
    path), spawned children instead: slower, always right."""
    yield from preloaded_children(_PRELOAD)


@pytest.fixture
def killed(pushers: multiprocessing.context.BaseContext, stores: Any) -> Any:
    """``killed(ref, point, self_contained=False)``: push ``ref`` from a to b in a child
    process that the fault point ``point`` kills (SIGKILL)."""

    def push_killed_at(ref: str, point: str, self_contained: bool = False) -> None:
        child = pushers.Process(  # type: ignore[attr-defined]
            target=push_worker.push_killed,
            args=(str(stores.a_config), str(stores.b_config), ref, point, self_contained))
        child.start()
        child.join(120)
        if child.is_alive():
            child.kill()
            child.join()
        assert child.exitcode == -signal.SIGKILL, child.exitcode

    return push_killed_at


@pytest.mark.parametrize("point", BEFORE_COMMIT)
def test_kill_before_commit_then_rerun_completes(stores: Any, kit: Any, killed: Any,
                                                 point: str) -> None:
    a, b = stores.a, stores.b
    s1 = kit.state(20)
    base = a.save("crash", 1, s1)
    push_checkpoints(a, b, [base.id], remote="b")
    tuned = a.save("crash", 2, kit.tweaked(s1))
    killed(tuned.id, point)
    # Not visible: no listing, no reference resolves to it, only a PENDING row.
    assert [ck.id for ck in b.list(run="crash")] == [base.id]
    assert b.get("crash@latest").id == base.id
    with pytest.raises(IncompleteCheckpointError):
        b.get(tuned.id)
    assert b.catalog.get_any(tuned.id).state == CheckpointState.PENDING
    # The rerun takes the dead pusher's lease over, keeps what matches, and commits.
    report = push_checkpoints(a, b, [tuned.id], remote="b")
    assert report.pushed == [tuned.id]
    assert kit.same(b.load(tuned.id), kit.tweaked(s1))
    assert b.verify(tuned.id) == []
    assert [e.kind for e in b.events(tuned.id)].count("received") == 1


def test_kill_after_commit_then_rerun_records_the_rest(stores: Any, kit: Any,
                                                      killed: Any) -> None:
    a, b = stores.a, stores.b
    parent = a.save("after", 1, kit.state(21))
    child = a.save("after", 2, kit.state(22), parent=parent.id, delta=False)
    a.catalog.add_edge(parent.id, child.id, "fine-tuned-from")
    push_checkpoints(a, b, [parent.id], remote="b")
    killed(child.id, "push.committed")
    assert b.get(child.id).state == CheckpointState.COMMITTED
    assert b.catalog.edges(child.id) == []  # killed before the lineage was recorded
    report = push_checkpoints(a, b, [child.id], remote="b")
    assert report.present == [child.id] and report.bytes_sent == 0
    assert (parent.id, child.id, "fine-tuned-from") in b.catalog.edges(child.id)
    assert [e.kind for e in b.events(child.id)].count("received") == 1
    assert kit.same(b.load(child.id), kit.state(22))


def test_kill_during_a_self_contained_push_of_a_delta(stores: Any, kit: Any,
                                                     killed: Any) -> None:
    a, b = stores.a, stores.b
    s1 = kit.state(23)
    a.save("scx", 1, s1, delta="xor")
    x2 = a.save("scx", 2, kit.tweaked(s1), delta="xor")
    killed(x2.id, "push.copied", self_contained=True)
    with pytest.raises(CheckpointNotFoundError):
        b.get("scx@latest")
    report = push_checkpoints(a, b, [x2.id], remote="b", self_contained=True)
    assert report.pushed == [x2.id]
    assert kit.same(b.load(x2.id), kit.tweaked(s1))


def test_gc_of_a_killed_push_then_rerun(stores: Any, kit: Any, killed: Any) -> None:
    a, b = stores.a, stores.b
    ck = a.save("gcd", 1, kit.state(24))
    killed(ck.id, "push.copied")
    b.gc()  # the pusher is dead: its PENDING row becomes FAILED
    assert b.catalog.get_any(ck.id).state == CheckpointState.FAILED
    report = push_checkpoints(a, b, [ck.id], remote="b")
    assert report.pushed == [ck.id]
    assert kit.same(b.load(ck.id), kit.state(24))
