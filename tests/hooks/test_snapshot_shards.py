"""Sharded (DTensor) states in snapshots: the overlap computation (pure), the refusal of
layouts not supported, and a real job resumed at another world size (gloo on CPU).

Each rank of the real jobs is a process of its own: a child of a forkserver that preloaded
torch.distributed and ckptstore (tests/hooks/shard_trainer.py's ``rank_in_child``), so that a
rank does not pay seconds of imports as a fresh interpreter would.
"""

from __future__ import annotations

import multiprocessing
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from process_support import add_test_dir, finish_child, preloaded_children

from ckptstore.errors import ConfigError, IntegrityError
from ckptstore.ops.writing.snapshot import HEADER_BYTES, parse_header, snapshot_dir
from ckptstore.ops.writing.snapshot_shards import (
    MeshLayout,
    ShardSpec,
    box_overlaps,
    chunk_rows,
    shard_boxes,
    specs_from_meta,
)
from ckptstore.ops.writing.snapshot_world import Held, HostInventory, agree_sharded_step
from ckptstore.store import CheckpointStore
from ckptstore.testing.ports import free_port

HERE = Path(__file__).parent
add_test_dir(HERE)  # before importing its helper scripts; the children get it too

import shard_trainer  # noqa: E402

TIMEOUT_S = 90
#: Installed packages only: the children import shard_trainer.py themselves. Besides the
#: trainer's imports, what a rank would import later on its own (listed from a rank's
#: sys.modules): torch._dynamo, torch._inductor and torch.onnx, alembic's command module
#: (creating the catalog), the migrations and the metrics module.
_PRELOAD = ["torch", "torch.distributed", "torch.distributed.device_mesh",
            "torch.distributed.tensor", "torch._dynamo", "torch._inductor", "torch.onnx",
            "alembic", "alembic.command", "alembic.config", "ckptstore.hooks.manager",
            "ckptstore.store", "ckptstore.migrations", "ckptstore.observability.prom"]


@pytest.fixture(scope="module")
def ranks() -> Iterator[multiprocessing.context.BaseContext]:
    """Where the ranks start: a forkserver with torch and ckptstore imported, stopped with
    the module. When another module's forkserver runs already, spawned children instead:
    slower, always right."""
    yield from preloaded_children(_PRELOAD)


# ---------------------------------------------------------------- the overlaps (pure)
@pytest.mark.parametrize(("dim0", "parts", "want"), [
    (7, 2, [(0, 4), (4, 3)]),
    (7, 3, [(0, 3), (3, 3), (6, 1)]),
    (2, 3, [(0, 1), (1, 1), (2, 0)]),        # fewer rows than shards: the last is empty
    (9, 4, [(0, 3), (3, 3), (6, 3), (9, 0)]),  # torch.chunk leaves an empty last chunk
    (0, 2, [(0, 0), (0, 0)]),
    (5, 1, [(0, 5)]),
])
def test_shards_split_rows_as_torch_chunk(dim0: int, parts: int,
                                          want: list[tuple[int, int]]) -> None:
    assert chunk_rows(dim0, parts) == want
    # As torch.chunk (which returns fewer chunks when they would be empty).
    sizes = [len(c) for c in torch.arange(dim0).chunk(parts)] if dim0 else []
    assert [rows for _, rows in want][: len(sizes)] == sizes
    assert all(rows == 0 for _, rows in want[len(sizes):])


def _rows(dim0: int, parts: int) -> dict[int, tuple[tuple[int, ...], tuple[int, ...]]]:
    return {rank: ((start,), (rows,)) for rank, (start, rows) in
            enumerate(chunk_rows(dim0, parts))}


