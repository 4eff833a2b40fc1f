"""The assignment of shared remote reads (pure: the same answer on every rank), and the
reads that start as the shared files come in."""

from __future__ import annotations

import random
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from ckptstore.errors import IncompleteCheckpointError, IntegrityError
from ckptstore.format.dcp.requests import ReadJob
from ckptstore.ops.dcp.share import LOCAL_COST, Arrivals, assign


def test_every_needed_file_goes_to_exactly_one_rank() -> None:
    needs = [{"a": 8, "b": 8}, {"b": 8, "c": 4}, {}]
    plan = assign(needs, [0, 0, 0])
    assert set(plan) == {"a", "b", "c"} and set(plan.values()) <= {0, 1, 2}


def test_a_lost_part_is_split_evenly_among_idle_ranks() -> None:
    # Rank 1 (the replacement node) needs 8 files of 8 MiB; ranks 0 and 2 need nothing.
    mib = 1 << 20
    needs = [{}, {f"r1/c/{i}": 8 * mib for i in range(8)}, {}]
    plan = assign(needs, [0, 0, 0])
    load = [sum(8 * mib for r in plan.values() if r == k) for k in range(3)]
    assert max(load) - min(load) <= 8 * mib
    assert load[1] >= max(load[0], load[2])  # ties go to the rank that needs the file


def test_local_reads_count_against_a_rank() -> None:
    # Rank 0 reads 40 bytes from its disk (worth 20 downloaded): it gets less to fetch.
    needs = [{}, {f"f{i}": 10 for i in range(6)}]
    plan = assign(needs, [40, 0])
    fetched_by_0 = sum(10 for r in plan.values() if r == 0)
    assert LOCAL_COST * 40 + fetched_by_0 <= sum(10 for r in plan.values() if r == 1) + 10


def test_same_answer_whatever_the_order_of_the_needs() -> None:
    rng = random.Random(0)
    files = {f"r{k}/c/{i}": rng.randrange(1, 100) for k in range(3) for i in range(20)}
    needs = [{f: n for f, n in files.items() if f.startswith(f"r{k}/")} for k in range(3)]
    shuffled = [dict(sorted(d.items(), key=lambda _: rng.random())) for d in needs]
    assert assign(needs, [5, 0, 7]) == assign(shuffled, [5, 0, 7])


def test_nothing_remote_nothing_assigned() -> None:
    assert assign([{}, {}], [100, 100]) == {}


def test_a_file_a_survivor_keeps_is_read_there_never_downloaded() -> None:
    # Node B (rank 1) was replaced; rank 0 keeps a copy of its part (replicas = 2) and
    # reads much from its own disk, yet sends every file rather than anyone downloading.
    mib = 1 << 20
    files = {f"r1/c/{i}": 8 * mib for i in range(8)}
    plan = assign([{}, files], [64 * mib, 0], [set(files), set()])
    assert plan == dict.fromkeys(files, 0)


def test_held_files_are_spread_over_their_holders_and_the_rest_downloaded() -> None:
    needs = [{}, {}, {"a": 10, "b": 10, "c": 10, "d": 10, "x": 10}]
    plan = assign(needs, [0, 0, 0], [{"a", "b", "c", "d"}, {"a", "b", "c", "d"}, set()])
    assert sorted(plan[f] for f in "abcd") == [0, 0, 1, 1]
    # Nobody holds "x": downloaded by the rank with the least work, which is rank 2 (it
    # read nothing, was given nothing, and needs the file).
    assert plan["x"] == 2


def test_held_files_nobody_needs_are_ignored() -> None:
    assert assign([{"a": 1}, {}], [0, 0], [set(), {"a", "zzz"}]) == {"a": 1}


def test_ranks_that_need_as_much_as_each_other_download_their_own_files() -> None:
    # A full restore from object storage: moving a file to another rank only adds a send.
    # Chunk files mostly have one size, and one rank's files sort before the other's.
    for size in (lambda i: 8 + i, lambda i: 8):
        needs = [{f"r{k}/c/{i:02d}": size(i) for i in range(40)} for k in range(3)]
        plan = assign(needs, [0, 0, 0])
        assert all(plan[rel] == int(rel[1]) for rel in plan)


def test_only_ranks_that_reach_a_copy_download_it() -> None:
    # Rank 0 reads much from its disk but cannot reach object storage: rank 1 downloads
    # everything, also the file rank 0 needs.
    needs = [{"x": 10}, {f"f{i}": 10 for i in range(4)}]
    plan = assign(needs, [0, 1000], reach=[set(), {"x", "f0", "f1", "f2", "f3"}])
    assert set(plan.values()) == {1}
    # Nobody reaches "y": nobody fetches it (the read that needs it fails, naming it).
    assert assign([{}, {"y": 5}], [0, 0], reach=[set(), set()]) == {}


def _job(log: list[str], name: str, fail: list[BaseException] | None = None,
         done: threading.Event | None = None) -> ReadJob:
    def run() -> None:
        if fail:
            raise fail.pop(0)
        log.append(name)
        if done is not None:
            done.set()
    return ReadJob(run, Path(name), ())


def test_a_read_starts_once_every_file_it_needs_is_in() -> None:
    log: list[str] = []
    c_ran = threading.Event()
    with ThreadPoolExecutor(2) as pool:
        arrivals = Arrivals([(_job(log, "ab"), {"a", "b"}), (_job(log, "c", done=c_ran), {"c"})],
                            pool)
        arrivals.arrived("a")
        arrivals.arrived("zzz")  # a file no read waits for
        arrivals.arrived("c")
        assert c_ran.wait(30)
        assert log == ["c"]  # "ab" still waits for "b"
        arrivals.arrived("b")
        arrivals.settle(threads=1)
    assert sorted(log) == ["ab", "c"]


def test_settle_runs_again_what_failed_on_a_placeholder_and_what_never_came() -> None:
    # "x" failed on the zeros sent for a fetch that failed; "y"'s file never came.
    log: list[str] = []
    placeholder: list[BaseException] = [IncompleteCheckpointError("zeros, not the file")]
    with ThreadPoolExecutor(2) as pool:
        arrivals = Arrivals([(_job(log, "x", placeholder), {"x"}), (_job(log, "y"), {"y"})],
                            pool)
        arrivals.arrived("x")
        arrivals.settle(threads=1)
    assert sorted(log) == ["x", "y"]


def test_settle_raises_what_a_read_raises_once_the_share_is_over() -> None:
    log: list[str] = []
    failures: list[BaseException] = [IntegrityError("early"), IntegrityError("for good")]
    with ThreadPoolExecutor(2) as pool:
        arrivals = Arrivals([(_job(log, "x", failures), {"x"})], pool)
        arrivals.arrived("x")
        with pytest.raises(IntegrityError, match="for good"):
            arrivals.settle(threads=1)
