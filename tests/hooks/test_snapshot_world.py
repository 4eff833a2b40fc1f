"""Snapshots of a multi-rank job: neighbours assigned from the world (a ring over nodes), and
one step agreed by every rank at a restart (gloo on CPU, real processes).

The ranks the test starts itself are processes of their own: children of a forkserver that
preloaded torch.distributed and ckptstore (tests/hooks/world_trainer.py's ``rank_in_child``),
so that a rank does not pay seconds of imports as a fresh interpreter would. The launches of
whole nodes stay torchrun launches, fresh interpreters.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import shutil
import subprocess
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch.distributed as dist
from process_support import add_test_dir, finish_child, preloaded_children, torchrun

from ckptstore.errors import ConfigError
from ckptstore.hooks.manager import CheckpointManager
from ckptstore.ops.writing.snapshot import HEADER_BYTES, parse_header, snapshot_dir
from ckptstore.ops.writing.snapshot_world import (
    Held,
    HostInventory,
    agree_step,
    current_snapshots,
    current_world,
    host_inventory,
    locate,
    ring_assignment,
)
from ckptstore.store import CheckpointStore
from ckptstore.testing.launches import kill_launch
from ckptstore.testing.ports import free_port

HERE = Path(__file__).parent
add_test_dir(HERE)  # before importing its helper scripts; the children get it too

import world_trainer  # noqa: E402

TRAINER = Path(__file__).with_name("world_trainer.py")
TIMEOUT_S = 60
#: Installed packages only: the children import world_trainer.py themselves. Besides the
#: trainer's imports, what a rank would import later on its own (listed from a rank's
#: sys.modules): torch._dynamo (the optimizer's first step), alembic's command module
#: (creating the catalog), the migrations, the metrics module and the replica server.
_PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "alembic", "alembic.command",
            "alembic.config", "ckptstore.hooks.manager", "ckptstore.store",
            "ckptstore.migrations", "ckptstore.observability.prom",
            "ckptstore.ops.writing.snapshot_peer"]


@pytest.fixture(scope="module")
def ranks() -> Iterator[multiprocessing.context.BaseContext]:
    """Where the ranks start: a forkserver with torch and ckptstore imported, stopped with
    the module. When another module's forkserver runs already, spawned children instead:
    slower, always right."""
    yield from preloaded_children(_PRELOAD)


# ---------------------------------------------------------------- the assignment (pure)
@pytest.mark.parametrize(("nnodes", "nproc"), [(2, 1), (2, 4), (3, 2), (5, 3), (8, 8)])
def test_ring_over_nodes(nnodes: int, nproc: int) -> None:
    ranks = ring_assignment(nnodes, nproc)
    assert [a.rank for a in ranks] == list(range(nnodes * nproc))
    for a in ranks:
        assert a.node == a.rank // nproc  # torchrun's placement
        assert a.sends_to == (a.node + 1) % nnodes and a.sends_to != a.node
        assert a.serves == (a.rank % nproc == 0)
    # Every node receives from exactly one node, and runs exactly one server.
    assert sorted({(a.node, a.sends_to) for a in ranks}, key=lambda e: e[1]) == [
        ((k - 1) % nnodes, k) for k in range(nnodes)]
    assert sum(a.serves for a in ranks) == nnodes


def test_one_node_or_bad_sizes_are_refused() -> None:
    with pytest.raises(ConfigError, match="at least 2 nodes"):
        ring_assignment(1, 4)
    for nnodes, nproc in ((0, 1), (2, 0), (True, 1), (2, 1.5)):
        with pytest.raises(ConfigError, match="must be an int"):
            ring_assignment(nnodes, nproc)  # type: ignore[arg-type]


def test_world_from_the_environment_needs_a_process_group(
    snap_store: CheckpointStore,
) -> None:
    assert not dist.is_initialized()
    with pytest.raises(ConfigError, match="needs an initialised torch"):
        CheckpointManager(snap_store, "r", snapshot_interval=1, distributed=True,
                          handle_sigterm=False, history=False)
    with pytest.raises(ConfigError, match="replicated must be"):
        CheckpointManager(snap_store, "r", snapshot_interval=1, replicated=1,  # type: ignore[arg-type]
                          handle_sigterm=False, history=False)
    assert current_world({}) is None  # one process on its own
    with pytest.raises(ConfigError, match="init_process_group"):
        current_world({"WORLD_SIZE": "4", "RANK": "1"})
    with pytest.raises(ConfigError, match="non-negative integer"):
        current_world({"WORLD_SIZE": "x"})


@pytest.fixture
def solo_group(tmp_path: Path) -> Iterator[None]:
    """A process group of this process alone: one node."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0,
                            world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_a_job_on_one_node_is_refused_with_replicas_2(
    snap_store: CheckpointStore, solo_group: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    for var, value in {"LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1", "GROUP_RANK": "0"}.items():
        monkeypatch.setenv(var, value)
    # A world of one rank has no neighbour to find; a rank on its own none to agree with.
    for distributed in (None, False):
        with pytest.raises(ConfigError, match="several nodes"):
            CheckpointManager(snap_store, "r", snapshot_interval=1, replicas=2,
                              distributed=distributed, handle_sigterm=False, history=False)
    with pytest.raises(ConfigError, match="at least 2 nodes"):
        CheckpointManager(snap_store, "r", snapshot_interval=1, replicas=2, distributed=True,
                          handle_sigterm=False, history=False)
    with pytest.raises(ConfigError, match="distributed must be"):
        CheckpointManager(snap_store, "r", snapshot_interval=1, distributed="yes",  # type: ignore[arg-type]
                          handle_sigterm=False, history=False)
    monkeypatch.setenv("GROUP_RANK", "3")  # rank 0 cannot be on node 3 of 1-rank nodes
    with pytest.raises(ConfigError, match="not placed on nodes as torchrun"):
        current_world()
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # a world of 1 cannot hold 2 per node
    with pytest.raises(ConfigError, match="same number of ranks"):
        current_world()


# ---------------------------------------------------------------- the agreement (pure)
def _held(rank: int, seq: int, step: int, replica: bool = False) -> Held:
    return Held(rank=rank, seq=seq, step=step, replica=replica, name=f"slot{seq}.snap")


def test_a_snapshot_of_an_abandoned_timeline_is_not_current() -> None:
    # Steps 9 and 10, then a restart went back to 8 and took 9 again (seq 22): the old 10
    # (seq 20) and the old 9 (seq 18) belong to the abandoned run.
    held = [_held(0, 16, 8), _held(0, 18, 9), _held(0, 20, 10), _held(0, 22, 9),
            _held(0, 22, 9, replica=True)]
    assert sorted((h.seq, h.replica) for h in current_snapshots(held)) == [
        (16, False), (22, False), (22, True)]


def test_the_newest_step_every_rank_can_read_wins() -> None:
    node_a = HostInventory("a", ("127.0.0.1", 1), (
        _held(0, 10, 5), _held(0, 12, 6),        # rank 0's own slots
        _held(1, 8, 4, True), _held(1, 10, 5, True)), None)  # rank 1's replicas
    node_b = HostInventory("b", ("127.0.0.1", 2), (_held(1, 12, 6),), None)
    empty = HostInventory("c", ("127.0.0.1", 3), (), None)  # a replacement node
    # Inventories in rank order: rank 0 on a, rank 1 on b.
    assert agree_step([node_a, node_b]) == 6
    assert agree_step([node_a, node_b], exclude=[6]) == 5
    assert agree_step([node_a, empty]) == 5  # node b lost: rank 1 from its replica on a
    assert agree_step([node_a, node_a]) == 5  # both ranks on a now: reported twice, once
    assert agree_step([node_a, node_b, empty]) is None  # rank 2 has nothing anywhere
    # A copy on another host without a replica server is out of reach.
    lone = HostInventory("a", None, node_a.held, None)
    assert agree_step([lone, HostInventory("c", None, (), None)]) is None
    assert agree_step([lone, node_b]) == 6  # rank 1's own host has step 6
    # A replicated state: one snapshot of a step, of any rank, is every rank's (a world of 3
    # resumes from a world of 2); rank 2 reads rank 1's copy on b, or rank 0's on a.
    assert agree_step([node_a, node_b, empty], replicated=True) == 6
    assert locate([node_a, node_b], 2, 6, "b", replicated=True) == (node_b, _held(1, 12, 6))
    assert locate([node_a, node_b], 2, 6, "c", replicated=True) == (node_a, _held(0, 12, 6))
    # Rank 1 reads its own host's copy first, else the replica on a.
    assert locate([node_a, node_b], 1, 6, "b") == (node_b, _held(1, 12, 6))
    assert locate([node_a, node_b], 1, 5, "b") == (node_a, _held(1, 10, 5, True))
    assert locate([lone, node_b], 1, 5, "b") is None
    assert locate([lone, node_b], 1, 5, "a") == (lone, _held(1, 10, 5, True))


# ---------------------------------------------------------------- real ranks (gloo)
def _launch_ranks(ctx: multiprocessing.context.BaseContext, tmp_path: Path, shm_root: Path,
                  steps: str, out: Path, nranks: int = 2, **extra: str) -> list[int]:
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
            target=world_trainer.rank_in_child,
            args=(["r", steps, str(out)], env,
                  ["CKPT_CONFIG", "CKPT_FAULT_POINT", "CKPT_REPLICAS"],
                  str(out / f"proc{rank}.out")))
        proc.start()
        procs.append(proc)
    try:
        return [finish_child(p, TIMEOUT_S) for p in procs]
    finally:
        for p in procs:
            finish_child(p, 0)