def test_overlaps_of_uneven_shards_cover_each_new_shard_exactly() -> None:
    old = _rows(7, 2)  # [0, 4) and [4, 7)
    new = _rows(7, 3)  # [0, 3), [3, 6), [6, 7)
    assert box_overlaps(new[0], old) == [(0, (slice(0, 3),), (slice(0, 3),))]
    assert box_overlaps(new[1], old) == [(0, (slice(3, 4),), (slice(0, 1),)),
                                         (1, (slice(0, 2),), (slice(1, 3),))]
    assert box_overlaps(new[2], old) == [(1, (slice(2, 3),), (slice(0, 1),))]
    assert box_overlaps(((7,), (0,)), old) == []  # an empty new shard needs nothing
    # Every split of every size into every other is rebuilt row for row.
    for dim0 in range(0, 12):
        full = torch.arange(dim0)
        for before in range(1, 6):
            olds = _rows(dim0, before)
            pieces = {r: full[o[0]: o[0] + n[0]] for r, (o, n) in olds.items()}
            for after in range(1, 6):
                for box in _rows(dim0, after).values():
                    got = torch.full(box[1], -1)
                    for rank, src, dst in box_overlaps(box, olds):
                        got[dst] = pieces[rank][src]
                    assert torch.equal(got, full[box[0][0]: box[0][0] + box[1][0]])


def test_shard_records_round_trip_and_malformed_ones_are_refused() -> None:
    spec = ShardSpec((7, 3), (4, 0), (3, 3))
    assert specs_from_meta({"shards": {"a": spec.to_json()}}) == {"a": spec}
    assert specs_from_meta({}) == {}
    from ckptstore.errors import IntegrityError

    with pytest.raises(IntegrityError):
        specs_from_meta({"shards": {"a": {"global": [7]}}})


@pytest.mark.parametrize(("shape", "layout", "want"), [
    # 2x2 mesh, rows over the first mesh dimension, columns over the second.
    ((7, 5), MeshLayout((2, 2), (0, 1, 2, 3), (0, 1)),
     {0: ((0, 0), (4, 3)), 1: ((0, 3), (4, 2)), 2: ((4, 0), (3, 3)), 3: ((4, 3), (3, 2))}),
    # The same dimension twice: split by the first mesh dimension, each piece by the second.
    ((7,), MeshLayout((2, 2), (0, 1, 2, 3), (0, 0)),
     {0: ((0,), (2,)), 1: ((2,), (2,)), 2: ((4,), (2,)), 3: ((6,), (1,))}),
    # Replicated along the first mesh dimension; ranks placed on the mesh out of order.
    ((4, 6), MeshLayout((2, 2), (3, 2, 1, 0), (None, 1)),
     {3: ((0, 0), (4, 3)), 2: ((0, 3), (4, 3)), 1: ((0, 0), (4, 3)), 0: ((0, 3), (4, 3))}),
    # Shard(1) over one dimension, fewer columns than ranks: the last box is empty.
    ((3, 2), MeshLayout((3,), (0, 1, 2), (1,)),
     {0: ((0, 0), (3, 1)), 1: ((0, 1), (3, 1)), 2: ((0, 2), (3, 0))}),
    # A 0-dim tensor replicated everywhere.
    ((), MeshLayout((2,), (0, 1), (None,)), {0: ((), ()), 1: ((), ())}),
])
def test_shard_boxes_place_shards_as_dtensor(shape: tuple[int, ...], layout: MeshLayout,
                                             want: dict[int, tuple[tuple[int, ...], ...]]
                                             ) -> None:
    assert shard_boxes(shape, layout) == want
    assert MeshLayout.from_json(layout.to_json()) == layout


def test_box_overlaps_cover_a_new_box_once_from_distinct_old_boxes() -> None:
    full = torch.arange(7 * 5).reshape(7, 5)
    # Old: 2x2 mesh with rows replicated over the first mesh dimension (ranks 0/2 and 1/3
    # hold the same boxes); new: Shard(0) over 3 ranks.
    old = shard_boxes((7, 5), MeshLayout((2, 2), (0, 1, 2, 3), (None, 1)))
    for new_rank, ((r0,), (rows,)) in enumerate(
            [((0,), (3,)), ((3,), (3,)), ((6,), (1,))]):
        box = ((r0, 0), (rows, 5))
        parts = box_overlaps(box, old)
        assert [rank for rank, *_ in parts] == [0, 1], new_rank  # never 2 or 3 again
        local = torch.full((rows, 5), -1)
        for rank, src, dst in parts:
            (o0, o1), (n0, n1) = old[rank]
            local[dst] = full[o0:o0 + n0, o1:o1 + n1][src]
        assert torch.equal(local, full[r0:r0 + rows])
    assert box_overlaps(((0, 0), (7, 5)), {0: ((0, 0), (0, 5))}) == []  # empty old box


