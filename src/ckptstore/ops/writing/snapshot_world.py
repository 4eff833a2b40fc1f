"""Snapshots across the ranks of a ``torch.distributed`` job: neighbours and one step.

Two things a multi-process job needs that one process's snapshots do not give
(docs/SNAPSHOTS.md, "Peer replicas"):

* **Neighbours from the world.** :func:`ring_assignment` (pure) places the ranks on nodes as
  torchrun does (``rank = node * nproc_per_node + local_rank``) and has every rank of node
  ``k`` send its replicas to node ``(k + 1) % nnodes``. One replica server runs per node, in
  its local rank 0; the servers' addresses are exchanged through the process group
  (:func:`gather`, an ``all_gather_object``), so nobody configures an address.
* **One step across ranks.** At a restart every rank lists what its host holds
  (:func:`host_inventory`: its own slots and the replicas it keeps, headers only), the lists
  are gathered, and :func:`agree_step` (pure) picks the newest step for which every rank of
  the world can read a current snapshot (on its own host, or from a host with a replica
  server); :func:`locate` says where each rank reads its
  own. A snapshot superseded by a newer one of a lower or equal step (the timeline a restart
  abandoned) never counts.

A rank's state is found wherever it is, not only on "its" node: the c10d rendezvous assigns
node ranks anew at every launch (sorted by the node's address, so a replacement node can take
another place in the ring), and the state of global rank ``r`` is what rank ``r`` loads.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from ckptstore.core import StoreCore
from ckptstore.errors import ConfigError
from ckptstore.ops.writing.snapshot import (
    committed_slots,
    snapshot_dir,
)

__all__ = [
    "Held",
    "HostInventory",
    "PeerAssignment",
    "World",
    "agree_sharded_step",
    "agree_step",
    "current_snapshots",
    "current_world",
    "gather",
    "host_inventory",
    "locate",
    "ring_assignment",
]


@dataclass(frozen=True)
class World:
    """Where this process sits in a ``torch.distributed`` job.

    Attributes:
        rank: Global rank.
        world_size: Number of ranks.
        local_rank: Rank on its node.
        nproc_per_node: Ranks per node (torchrun's ``LOCAL_WORLD_SIZE``).
        node: The node's index (torchrun's ``GROUP_RANK``).
        nnodes: Number of nodes.
    """

    rank: int
    world_size: int
    local_rank: int
    nproc_per_node: int
    node: int
    nnodes: int


@dataclass(frozen=True)
class PeerAssignment:
    """Where one rank's snapshots are replicated.

    Attributes:
        rank: Global rank.
        node: The node it runs on.
        sends_to: The node whose replica server keeps its replicas.
        serves: Whether it runs its node's replica server (its local rank 0).
    """

    rank: int
    node: int
    sends_to: int
    serves: bool


def ring_assignment(nnodes: int, nproc_per_node: int) -> list[PeerAssignment]:
    """Every rank's neighbour: a ring over nodes, node ``k`` to node ``(k + 1) % nnodes``.

    Args:
        nnodes: Number of nodes (at least 2: a replica on the same node does not survive
            the node's loss).
        nproc_per_node: Ranks per node (the same on every node, as torchrun starts them).

    Returns:
        One assignment per global rank, in rank order.

    Raises:
        ConfigError: For fewer than 2 nodes or fewer than 1 rank per node.
    """
    for name, value, least in (("nnodes", nnodes, 2), ("nproc_per_node", nproc_per_node, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            if name == "nnodes" and type(value) is int and value == 1:
                raise ConfigError(
                    "replicas=2 needs at least 2 nodes: this job runs on one node, where a "
                    "replica would be lost with the node; use replicas=1, or pass peer= to "
                    "replicate to a server outside the job")
            raise ConfigError(f"{name} must be an int of at least {least}, got {value!r}")
    return [
        PeerAssignment(rank=node * nproc_per_node + local, node=node,
                       sends_to=(node + 1) % nnodes, serves=local == 0)
        for node in range(nnodes) for local in range(nproc_per_node)
    ]


def _env_int(env: Mapping[str, str], name: str) -> int | None:
    raw = env.get(name, "").strip()
    if not raw:
        return None
    if not raw.isdigit():
        raise ConfigError(f"${name} must be a non-negative integer, got {raw!r}")
    return int(raw)


def current_world(env: Mapping[str, str] | None = None) -> World | None:
    """This process's place in the job, or None when it runs alone.

    The rank and the world size come from the initialised default process group; the
    node layout from torchrun's ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE`` and ``GROUP_RANK``
    (without them every rank is taken as a node of its own).

    Args:
        env: The environment (default ``os.environ``).

    Returns:
        The world, or None without torchrun's variables and without a process group.

    Raises:
        ConfigError: When torchrun's variables are set but no process group is initialised
            (the addresses are exchanged through it), or they contradict each other.
    """
    env = os.environ if env is None else env
    import torch.distributed as dist

    initialised = dist.is_available() and dist.is_initialized()
    launched = _env_int(env, "WORLD_SIZE")
    if not initialised:
        if launched is not None and launched > 1:
            raise ConfigError(
                "this process runs under torchrun (WORLD_SIZE is set) but no process group is "
                "initialised: call torch.distributed.init_process_group() before creating the "
                "CheckpointManager (the ranks exchange their replica servers' addresses and "
                "agree on the step to resume through it)")
        return None
    rank, world_size = dist.get_rank(), dist.get_world_size()
    per_node = _env_int(env, "LOCAL_WORLD_SIZE") or 1
    local_rank = _env_int(env, "LOCAL_RANK")
    local_rank = rank % per_node if local_rank is None else local_rank
    if world_size % per_node or local_rank >= per_node:
        raise ConfigError(
            f"a world of {world_size} ranks cannot have {per_node} per node (local rank "
            f"{local_rank}): every node must run the same number of ranks")
    node = _env_int(env, "GROUP_RANK")
    node = rank // per_node if node is None else node
    if node * per_node + local_rank != rank:
        raise ConfigError(
            f"rank {rank} is not node {node} x {per_node} ranks + local rank {local_rank}: "
            "the ranks are not placed on nodes as torchrun places them")
    return World(rank=rank, world_size=world_size, local_rank=local_rank,
                 nproc_per_node=per_node, node=node, nnodes=world_size // per_node)


def gather(obj: Any) -> list[Any]:
    """Every rank's ``obj``, in rank order, through the default process group."""
    import torch.distributed as dist

    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


@dataclass(frozen=True)
class Held:
    """A committed snapshot slot on some host (header checked, not yet its bytes).

    Attributes:
        rank: The rank whose state it is.
        seq: Its sequence number (the writer's; higher is newer, across restarts too).
        step: Its training step.
        replica: In a replica directory (kept for a neighbour) rather than the rank's own.
        name: The slot file's name in its directory.
    """

    rank: int
    seq: int
    step: int
    replica: bool
    name: str


@dataclass(frozen=True)
class HostInventory:
    """What one host holds of a run, as one rank reports it.

    Attributes:
        host: Identifies the host's shared memory (ranks that report the same see the same
            files).
        address: The host's replica server ``(host, port)``, or None without one (its
            snapshots are then readable only by ranks on it).
        held: Its committed slots.
        durable_step: The step of the run's newest durable checkpoint, as that rank sees it.
    """

    host: str
    address: tuple[str, int] | None
    held: tuple[Held, ...]
    durable_step: int | None


def _run_dir(store: StoreCore, run: str) -> Path:
    return snapshot_dir(store, run, 0).parent


def slot_path(store: StoreCore, run: str, held: Held) -> Path:
    """Where ``held`` lies on the host that listed it."""
    prefix = "replica" if held.replica else "rank"
    return _run_dir(store, run) / f"{prefix}{held.rank}" / held.name


def host_inventory(store: StoreCore, run: str) -> list[Held]:
    """Every committed snapshot slot of ``run`` on this host, its own and its replicas.

    Costs one small read per slot file; a file that is torn, foreign or unreadable is left
    out (its bytes are checked again when it is read).
    """
    found: list[Held] = []
    try:
        directories = sorted(_run_dir(store, run).iterdir())
    except OSError:
        return []
    for directory in directories:
        for prefix in ("rank", "replica"):
            index = directory.name.removeprefix(prefix)
            if index != directory.name and index.isdigit():
                break
        else:
            continue
        for slot in sorted(committed_slots(directory), key=lambda f: f.path):
            found.append(Held(rank=int(index), seq=slot.seq, step=slot.step,
                              replica=prefix == "replica", name=slot.path.name))
    return found


def current_snapshots(held: Iterable[Held]) -> list[Held]:
    """The snapshots still on their rank's timeline, newest first per rank.

    A snapshot is superseded when its rank has one with a higher sequence number and a
    lower or equal step: that one was taken after a restart went back to an earlier step,
    so the first belongs to the abandoned run (its step's state differs from the
    timeline's). Writers continue the sequence numbers past everything gathered at a
    restart (``SnapshotWriter.continue_after``), which makes this order hold across hosts.
    """
    by_rank: dict[int, list[Held]] = {}
    for h in held:
        by_rank.setdefault(h.rank, []).append(h)
    out: list[Held] = []
    for rank in sorted(by_rank):
        # Copies of one snapshot (its own slot, replicas) share a seq: judged together.
        seqs: dict[int, list[Held]] = {}
        for h in by_rank[rank]:
            seqs.setdefault(h.seq, []).append(h)
        lowest: int | None = None  # the lowest step among those with a higher seq
        for seq in sorted(seqs, reverse=True):
            step = min(h.step for h in seqs[seq])
            if lowest is None or step < lowest:
                out.extend(seqs[seq])
            lowest = step if lowest is None else min(lowest, step)
    return out


def _unique_hosts(inventories: Sequence[HostInventory]) -> list[HostInventory]:
    seen: dict[str, HostInventory] = {}
    for inv in inventories:
        seen.setdefault(inv.host, inv)
    return list(seen.values())


def _as_one(held: Iterable[Held]) -> dict[Held, Held]:
    """Every snapshot as one of rank 0 (keys) and where it is (values): a replicated state,
    where any rank's snapshot is every rank's."""
    return {replace(h, rank=0): h for h in held}


def agree_step(inventories: Sequence[HostInventory], *, exclude: Iterable[int] = (),
               replicated: bool = False) -> int | None:
    """The newest step for which every rank can read a current snapshot of its state.

    A rank can read a copy on its own host, or on a host with a replica server (which sends
    it); a copy on another host without one does not count.

    Args:
        inventories: Every rank's report, in rank order (ranks on one host report the same
            host): the world is ``len(inventories)`` ranks.
        exclude: Steps not to choose (a read of one failed).
        replicated: Every rank's state is the same (data parallel): one snapshot of a step,
            of whichever rank (of this world or of an earlier one of another size), is
            enough for all.

    Returns:
        The step, or None when no step is readable by every rank.
    """
    skip = set(exclude)
    hosts = _unique_hosts(inventories)
    current = _current(hosts, replicated)
    for step in sorted({h.step for h in current} - skip, reverse=True):
        if all(_locate(hosts, current, rank, step, inv.host, replicated) is not None
               for rank, inv in enumerate(inventories)):
            return step
    return None


def agree_sharded_step(inventories: Sequence[HostInventory], *,
                       exclude: Iterable[int] = ()) -> tuple[int, int] | None:
    """The newest step whose every old rank's snapshot every rank of this world can read,
    for a sharded state resumed at another world size (or layout).

    The old world of a step is taken as ranks ``0 .. n - 1`` with ``n`` one past the highest
    rank holding a current snapshot of it; a step with a hole (an old rank whose snapshot is
    nowhere readable by some rank) is not eligible. Each snapshot's meta records the world it
    was written in, and the reader checks it against ``n`` (a shard missing at the top is
    caught there, and the step excluded).

    Args:
        inventories: Every rank's report, in rank order.
        exclude: Steps not to choose (a read of one failed).

    Returns:
        ``(step, old world size)``, or None when no step qualifies.
    """
    skip = set(exclude)
    hosts = _unique_hosts(inventories)
    current = _current(hosts, False)
    for step in sorted({h.step for h in current} - skip, reverse=True):
        old_world = 1 + max(h.rank for h in current if h.step == step)
        if all(_locate(hosts, current, old, step, inv.host, False) is not None
               for old in range(old_world) for inv in hosts):
            return step, old_world
    return None


def _current(hosts: Sequence[HostInventory], replicated: bool) -> set[Held]:
    reachable = [h for inv in hosts for h in inv.held]
    return set(current_snapshots(_as_one(reachable) if replicated else reachable))


def locate(inventories: Sequence[HostInventory], rank: int, step: int, here: str, *,
           replicated: bool = False) -> tuple[HostInventory, Held] | None:
    """Where ``rank`` reads its snapshot of ``step``: this host (``here``) first, then a
    host with a replica server; the newest copy (highest sequence number) on each. With
    ``replicated``, a snapshot of any rank will do (the returned one says whose it is)."""
    hosts = _unique_hosts(inventories)
    return _locate(hosts, _current(hosts, replicated), rank, step, here, replicated)


def _locate(hosts: Sequence[HostInventory], current: set[Held], rank: int, step: int,
            here: str, replicated: bool) -> tuple[HostInventory, Held] | None:
    for inv in sorted(hosts, key=lambda inv: inv.host != here):
        if inv.host != here and inv.address is None:
            continue
        where = _as_one(inv.held) if replicated else {h: h for h in inv.held}
        mine = [h for h in where if h.rank == (0 if replicated else rank) and h.step == step
                and h in current]
        if mine:
            return inv, where[max(mine, key=lambda h: (h.seq, not h.replica))]
    return None