def _log(out: Path, rank: int) -> list[list[str]]:
    return [line.split() for line in (out / f"rank{rank}.log").read_text().splitlines()]


def _digests(out: Path, rank: int) -> dict[int, str]:
    return {int(w[1]): w[2] for w in _log(out, rank) if w[0] == "done"}


def _resumed(out: Path, rank: int) -> list[tuple[int, str]]:
    return [(int(w[1]), w[2]) for w in _log(out, rank) if w[0] == "resumed"]


@pytest.mark.slow
def test_ranks_resume_at_the_newest_step_all_of_them_hold(
        tmp_path: Path, shm_root: Path, ranks: multiprocessing.context.BaseContext) -> None:
    with CheckpointStore.open(tmp_path / "store") as store:
        store.run("r")  # made once, before two processes look for it
    out = tmp_path / "out"
    out.mkdir()
    # Rank 0 gets to step 6, rank 1 to step 5: with two slots each, rank 0 holds 5 and 6,
    # rank 1 holds 4 and 5.
    assert _launch_ranks(ranks, tmp_path, shm_root, "6,5", out) == [0, 0], \
        (out / "proc0.out").read_text()[-3000:] + (out / "proc1.out").read_text()[-3000:]
    reference = [_digests(out, 0), _digests(out, 1)]
    assert reference[0] != reference[1]  # each rank's state is its own
    # Both resume at 5, each with its own state of step 5, and go on to 7.
    assert _launch_ranks(ranks, tmp_path, shm_root, "7", out) == [0, 0]
    assert _resumed(out, 0)[-1] == (5, reference[0][5])
    assert _resumed(out, 1)[-1] == (5, reference[1][5])
    assert _digests(out, 0)[6] == reference[0][6]  # the same step again, bit for bit
    # Damage rank 1's newest snapshot (step 7): its read fails, so both ranks go back to 6,
    # the newest step whose reads succeed everywhere; never one at 7 and one at 6.
    with CheckpointStore.open(tmp_path / "store", memory_tier_dir=str(shm_root / "n1")) as st:
        slots = {p: parse_header(p.read_bytes()[:HEADER_BYTES])
                 for p in snapshot_dir(st, "r", 1).glob("slot*.snap")}
    newest = max((p for p in slots if slots[p]), key=lambda p: slots[p][0])  # type: ignore[index]
    header = slots[newest]
    assert header is not None and header[1] == 7
    with open(newest, "r+b") as fh:  # the first byte of the first tensor
        fh.seek(header[3])
        first = fh.read(1)
        fh.seek(header[3])
        fh.write(bytes([first[0] ^ 0xFF]))
    assert _launch_ranks(ranks, tmp_path, shm_root, "8", out) == [0, 0]
    after = [_digests(out, 0), _digests(out, 1)]
    assert _resumed(out, 0)[-1] == (6, after[0][6])
    assert _resumed(out, 1)[-1] == (6, after[1][6])


