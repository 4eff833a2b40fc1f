"""The ranks of a ``torch.distributed`` job around a manager's snapshots.

A :class:`~ckptstore.hooks.manager.CheckpointManager` made on every rank of a job uses two
things here, in this order:

1. :func:`join_ring` when it is made (``replicas=2`` without ``peer``): every rank takes part
   in one exchange (each node's local rank 0 starts the node's replica server) and learns
   the neighbour node its snapshots go to; :func:`leave_ring` when it closes, after every
   rank's last send.
2. :class:`RankRestart` at a restart (``restore_latest``): every rank lists what its host
   holds, the lists are gathered, the same pure choice is made on every rank
   (:mod:`ckptstore.ops.writing.snapshot_world`), and each rank reads its state of the
   agreed step from its host or fetches it from the host holding it; a sharded state is
   filled from the old ranks' shards (:mod:`ckptstore.ops.writing.snapshot_shards`).

Each of them is a collective: every rank calls it, or none does.
"""

from __future__ import annotations

import logging
import math
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ckptstore.core import StoreCore
from ckptstore.errors import CkptError, ConfigError, StorageError
from ckptstore.format import FlatState, unflatten_state
from ckptstore.identity import host
from ckptstore.ops.writing.snapshot import (
    SnapshotFound,
    SnapshotWriter,
    read_snapshot,
    read_snapshot_flat,
    snapshot_dir,
)
from ckptstore.ops.writing.snapshot_peer import SnapshotReplicaServer, pull_replica, pulled_slot
from ckptstore.ops.writing.snapshot_shards import (
    Box,
    MeshLayout,
    ShardSpec,
    box_overlaps,
    dtensor_templates,
    shard_boxes,
    specs_from_meta,
)
from ckptstore.ops.writing.snapshot_world import (
    HostInventory,
    World,
    agree_sharded_step,
    agree_step,
    current_world,
    gather,
    host_inventory,
    locate,
    ring_assignment,
    slot_path,
)

__all__ = ["RankRestart", "Ring", "join_ring", "leave_ring"]

logger = logging.getLogger(__name__)

#: Steps the ranks try in turn when a read of the agreed one fails somewhere.
_AGREE_ROUNDS = 3


@dataclass(frozen=True)
class Ring:
    """This rank's place in the ring of replica servers.

    Attributes:
        world: Where this rank sits in the job.
        node_server: This node's replica server address.
        peer: The server this rank's snapshots are sent to (the next node's).
        server: The server this rank runs (its node's local rank 0), else None.
    """

    world: World
    node_server: tuple[str, int]
    peer: tuple[str, int]
    server: SnapshotReplicaServer | None


def join_ring(store: StoreCore, replica_host: str | None) -> Ring:
    """Find this rank's neighbour in the job: a ring over nodes, the servers' addresses
    exchanged through the process group (ops/writing/snapshot_world.py)."""
    world = current_world()
    if world is None:
        raise ConfigError(
            "replicas=2 needs peer='host:port' (a neighbour's snapshot replica server) or "
            "a torch.distributed job of several nodes (an initialised process group), "
            "whose neighbours are found by themselves")
    mine = ring_assignment(world.nnodes, world.nproc_per_node)[world.rank]
    error: str | None = None
    server: SnapshotReplicaServer | None = None
    if mine.serves:
        try:
            server = SnapshotReplicaServer(store, host=replica_host or socket.gethostname())
        except StorageError as exc:
            error = str(exc)
    address = server.address if server is not None else None
    # Every rank takes part even when its server failed: no rank is left waiting.
    reports = gather((world.node, address, error))
    failed = [f"node {node}: {err}" for node, _, err in reports if err]
    servers = {node: tuple(addr) for node, addr, _ in reports if addr is not None}
    if failed or set(servers) != set(range(world.nnodes)):
        if server is not None:
            server.close()
        raise StorageError("snapshot replica servers did not start: "
                           + ("; ".join(failed) or f"only nodes {sorted(servers)}"))
    peer = servers[mine.sends_to]
    logger.info("rank %s (node %s) replicates its snapshots to node %s at %s:%s",
                world.rank, world.node, mine.sends_to, *peer)
    return Ring(world, servers[world.node], peer, server)


