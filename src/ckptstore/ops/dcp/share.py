"""Ranks share the download of the parts no local disk holds (a restore after a node loss).

After a node is lost, its part is read from object storage. Left alone, only the ranks that
need its shards (those of the replacement node) download it, while the survivors read
their own parts from local disk and then wait at the end of the load. Here every rank of
the load takes a share of those downloads and sends what it fetched to the ranks that need
it over the process group, so a lost part comes down at the bandwidth of all the nodes
together instead of one.

Every rank calls :func:`share_remote_reads` from the same ``read_data`` of a ``dcp.load``
and takes part in every collective whatever happens locally (a failed download is
reported, never raised between two collectives), so no rank is left waiting:

1. ``all_gather_object``: each rank's remote chunk files (path, size) and its local bytes;
2. every rank computes the same assignment (:func:`assign`, pure);
3. each rank fetches the files assigned to it (errors caught);
4. ``all_gather_object``: the sizes of what each rank fetched;
5. one message per (sender, receiver) pair holding the files end to end. The receiver hands
   them to its source (:meth:`~ckptstore.ops.parts.PartsSource.receive`), which checks each
   like any other read (size, crc32c, blake3) and reads its own copies when one fails.

The received files stay in memory until the read that needs them is over: at most the
remote share of this rank's own shards.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ckptstore.errors import CkptError
from ckptstore.format.dcp.chunks import Request, run_requests
from ckptstore.format.dcp.layout import chunk_file
from ckptstore.ops.parts import PartsSource

__all__ = ["LOCAL_COST", "SharedReads", "assign", "run_shared", "share_remote_reads"]

logger = logging.getLogger(__name__)

#: What reading a byte from local disk costs, relative to downloading it: a rank that reads
#: much of its own part from disk gets a smaller share of the downloads.
LOCAL_COST = 0.5


@dataclass(frozen=True)
class SharedReads:
    """What one rank did in a shared read.

    Attributes:
        fetched: Chunk files this rank downloaded for other ranks.
        fetched_bytes: Their bytes.
        sent_bytes: Bytes sent to other ranks (a file two ranks need is sent twice).
        received: Chunk files other ranks downloaded for this one.
        received_bytes: Their bytes.
    """

    fetched: int = 0
    fetched_bytes: int = 0
    sent_bytes: int = 0
    received: int = 0
    received_bytes: int = 0


def assign(needs: Sequence[Mapping[str, int]], local_bytes: Sequence[int]) -> dict[str, int]:
    """Which rank downloads each remote chunk file: the same answer on every rank.

    Largest files first, each goes to the rank with the least work so far (its local bytes
    weighted by :data:`LOCAL_COST`, plus what it was given), a rank that needs the file
    winning a tie (no transfer), then the lowest rank.

    Args:
        needs: Per rank, ``{chunk file: bytes}`` it reads from object storage.
        local_bytes: Per rank, the bytes it reads from local disk.

    Returns:
        ``{chunk file: rank that downloads it}``, one entry per file any rank needs.
    """
    sizes: dict[str, int] = {}
    needers: dict[str, set[int]] = {}
    for rank, files in enumerate(needs):
        for rel, size in files.items():
            sizes[rel] = size
            needers.setdefault(rel, set()).add(rank)
    work = [LOCAL_COST * b for b in local_bytes]
    out: dict[str, int] = {}
    for rel in sorted(sizes, key=lambda r: (-sizes[r], r)):
        chosen = min(range(len(work)),
                     key=lambda r: (work[r] + sizes[rel], r not in needers[rel], r))
        work[chosen] += sizes[rel]
        out[rel] = chosen
    return out


def _local(source: PartsSource, req: Request) -> bool:
    key = req.box.key
    return key is not None and not source.is_remote(chunk_file(req.box.array.path, key))


def run_shared(source: PartsSource, requests: Sequence[Request], *, threads: int,
               group: Any = None) -> SharedReads:
    """Serve ``requests`` with the remote downloads shared among the ranks of ``group``.

    A collective, like :func:`share_remote_reads`. The chunks this host reads from its own
    disk are read meanwhile, so those reads overlap the downloads; the others once the
    shared files are in.

    Raises:
        IntegrityError, IncompleteCheckpointError, StorageError: As the reads.
    """
    local: list[Request] = []
    rest: list[Request] = []
    for req in requests:
        (local if _local(source, req) else rest).append(req)
    with ThreadPoolExecutor(1, thread_name_prefix="ckpt-share-local") as pool:
        reading = pool.submit(run_requests, source, local, threads)
        try:
            stats = share_remote_reads(source, requests, group=group, threads=threads)
            run_requests(source, rest, threads)
        finally:
            source.forget_received()
        reading.result()
    return stats


def _remote_files(source: PartsSource, requests: Sequence[Request]) -> tuple[dict[str, int], int]:
    """This rank's ``{remote chunk file: bytes}`` and its local bytes."""
    remote: dict[str, int] = {}
    local = 0
    for req in requests:
        key = req.box.key
        if key is None or any(n == 0 for n in req.lengths):
            continue  # packed small tensors: read where they are needed
        rel = chunk_file(req.box.array.path, key)
        nbytes = req.box.array.chunks[key][0] if key in req.box.array.chunks else 0
        if source.is_remote(rel):
            remote[rel] = nbytes
        else:
            local += nbytes
    return remote, local