@pytest.mark.slow
def test_a_replicated_state_resumes_at_another_world_size(
        tmp_path: Path, shm_root: Path, ranks: multiprocessing.context.BaseContext) -> None:
    with CheckpointStore.open(tmp_path / "store") as store:
        store.run("r")
    out = tmp_path / "out"
    out.mkdir()
    replicated = {"WORLD_SYNC": "1", "WORLD_REPLICATED": "1", "WORLD_REPLICAS": "2"}
    assert _launch_ranks(ranks, tmp_path, shm_root, "5", out, 2, **replicated) == [0, 0], \
        (out / "proc0.out").read_text()[-3000:]
    reference = _digests(out, 0)
    assert _digests(out, 1) == reference  # the same state on every rank
    # Three ranks now, the third on a new node with an empty memory: all resume at step 5
    # from the two earlier ranks' snapshots (the new rank fetches one from a server).
    assert _launch_ranks(ranks, tmp_path, shm_root, "6", out, 3, **replicated) == [0, 0, 0], \
        (out / "proc2.out").read_text()[-3000:]
    assert [_resumed(out, r)[-1] for r in range(3)] == [(5, reference[5])] * 3


# ---------------------------------------------------------------- two torchrun launches
@dataclass
class Nodes:
    """Two simulated nodes: one shared catalog; each its own host name, hot directory,
    store root and shared memory."""

    tmp: Path
    shm: Path
    out: Path

    def env(self, node: int, **extra: str) -> dict[str, str]:
        env = dict(os.environ)
        for var in ("CKPT_CONFIG", "CKPT_FAULT_POINT", "CKPT_REPLICAS", "WORLD_HANG_AFTER"):
            env.pop(var, None)
        env.update(OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo", CKPT_HOST=f"node-{node}",
                   CKPT_CATALOG_URL=f"sqlite:///{self.tmp / 'catalog.db'}",
                   CKPT_ROOT=str(self.tmp / f"root-{node}"), CKPT_HOT=str(self.tmp / f"hot-{node}"),
                   CKPT_MEMORY_TIER_DIR=str(self.shm / f"node-{node}"), WORLD_SYNC="1",
                   WORLD_REPLICAS="2", **extra)
        return env

    def launch(self, last: int, extra: dict[int, dict[str, str]] | None = None
               ) -> list[subprocess.Popen[bytes]]:
        """One ``torchrun --nnodes 2 --node-rank K`` per node, rendezvous on loopback."""
        port, rdzv = free_port(), f"snapworld-{uuid.uuid4().hex[:8]}"
        procs = []
        for node in range(2):
            log = (self.out / f"node-{node}.out").open("a")
            cmd = [*torchrun(self.tmp / "torchrun"), "--nnodes", "2", "--node-rank", str(node),
                   "--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint",
                   f"127.0.0.1:{port}", "--rdzv-id", rdzv, "--max-restarts", "0",
                   str(TRAINER), "r", str(last), str(self.out)]
            procs.append(subprocess.Popen(
                cmd, env=self.env(node, **(extra or {}).get(node, {})), stdout=log,
                stderr=subprocess.STDOUT, start_new_session=True))
            log.close()
        return procs

    def tails(self) -> str:
        return "\n".join(f"--- node-{n}\n" + (self.out / f"node-{n}.out").read_text()[-3000:]
                         for n in range(2))