def leave_ring(ring: Ring, *, failing: bool) -> None:
    """Stop this node's replica server (if this rank runs it) once every rank has sent its
    last snapshot; a failing rank does not wait for the others."""
    if not failing:
        import torch.distributed as dist

        # The neighbours' last sends end before the server that receives them stops.
        try:
            if dist.is_initialized():
                dist.barrier()
        except Exception:  # a rank gone: its neighbours' replicas are what they are
            logger.warning("ranks did not meet before the replica servers stopped",
                           exc_info=True)
    if ring.server is not None:
        ring.server.close()


class RankRestart:
    """One restart of a multi-rank job from its snapshots (a collective: every rank).

    Args:
        store: The open store.
        run: The run.
        run_token: The run's creation time (snapshots of an earlier run of the same name
            are never read).
        replicated: Every rank holds the same state (any rank's snapshot serves).
        node_server: This node's replica server, when the ring runs one.
    """

    def __init__(self, store: StoreCore, run: str, *, run_token: str, replicated: bool,
                 node_server: tuple[str, int] | None) -> None:
        self.store = store
        self.run = run
        self.run_token = run_token
        self.replicated = replicated
        self.node_server = node_server

    def restore(
        self, durable_step: int | None, into: Any | None, writer: SnapshotWriter | None
    ) -> tuple[int, Any] | None:
        """The newest step every rank holds a snapshot of, agreed through the process
        group, and this rank's state at it; None when the ranks resume from checkpoints.

        Every rank lists what its host holds, the lists are gathered, and the same pure
        choice is made on every rank (``agree_step``); each rank then reads its own state of
        that step from this host or fetches it from the host that holds it. If any rank's
        read fails, all of them try the next newest common step: never a mix of steps.
        """
        import torch.distributed as dist

        # A live state of DTensors: its shards are filled from whichever old ranks' snapshots
        # hold their rows (any world size). Refuses an unsupported layout before any
        # collective (every rank has the same layout, so every rank refuses).
        templates = dtensor_templates(into) if into is not None else {}
        rank, world_size = dist.get_rank(), dist.get_world_size()
        here = f"{host()}|{self._snapshot_root()}"
        mine = HostInventory(here, self.node_server,
                             tuple(host_inventory(self.store, self.run)), durable_step)
        inventories: list[HostInventory] = gather(mine)
        if writer is not None:
            # Later snapshots are numbered after every copy of this rank's (of every rank's,
            # replicated), wherever it is: their order then tells the newer timeline.
            writer.continue_after(max(
                (h.seq for inv in inventories for h in inv.held
                 if h.rank == rank or self.replicated or templates), default=0))
        durable = max((inv.durable_step for inv in inventories
                       if inv.durable_step is not None), default=None)
        if templates:
            return self._restore_resharded(inventories, rank, here, durable, templates, into)
        excluded: list[int] = []
        for _ in range(_AGREE_ROUNDS):
            step = agree_step(inventories, exclude=excluded, replicated=self.replicated)
            if step is None and not excluded and any(inv.held for inv in inventories):
                held = sorted({h.rank for inv in inventories for h in inv.held})
                logger.warning(
                    "snapshots of %s are held for ranks %s, but no step for every one of the "
                    "%s ranks of this world: not resuming from snapshots (a state that is "
                    "the same on every rank can resume at another world size: "
                    "replicated=True)", self.run, held, world_size)
            if step is None or (durable is not None and step < durable):
                return None
            state, error = self._read_agreed(inventories, rank, step, here, into)
            errors = gather(error)
            if not any(errors):
                logger.info("rank %s resumes %s at step %s, agreed by %s ranks", rank,
                            self.run, step, world_size)
                return step, state
            logger.warning("not resuming %s at step %s: %s", self.run, step,
                           "; ".join(f"rank {r}: {e}" for r, e in enumerate(errors) if e))
            excluded.append(step)
        return None

    def _restore_resharded(
        self, inventories: list[HostInventory], rank: int, here: str, durable: int | None,
        templates: dict[str, tuple[Any, ShardSpec]], into: Any,
    ) -> tuple[int, Any] | None:
        """Resume a sharded state (``into`` holds DTensors) at the newest step every old
        rank's snapshot is readable by every rank, at whatever world size wrote it.

        As :meth:`restore`: the same pure choice on every rank
        (``agree_sharded_step``), then every rank reads what it needs; if any rank's read
        fails, all of them try the next newest step.
        """
        excluded: list[int] = []
        for _ in range(_AGREE_ROUNDS):
            agreed = agree_sharded_step(inventories, exclude=excluded)
            if agreed is None and not excluded and any(inv.held for inv in inventories):
                logger.warning(
                    "snapshots of %s are held, but no step whose every shard every rank can "
                    "read: not resuming from snapshots", self.run)
            if agreed is None or (durable is not None and agreed[0] < durable):
                return None
            step, old_world = agreed
            state, error = self._read_resharded(inventories, rank, step, old_world, here,
                                                templates)
            errors = gather(error)
            if not any(errors):
                logger.info("rank %s resumes %s at step %s from the shards of %s ranks",
                            rank, self.run, step, old_world)
                return step, state
            logger.warning("not resuming %s at step %s: %s", self.run, step,
                           "; ".join(f"rank {r}: {e}" for r, e in enumerate(errors) if e))
            excluded.append(step)
        return None

    def _read_resharded(
        self, inventories: list[HostInventory], rank: int, step: int, old_world: int,
        here: str, templates: dict[str, tuple[Any, ShardSpec]],
    ) -> tuple[Any, str | None]:
        """This rank's state at ``step`` with every DTensor's shard filled (in place) from
        the old ranks' snapshots that overlap it; (None, why not) when that fails.

        The old layout of each DTensor is read from one old rank's snapshot (the one the
        values that are not DTensors come from): every old rank recorded the same. Each
        other old snapshot read must then record the box that layout gives its rank.
        """
        # Values that are not DTensors come from one old rank (its own, when it had one):
        # in a sharded state they must be the same on every rank (e.g. the step counter).
        base = min(rank, old_world - 1)
        flats: dict[int, tuple[FlatState, dict[str, ShardSpec]]] = {}
        read, error = self._read_old_shard(inventories, rank, base, step, old_world, here)
        if read is None:
            return None, error
        flats[base] = read
        plans: dict[str, tuple[dict[int, Box], list[tuple[int, Any, Any]]]] = {}
        for key, (_dt, spec) in templates.items():
            plan, why = _reshard_plan(key, spec, flats[base][1].get(key), old_world)
            if plan is None:
                return None, f"step {step}: {why}"
            plans[key] = plan
        for old in sorted({old for _boxes, parts in plans.values() for old, *_ in parts}):
            if old not in flats:
                read, error = self._read_old_shard(inventories, rank, old, step, old_world,
                                                   here)
                if read is None:
                    return None, error
                flats[old] = read
        base_flat = flats[base][0]
        tensors = dict(base_flat.tensors)
        with torch.no_grad():
            for key, (dt, _spec) in templates.items():
                boxes, parts = plans[key]
                local = dt.to_local()
                for old, src, dst in parts:
                    flat, specs = flats[old]
                    found = specs.get(key)
                    source = flat.tensors.get(key)
                    if (found is None or found.box != boxes[old] or source is None
                            or source.dtype != local.dtype):
                        return None, (f"old rank {old}'s shard of {key!r} at step {step} is "
                                      f"{found}, not the box {boxes[old]} of {local.dtype}")
                    local[dst].copy_(source[src])
                tensors[key] = dt
        return unflatten_state(base_flat.tree, tensors), None

    def _read_old_shard(
        self, inventories: list[HostInventory], rank: int, old: int, step: int,
        old_world: int, here: str,
    ) -> tuple[tuple[FlatState, dict[str, ShardSpec]] | None, str | None]:
        """Old rank ``old``'s snapshot of ``step``, checked whole, from this host or fetched
        from the host holding it; with its shard records."""
        found = locate(inventories, old, step, here)
        if found is None:
            return None, f"no reachable copy of old rank {old} at step {step}"
        inv, held = found
        fetched: Path | None = None
        if inv.host == here:
            path = slot_path(self.store, self.run, held)
        else:
            assert inv.address is not None  # locate() skips other hosts without a server
            # Not named slot*.snap: no inventory ever takes it for a snapshot of this rank.
            path = fetched = snapshot_dir(self.store, self.run, rank) / f"fetch-old{old}.part"
            pulled = pull_replica(self.store, self.run, held.rank, inv.address,
                                  seq=held.seq, replica=held.replica, target=path)
            if pulled != step:
                return None, f"could not fetch old rank {old}'s step {step} from {inv.host}"
        try:
            flat, info = read_snapshot_flat(SnapshotFound(path, held.seq, held.step),
                                            run_token=self.run_token)
            if info.get("world") != old_world:
                return None, (f"old rank {old}'s snapshot of step {step} was written by "
                              f"{info.get('world')} ranks, not {old_world}")
            return (flat, specs_from_meta(info)), None
        except (CkptError, OSError) as exc:
            return None, str(exc)
        finally:
            if fetched is not None:
                fetched.unlink(missing_ok=True)

    def _snapshot_root(self) -> str:
        return str(snapshot_dir(self.store, self.run, 0).parent)

    def _read_agreed(self, inventories: list[HostInventory], rank: int, step: int,
                     here: str, into: Any | None) -> tuple[Any, str | None]:
        """This rank's state at ``step`` (and None), or (None, why not)."""
        found = locate(inventories, rank, step, here, replicated=self.replicated)
        if found is None:
            return None, f"no reachable copy of rank {rank} at step {step}"
        inv, held = found
        if inv.host == here:
            path = slot_path(self.store, self.run, held)
        else:
            assert inv.address is not None  # locate() skips other hosts without a server
            # Into this rank's own directory (replicated: it may be another rank's state);
            # its first snapshot removes it.
            path = pulled_slot(self.store, self.run, rank)
            pulled = pull_replica(self.store, self.run, held.rank, inv.address,
                                  seq=held.seq, replica=held.replica, target=path)
            if pulled != step:
                return None, (f"could not fetch rank {held.rank}'s step {step} from "
                              f"{inv.host}")
        try:
            state = read_snapshot(SnapshotFound(path, held.seq, held.step),
                                  run_token=self.run_token, into=into)
        except (CkptError, OSError) as exc:
            return None, str(exc)
        return state, None


def _reshard_plan(
    key: str, spec: ShardSpec, old: ShardSpec | None, old_world: int
) -> tuple[tuple[dict[int, Box], list[tuple[int, Any, Any]]] | None, str]:
    """Every old rank's box of the DTensor ``key`` and the parts of this rank's box
    (``spec``) to copy from them, from an old snapshot's record of it (``old``); or (None,
    why not)."""
    if old is None:
        return None, f"no shards of {key!r}"
    if old.global_shape != spec.global_shape:
        return None, (f"{key!r} was {old.global_shape}, this state's is {spec.global_shape}")
    layout = old.layout or MeshLayout.one_d(old_world)
    if sorted(layout.ranks) != list(range(old_world)):
        return None, f"{key!r} was laid out over ranks {layout.ranks}, not {old_world} ranks"
    try:
        boxes = shard_boxes(old.global_shape, layout)
    except ValueError as exc:
        return None, f"{key!r}: {exc}"
    parts = box_overlaps(spec.box, boxes)
    covered = sum(math.prod(s.stop - s.start for s in dst) for _old, _src, dst in parts)
    if covered != math.prod(spec.sizes):
        return None, f"the old shards of {key!r} do not cover this rank's box {spec.box}"
    return (boxes, parts), ""