def _global(group: Any, rank: int) -> int:
    return rank if group is None else dist.get_global_rank(group, rank)


def share_remote_reads(source: PartsSource, requests: Sequence[Request], *, group: Any = None,
                       threads: int = 8) -> SharedReads:
    """Share the remote chunk downloads of ``requests`` among the ranks of ``group``.

    A collective: every rank of ``group`` must call it (with its own requests, possibly
    none). Afterwards ``source`` holds the files other ranks fetched for this one; call
    ``source.forget_received()`` once they are read.

    Args:
        source: This rank's source of the parted checkpoint.
        requests: This rank's reads.
        group: The process group of the load (None: the default group).
        threads: Parallel downloads of this rank's share.

    Returns:
        What this rank fetched and received.
    """
    me, world = dist.get_rank(group), dist.get_world_size(group)
    remote, local = _remote_files(source, requests)
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, (remote, local), group=group)
    needs = [g[0] for g in gathered]
    plan = assign(needs, [g[1] for g in gathered])
    mine = sorted(rel for rel, rank in plan.items() if rank == me)

    def get(rel: str) -> tuple[str, bytes | None]:
        try:
            return rel, source.fetch(rel)
        except CkptError as exc:  # reported, not raised: the others are in the collective
            logger.warning("fetching %s for the ranks that need it failed: %s", rel, exc)
            return rel, None

    if mine:
        with ThreadPoolExecutor(max(1, min(threads, len(mine))),
                                thread_name_prefix="ckpt-share") as pool:
            fetched = {rel: data for rel, data in pool.map(get, mine) if data is not None}
    else:
        fetched = {}
    sizes: list[Any] = [None] * world
    dist.all_gather_object(sizes, {rel: len(data) for rel, data in fetched.items()},
                           group=group)
    works: list[Any] = []
    outgoing: list[torch.Tensor] = []  # alive until every send completed
    for_others = {rel for rel in fetched
                  if any(rel in needs[p] for p in range(world) if p != me)}
    for peer in range(world):
        out = [rel for rel in sorted(fetched) if rel in needs[peer]]
        if peer != me and out:
            outgoing.append(torch.frombuffer(bytearray(b"".join(fetched[r] for r in out)),
                                             dtype=torch.uint8))
            works.append(dist.isend(outgoing[-1], _global(group, peer), group=group))
    inbound = {peer: [rel for rel in sorted(sizes[peer]) if rel in remote]
               for peer in range(world) if peer != me}
    buffers: dict[int, torch.Tensor] = {}
    for peer, rels in inbound.items():
        if rels:
            buffers[peer] = torch.empty(sum(sizes[peer][r] for r in rels), dtype=torch.uint8)
            works.append(dist.irecv(buffers[peer], _global(group, peer), group=group))
    for work in works:
        if work is not None:
            work.wait()
    received = {rel: fetched[rel] for rel in remote if rel in fetched}
    for peer, buf in buffers.items():
        data = buf.numpy().tobytes()
        at = 0
        for rel in inbound[peer]:
            received[rel] = data[at : at + sizes[peer][rel]]
            at += sizes[peer][rel]
    source.receive(received)
    stats = SharedReads(
        fetched=len(for_others), fetched_bytes=sum(len(fetched[r]) for r in for_others),
        sent_bytes=sum(int(b.numel()) for b in outgoing),
        received=sum(len(inbound[p]) for p in buffers),
        received_bytes=sum(int(b.numel()) for b in buffers.values()),
    )
    logger.info("shared remote reads: rank %d fetched %d chunk files (%d bytes) for other "
                "ranks, sent %d bytes and received %d (%d bytes)", me, stats.fetched,
                stats.fetched_bytes, stats.sent_bytes, stats.received, stats.received_bytes)
    return stats