def test_a_shard_record_without_a_layout_is_read_as_one_dimensional() -> None:
    # Snapshots written before layouts were recorded: Shard(0) over the ranks that wrote it.
    spec = ShardSpec.from_json({"global": [7, 3], "offsets": [4, 0], "sizes": [3, 3]})
    assert spec.layout is None and MeshLayout.one_d(2) == MeshLayout((2,), (0, 1), (0,))
    with pytest.raises(IntegrityError):
        ShardSpec.from_json({"global": [7], "offsets": [0], "sizes": [7], "mesh": [2],
                             "ranks": [0, 0], "placements": [0]})


def _held(rank: int, seq: int, step: int, replica: bool = False) -> Held:
    return Held(rank, seq, step, replica, f"slot{seq}.snap")


def test_a_step_is_eligible_only_with_every_old_shard_readable() -> None:
    # Old world of 2: node a holds rank 0 (steps 4, 5) and rank 1's replica of 5; node b
    # holds rank 1 (4, 5). A third, empty node joins.
    a = HostInventory("a", ("a", 1), (_held(0, 8, 4), _held(0, 10, 5), _held(1, 10, 5, True)),
                      None)
    b = HostInventory("b", ("b", 1), (_held(1, 8, 4), _held(1, 10, 5)), None)
    c = HostInventory("c", ("c", 1), (), None)
    assert agree_sharded_step([a, b, c]) == (5, 2)
    assert agree_sharded_step([a, b, c], exclude=[5]) == (4, 2)
    # Without b's server, c cannot read rank 1's step 4 (a holds only its step 5 replica).
    b_alone = HostInventory("b", None, b.held, None)
    assert agree_sharded_step([a, b_alone, c]) == (5, 2)
    assert agree_sharded_step([a, b_alone, c], exclude=[5]) is None
    # A hole: old rank 1's step 6 is nowhere (ranks 0 and 2 hold theirs), so 6 is not
    # eligible and 5 is chosen.
    d = HostInventory("d", ("d", 1), (_held(0, 12, 6), _held(2, 12, 6)), None)
    assert agree_sharded_step([a, b, d]) == (5, 2)
    # Old world of 3 at step 6 once rank 1's is there too.
    e = HostInventory("e", ("e", 1), (_held(1, 12, 6),), None)
    assert agree_sharded_step([a, b, d, e]) == (6, 3)


# ---------------------------------------------------------------- refusals
def _solo(tmp_path: Path) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0,
                            world_size=1)