def _workers(out: Path, host: str | None = None) -> list[int]:
    """The pids of the training processes that logged (on ``host``)."""
    return [int(w[2]) for p in out.glob("rank*.log")
            for w in _log(out, int(p.stem.removeprefix("rank")))
            if w[0] == "host" and host in (None, w[1])]


def _kill(proc: subprocess.Popen[bytes], workers: list[int]) -> None:
    """SIGKILL a whole launch, its workers included (bounded wait until all are gone)."""
    kill_launch(proc, workers, str(TRAINER), TIMEOUT_S)


def _rank_of(out: Path, host: str) -> int:
    ranks = [int(p.stem.removeprefix("rank")) for p in out.glob("rank*.log")
             if any(w[:2] == ["host", host] for w in _log(out, int(p.stem.removeprefix("rank"))))]
    assert len(ranks) == 1, ranks
    return ranks[0]


@pytest.mark.slow
def test_a_lost_node_resumes_from_its_replica_on_the_other_node(tmp_path: Path,
                                                               shm_root: Path) -> None:
    nodes = Nodes(tmp_path, shm_root, tmp_path / "out")
    nodes.out.mkdir()
    with CheckpointStore.open(tmp_path / "root-0", catalog_url=nodes.env(0)["CKPT_CATALOG_URL"],
                              hot=str(tmp_path / "hot-0")) as store:
        store.run("r")  # made once, before two processes look for it
    kill_after = 6
    # Node 1's rank stops after step 6 (the others then wait for it in the next step's
    # all-reduce), and its whole launch is SIGKILLed there: a node lost at a known step.
    procs = nodes.launch(40, {1: {"WORLD_HANG_AFTER": str(kill_after)}})
    try:
        deadline = time.monotonic() + TIMEOUT_S
        lost = -1
        while lost < 0:  # bounded: the node's log says it reached the step
            assert time.monotonic() < deadline, nodes.tails()
            assert procs[1].poll() is None, nodes.tails()
            with contextlib.suppress(AssertionError, FileNotFoundError):
                lost = _rank_of(nodes.out, "node-1")
                if ["hanging"] not in _log(nodes.out, lost):
                    lost = -1
            if lost < 0:
                # Waits on node 1's launch: returns early (and fails above) if it ended.
                with contextlib.suppress(subprocess.TimeoutExpired):
                    procs[1].wait(timeout=0.2)
        _kill(procs[1], _workers(nodes.out, "node-1"))
        # The job is torn down, as a scheduler does when a node is lost (node 0's rank
        # would only fail in the all-reduce its neighbour never joins, after a timeout).
        _kill(procs[0], _workers(nodes.out, "node-0"))
    finally:
        for proc in procs:
            _kill(proc, _workers(nodes.out))
    survivor = 1 - lost
    reference = {r: _digests(nodes.out, r) for r in (0, 1)}
    assert max(reference[lost]) == kill_after
    # The replacement of node 1: the same host name, an empty memory.
    shutil.rmtree(shm_root / "node-1")
    procs = nodes.launch(kill_after + 3)
    try:
        codes = [p.wait(timeout=TIMEOUT_S) for p in procs]
    finally:
        for proc in procs:
            _kill(proc, _workers(nodes.out))
    assert codes == [0, 0], nodes.tails()
    resumed = {r: _resumed(nodes.out, r)[-1] for r in (0, 1)}
    step = resumed[0][0]
    # One step on both ranks, at most snapshot_interval (1) behind the lost node's last
    # step, and each rank's state is exactly the one it had at that step.
    assert resumed[1][0] == step and kill_after - 1 <= step <= kill_after, resumed
    for r in (0, 1):
        assert resumed[r][1] == reference[r][step], (r, resumed, reference)
    # The lost rank's state came from the survivor's memory: its replica there.
    with CheckpointStore.open(tmp_path / "root-0", catalog_url=nodes.env(0)["CKPT_CATALOG_URL"],
                              hot=str(tmp_path / "hot-0"),
                              memory_tier_dir=str(shm_root / "node-0")) as store:
        assert any(h.replica and h.rank == lost for h in host_inventory(store, "r"))
    # Training went on from there bit for bit: the steps both runs took agree.
    after = {r: _digests(nodes.out, r) for r in (0, 1)}
    assert after[survivor][kill_after + 3]
    for r in (0, 1):
        assert after[r][kill_after] == reference[r][kill_after]
