"""The assignment of shared remote reads (pure: the same answer on every rank)."""

from __future__ import annotations

import random

from ckptstore.ops.dcp.share import LOCAL_COST, assign


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