@pytest.mark.parametrize("layout", ["partial", "strided"])
def test_unsupported_layouts_are_refused_with_a_config_error(tmp_path: Path,
                                                             layout: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial
    from torch.distributed.tensor.placement_types import _StridedShard

    from ckptstore.hooks.manager import CheckpointManager

    _solo(tmp_path)
    try:
        mesh = init_device_mesh("cpu", (1,))
        placement = Partial() if layout == "partial" else _StridedShard(0, split_factor=2)
        tensor = DTensor.from_local(torch.ones(4, 2), mesh, [placement], run_check=False)
        with CheckpointStore.open(tmp_path / "store") as store:
            mgr = CheckpointManager(store, "r", snapshot_interval=1, handle_sigterm=False,
                                    history=False, distributed=False)
            try:
                with pytest.raises(ConfigError, match=r"Shard\(d\) and Replicate"):
                    mgr.step(1, lambda: {"w": tensor})
                assert mgr.snapshots is not None and not list(
                    mgr.snapshots.directory.glob("slot*.snap"))  # nothing written
            finally:
                mgr.close()
    finally:
        dist.destroy_process_group()


def test_a_snapshot_records_each_shard_and_a_sharded_durable_save_is_refused(
        tmp_path: Path, snap_store: CheckpointStore) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from ckptstore.hooks.manager import CheckpointManager
    from ckptstore.ops.writing.snapshot import newest_snapshot, read_snapshot_flat

    _solo(tmp_path)
    try:
        mesh = init_device_mesh("cpu", (1,))
        weight = distribute_tensor(torch.arange(6.0).reshape(3, 2), mesh, [Shard(0)])
        state = {"w": weight, "n": torch.ones(2), "step": 1}
        # Snapshots outlive the store on purpose (in /dev/shm by default): snap_store's go
        # to the test's own directory, removed with it.
        store = snap_store
        with CheckpointManager(store, "r", snapshot_interval=1, handle_sigterm=False,
                               history=False, distributed=False) as mgr:
            mgr.step(1, lambda: state)
            assert mgr.snapshots is not None
            mgr.snapshots.flush()
            found = newest_snapshot(store, "r")
            assert found is not None
            flat, info = read_snapshot_flat(found)
            # The local shard's bytes, and where it sits in the global tensor.
            assert torch.equal(flat.tensors["w"], weight.to_local())
            assert info["world"] == 1
            assert specs_from_meta(info) == {"w": ShardSpec(
                (3, 2), (0, 0), (3, 2), MeshLayout((1,), (0,), (0,)))}
        with CheckpointManager(store, "s", snapshot_interval=1, save_interval=2,
                               handle_sigterm=False, history=False,
                               distributed=False) as mgr:
            mgr.step(1, lambda: state)  # a snapshot alone: fine
            with pytest.raises(ConfigError, match="durable save of a sharded"):
                mgr.step(2, lambda: state)
    finally:
        dist.destroy_process_group()


def test_a_snapshot_keeps_no_device_mesh_alive(tmp_path: Path) -> None:
    # A mesh held past the snapshot would keep its process groups, and gloo's threads,
    # alive after destroy_process_group() (they abort a process at exit now and then).
    import gc
    import weakref

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from ckptstore.ops.writing.snapshot_shards import flatten_sharded

    _solo(tmp_path)
    try:
        mesh = init_device_mesh("cpu", (1,))
        weight = distribute_tensor(torch.ones(3, 2), mesh, [Shard(0)])
        flat, specs = flatten_sharded({"w": weight})
        assert specs["w"].layout == MeshLayout((1,), (0,), (0,))
        held = weakref.ref(mesh)
        del weight, mesh, flat, specs
        gc.collect()
        assert held() is None
    finally:
        dist.destroy_process_group()


# ---------------------------------------------------------------- real ranks (gloo)
def _launch(ctx: multiprocessing.context.BaseContext, tmp_path: Path, shm_root: Path,
            last: int, out: Path, nranks: int, **extra: str) -> list[int]:
    """``nranks`` ranks, each a node of its own with its own shared memory; wait (bounded:
    a rank still running after ``TIMEOUT_S`` is killed, and its exit code is -SIGKILL)."""
    port = free_port()
    procs = []
    for rank in range(nranks):
        env = dict(
            OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo", MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(nranks), LOCAL_RANK="0",
            LOCAL_WORLD_SIZE="1", GROUP_RANK=str(rank), CKPT_HOST=f"node{rank}",
            CKPT_ROOT=str(tmp_path / "store"), CKPT_MEMORY_TIER_DIR=str(shm_root / f"n{rank}"),
            **extra)
        proc = ctx.Process(  # type: ignore[attr-defined]
            target=shard_trainer.rank_in_child,
            args=(["r", str(last), str(out)], env,
                  ["CKPT_CONFIG", "CKPT_FAULT_POINT", "CKPT_REPLICAS"],
                  str(out / f"proc{nranks}_{rank}.out")))
        proc.start()
        procs.append(proc)
    try:
        return [finish_child(p, TIMEOUT_S) for p in procs]
    finally:
        for p in procs:
            finish_child(p, 0)


def _new_job(tmp_path: Path) -> Path:
    """Create run ``r`` in the job's store; return the directory the ranks report to."""
    with CheckpointStore.open(tmp_path / "store") as store:
        store.run("r")
    out = tmp_path / "out"
    out.mkdir()
    return out


def _tails(out: Path) -> str:
    return "\n".join(p.read_text()[-2500:] for p in sorted(out.glob("proc*.out")))


def _check_shards(out: Path, world: int, step: int, one_d: bool = True) -> None:
    full = torch.load(out / f"full{step}.pt")
    for rank in range(world):
        got = torch.load(out / f"resumed{world}_rank{rank}.pt")
        assert got["step"] == step
        for key, (offsets, local) in got["shards"].items():
            if one_d:
                start, rows = chunk_rows(full[key].shape[0], world)[rank]
                assert offsets[0] == start and local.shape[0] == rows
            box = tuple(slice(o, o + n) for o, n in zip(offsets, local.shape, strict=True))
            # Bit for bit the first run's tensor at that step.
            assert torch.equal(local, full[key][box]), (key, rank)


def _damage_newest(tmp_path: Path, shm_root: Path, rank: int, step: int) -> None:
    """Flip the first byte of the first tensor of ``rank``'s newest own slot on its node."""
    with CheckpointStore.open(tmp_path / "store",
                              memory_tier_dir=str(shm_root / f"n{rank}")) as store:
        slots = {p: parse_header(p.read_bytes()[:HEADER_BYTES])
                 for p in snapshot_dir(store, "r", rank).glob("slot*.snap")}
    newest = max((p for p in slots if slots[p]), key=lambda p: slots[p][0])  # type: ignore[index]
    header = slots[newest]
    assert header is not None and header[1] == step
    with open(newest, "r+b") as fh:
        fh.seek(header[3])
        first = fh.read(1)
        fh.seek(header[3])
        fh.write(bytes([first[0] ^ 0xFF]))


@pytest.mark.slow
def test_a_sharded_state_resumes_at_another_world_size(
        tmp_path: Path, shm_root: Path, ranks: multiprocessing.context.BaseContext) -> None:
    out = _new_job(tmp_path)
    assert _launch(ranks, tmp_path, shm_root, 4, out, 2, WORLD_REPLICAS="2") == [0, 0], \
        _tails(out)
    # Damage old rank 1's step 4 in node 1's own slot (its replica on node 0 is intact): the
    # rank reading it there finds the crc32c wrong, so every rank goes back to step 3.
    _damage_newest(tmp_path, shm_root, 1, step=4)
    # Three ranks, the third on a new node with an empty memory: every rank resumes at
    # step 3 with the rows it now owns, gathered from the two old ranks' snapshots (the new
    # rank fetches both from the servers; rank 1 needs rows of old rank 0 and 1).
    assert _launch(ranks, tmp_path, shm_root, 5, out, 3, WORLD_REPLICAS="2") == [0, 0, 0], \
        _tails(out)
    _check_shards(out, 3, 3)
    # The 3-rank run went on to step 5; back to 2 ranks (both nodes' servers up, node 0
    # holding rank 2's replica): each resumes at 5 with rows from up to two of the 3 shards.
    assert _launch(ranks, tmp_path, shm_root, 6, out, 2, WORLD_REPLICAS="2") == [0, 0], \
        _tails(out)
    _check_shards(out, 2, 5)
    # Down to one rank on node 0, which holds rank 0's snapshots and node 1's replicas of
    # rank 1 (without replica servers: a job of one node has none): the whole tensors.
    assert _launch(ranks, tmp_path, shm_root, 6, out, 1) == [0], _tails(out)
    _check_shards(out, 1, 6)


@pytest.mark.slow
def test_a_2d_mesh_state_resumes_on_a_1d_mesh_and_back(
        tmp_path: Path, shm_root: Path, ranks: multiprocessing.context.BaseContext) -> None:
    # Four ranks on a 2x2 mesh (rows over one mesh dimension, columns over the other, the
    # 1-D tensors replicated along the second), each a node of its own.
    out = _new_job(tmp_path)
    assert _launch(ranks, tmp_path, shm_root, 3, out, 4, WORLD_REPLICAS="2",
                   SHARD_MESH="2x2") == [0] * 4, _tails(out)
    # Three ranks with Shard(0) on a 1-D mesh, on nodes 0-2 (old rank 3's snapshot is read
    # from its replica on node 0): each gathers its rows from the 2-D boxes, a box
    # replicated on two old ranks read once.
    assert _launch(ranks, tmp_path, shm_root, 4, out, 3, WORLD_REPLICAS="2") == [0, 0, 0], \
        _tails(out)
    _check_shards(out, 3, 3)
    # And back to a 2-D mesh (2x1) on two nodes, from the three 1-D shards.
    assert _launch(ranks, tmp_path, shm_root, 5, out, 2, WORLD_REPLICAS="2",
                   SHARD_MESH="2x1") == [0, 0], _tails(out)
    _check_shards(out, 2, 4, one_d=False)
