"""Ranks share the reads of the parts no disk of theirs holds (a restore after a node loss).

After a node is lost, its part is read from a survivor that keeps a copy of it
(``replicas = 2``), else from object storage. Left alone, only the ranks that need its
shards (those of the replacement node) would download it, while the survivors read their
own parts from local disk and then wait at the end of the load. Here a survivor holding a
copy reads it from its disk and sends it, and every rank of the load takes a share of the
downloads of what no disk holds, sending what it fetched to the ranks that need it over the
process group, so a lost part comes down at the bandwidth of all the nodes together
instead of one.

Every rank calls :func:`share_remote_reads` from the same ``read_data`` of a ``dcp.load``
and takes part in every collective whatever happens locally (a failed download is
reported, never raised between two collectives), so no rank is left waiting:

1. ``all_gather_object``: each rank's remote chunk files (path, size), its local bytes, the
   parts it holds on disk and those it can read at all;
2. every rank computes the same assignment (:func:`assign`, pure);
3. every rank posts a receive per file it gets from another rank (the index gives each
   file's size), then fetches the files assigned to it, sending each to the ranks that need
   it as soon as it is in (errors caught: a failed fetch sends zeros);
4. each file a rank needs goes to its source
   (:meth:`~ckptstore.ops.tiering.parts.PartsSource.receive`) as soon as it is in, and
   :func:`run_shared` decodes the reads it completes right away: the source checks each
   file like any other read (size, crc32c) and reads its own copies for a damaged one;
5. ``all_gather_object``: the files whose fetch failed; the source drops what was sent in
   their place, and the reads that failed until then run again (from this host's copies,
   or naming the rank that could not fetch the file).

Chunk files of per-tensor arrays, of pack arrays (small tensors) and of non-tensor items
are all shared: a replacement node may need a piece of the survivor's part too. The
received files stay in memory until the load's reads are over: at most the remote share of
this rank's own shards.
"""

from __future__ import annotations

import logging
import threading
import warnings
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ckptstore.errors import CkptError
from ckptstore.format.dcp.chunks import ByteView, flat_chunks
from ckptstore.format.dcp.layout import ArrayInfo, BlobItem, chunk_file
from ckptstore.format.dcp.requests import ReadJob, Request, read_jobs, run_jobs
from ckptstore.ops.tiering.parts import PartsSource

__all__ = [
    "LOCAL_COST", "TRANSFER_COST", "Arrivals", "SharedReads", "assign", "run_shared",
    "share_remote_reads",
]

logger = logging.getLogger(__name__)

#: What reading a byte from local disk costs, relative to downloading it: a rank that reads
#: much of its own part from disk gets a smaller share of the downloads. Disk reads and
#: downloads use different resources and overlap (the disk reads run beside the share), so
#: the weight is small; 0.1 restored a lost part faster than 0.5 (docs/MULTINODE.md).
LOCAL_COST = 0.1

#: What sending a byte to another rank costs, relative to downloading it (a copy out of the
#: sender's memory and one into the receiver's): a download only moves to another rank when
#: that rank has this much less work.
TRANSFER_COST = 0.25

#: Threads that wait for the files other ranks send, one per sending rank up to this many
#: (the files of the others are taken in turn once one of these is free).
_RECEIVERS = 8


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


def assign(needs: Sequence[Mapping[str, int]], local_bytes: Sequence[int],
           held: Sequence[Collection[str]] = (),
           reach: Sequence[Collection[str]] | None = None) -> dict[str, int]:
    """Which rank fetches each remote chunk file: the same answer on every rank.

    A rank's work is its disk reads weighted by :data:`LOCAL_COST`, its downloads, and what
    it sends to other ranks weighted by :data:`TRANSFER_COST`. A file some rank keeps on its
    own disk (a copy of a lost node's part, ``replicas = 2``) is read there and sent, never
    downloaded: largest first, to the holder with the least work. The others are downloaded,
    largest first, each by the rank whose work it raises least (a rank that needs the file
    sends nothing), ties to a rank that needs it, then to the lowest rank: ranks that need
    as much as each other download their own files, and a rank with little to read takes
    over downloads from the others. Only ranks that reach a copy of the file download it;
    a file nobody reaches is left out (the reads that need it fail, naming its part).

    Args:
        needs: Per rank, ``{chunk file: bytes}`` it reads from object storage.
        local_bytes: Per rank, the bytes it reads from local disk.
        held: Per rank, the chunk files of other ranks' needs it holds on local disk
            (missing ranks hold none).
        reach: Per rank, the chunk files it can fetch from some copy (None: every rank
            reaches every file).

    Returns:
        ``{chunk file: rank that fetches it}``, one entry per file any rank needs and some
        rank reaches.
    """
    sizes: dict[str, int] = {}
    needers: dict[str, set[int]] = {}
    for rank, files in enumerate(needs):
        for rel, size in files.items():
            sizes[rel] = size
            needers.setdefault(rel, set()).add(rank)
    holders: dict[str, list[int]] = {}
    for rank, kept in enumerate(held):
        for rel in kept:
            if rel in sizes:
                holders.setdefault(rel, []).append(rank)
    work = [LOCAL_COST * b for b in local_bytes]

    def cost(rank: int, rel: str, per_byte: float) -> float:
        sends = sum(1 for r in needers[rel] if r != rank)
        return (per_byte + TRANSFER_COST * sends) * sizes[rel]

    out: dict[str, int] = {}
    for rel in sorted(holders, key=lambda r: (-sizes[r], r)):
        chosen = min(holders[rel], key=lambda r: (work[r] + cost(r, rel, LOCAL_COST), r))
        work[chosen] += cost(chosen, rel, LOCAL_COST)
        out[rel] = chosen
    for rel in _largest_first(sizes.keys() - holders.keys(), sizes, needers):
        able = [r for r in range(len(work)) if reach is None or rel in reach[r]]
        if not able:
            continue  # each rank that needs it finds no copy and says so
        chosen = min(able,
                     key=lambda r: (work[r] + cost(r, rel, 1.0), r not in needers[rel], r))
        work[chosen] += cost(chosen, rel, 1.0)
        out[rel] = chosen
    return out


def _largest_first(files: Iterable[str], sizes: Mapping[str, int],
                   needers: Mapping[str, set[int]]) -> list[str]:
    """``files`` largest first; files of one size taken from their ranks in turn.

    In turn, not rank after rank: chunk files mostly have one size, and a rank's whole list
    coming first would hand every other file of it to another rank as soon as it was a
    little ahead (a full restore then shipped ~45 % of each part between the ranks).
    """
    seen: dict[tuple[int, int], int] = {}
    keyed = []
    for rel in sorted(files, key=lambda r: (-sizes[r], r)):
        first = min(needers[rel])
        turn = seen.get((first, sizes[rel]), 0)
        seen[(first, sizes[rel])] = turn + 1
        keyed.append(((-sizes[rel], turn, first, rel), rel))
    return [rel for _, rel in sorted(keyed)]


def _remote_of(source: PartsSource, job: ReadJob) -> set[str]:
    """The chunk files of ``job`` no disk of this host holds."""
    files = {chunk_file(array.path, key) for array, key in job.chunks}
    return {rel for rel in files if source.is_remote(rel)}


class Arrivals:
    """Starts each job that reads remote chunk files as soon as all its files are in.

    Files come in while the share goes on (fetched here, or received from another rank), so
    decoding them into their tensors overlaps the transfers instead of following them.
    Until the share is over, a job may fail only because a rank that was to fetch one of its
    files could not and sent zeros in its place: :meth:`settle` runs such jobs again once
    the source knows which fetches failed, and those whose files never came.

    Call order: :meth:`arrived` for each file as it comes in (from any thread), then
    :meth:`settle` once no more will come, or :meth:`cancel` when the share failed.

    Args:
        waits: Each job with the files it waits for.
        pool: Where the jobs run.
    """

    def __init__(self, waits: Sequence[tuple[ReadJob, Collection[str]]],
                 pool: Executor) -> None:
        self._jobs = [job for job, _ in waits]
        self._pool = pool
        self._lock = threading.Lock()
        self._waiting: dict[str, list[int]] = {}
        self._missing: list[int] = []
        for i, (_, files) in enumerate(waits):
            for rel in set(files):
                self._waiting.setdefault(rel, []).append(i)
            self._missing.append(len(set(files)))
        self._started: dict[int, Future[None]] = {}

    def arrived(self, rel: str) -> None:
        """Chunk file ``rel`` is in the source: start the jobs it completes."""
        with self._lock:
            ready = []
            for i in self._waiting.pop(rel, ()):
                self._missing[i] -= 1
                if not self._missing[i]:
                    ready.append(i)
            for i in ready:
                self._started[i] = self._pool.submit(self._jobs[i].run)

    def settle(self, threads: int) -> None:
        """After the share: wait for the jobs started, then run the others and those that
        failed with a :class:`~ckptstore.errors.CkptError`, now raising what they raise.
        """
        again: list[ReadJob] = []
        for i, job in enumerate(self._jobs):
            started = self._started.get(i)
            if started is None:
                again.append(job)
                continue
            try:
                started.result()
            except CkptError:
                again.append(job)
        run_jobs(again, threads)

    def cancel(self) -> None:
        """Cancel the jobs not running yet (the share failed)."""
        for started in self._started.values():
            started.cancel()


def run_shared(source: PartsSource, requests: Sequence[Request], *,
               blobs: Sequence[BlobItem] = (), threads: int, group: Any = None) -> SharedReads:
    """Serve ``requests`` with the remote reads shared among the ranks of ``group``.

    A collective, like :func:`share_remote_reads`. The chunks this host reads from its own
    disk are read meanwhile, so those reads overlap the transfers, and each remote file is
    decoded into its tensors as soon as it is in. The files of ``blobs`` that are remote
    here are shared too and kept, for the caller to read the blobs; call
    ``source.forget_received()`` after that (also when this raises).

    Raises:
        IntegrityError, IncompleteCheckpointError, StorageError: As the reads.
    """
    jobs = read_jobs(source, requests)
    waits = [(job, _remote_of(source, job)) for job in jobs]
    with ThreadPoolExecutor(1, thread_name_prefix="ckpt-share-local") as pool, \
            ThreadPoolExecutor(threads, thread_name_prefix="ckpt-share-read") as reads:
        reading = pool.submit(run_jobs, [job for job, files in waits if not files], threads)
        arrivals = Arrivals([(job, files) for job, files in waits if files], reads)
        try:
            stats = share_remote_reads(source, jobs, blobs=blobs, group=group,
                                       threads=threads, arrived=arrivals.arrived)
            arrivals.settle(threads)
        except BaseException:
            arrivals.cancel()
            raise
        finally:
            reading.result()
    return stats


def _chunk_files(jobs: Sequence[ReadJob], blobs: Sequence[BlobItem],
                 source: PartsSource) -> Iterator[tuple[str, int]]:
    """``(chunk file, stored bytes)`` of every chunk the reads touch (repeats possible)."""
    for job in jobs:
        for array, key in job.chunks:
            yield chunk_file(array.path, key), _stored(array, key)
    for blob in blobs:
        array = source.index.arrays[blob.array]
        for index in flat_chunks(array, blob.at, blob.nbytes):
            yield chunk_file(array.path, str(index)), _stored(array, str(index))


def _stored(array: ArrayInfo, key: str) -> int:
    record = array.chunks.get(key)
    return record[0] if record is not None else 0


def _remote_files(source: PartsSource, jobs: Sequence[ReadJob],
                  blobs: Sequence[BlobItem]) -> tuple[dict[str, int], int]:
    """This rank's ``{remote chunk file: bytes}`` and its local bytes."""
    remote: dict[str, int] = {}
    local: dict[str, int] = {}
    for rel, nbytes in _chunk_files(jobs, blobs, source):
        (remote if source.is_remote(rel) else local)[rel] = nbytes
    return remote, sum(local.values())


def _global(group: Any, rank: int) -> int:
    return rank if group is None else dist.get_global_rank(group, rank)


def _frame(data: bytes | None, size: int) -> torch.Tensor:
    """What to send for one file: its bytes as they are (the process group only reads
    them), or zeros of the size the receiver posted when the fetch failed."""
    if data is None or not size:
        return torch.zeros(size, dtype=torch.uint8)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        return torch.frombuffer(data, dtype=torch.uint8)


def share_remote_reads(source: PartsSource, jobs: Sequence[ReadJob], *,
                       blobs: Sequence[BlobItem] = (), group: Any = None, threads: int = 8,
                       arrived: Callable[[str], None] | None = None) -> SharedReads:
    """Share the remote chunk reads of ``jobs`` among the ranks of ``group``.

    A collective: every rank of ``group`` must call it (with its own jobs, possibly none).
    Afterwards ``source`` holds the files other ranks fetched for this one; call
    ``source.forget_received()`` once they are read.

    Each file goes to the ranks that need it as soon as it is fetched, one message per file
    in the order of the assignment, into buffers the receivers posted beforehand at the
    sizes the index records, so reading, sending and receiving overlap. Each file this rank
    needs is handed to ``source`` as soon as it is in, and ``arrived`` is called with it
    (from another thread): it may still be the zeros a rank sent for a fetch that failed,
    which is known only once this returns (``source`` then knows it too).

    Args:
        source: This rank's source of the parted checkpoint.
        jobs: This rank's reads (:func:`~ckptstore.format.dcp.chunks.read_jobs`).
        blobs: The non-tensor items this rank reads.
        group: The process group of the load (None: the default group).
        threads: Parallel fetches of this rank's share.
        arrived: Called with each remote chunk file this rank needs once it is in.

    Returns:
        What this rank fetched and received.
    """
    me, world = dist.get_rank(group), dist.get_world_size(group)
    remote, local = _remote_files(source, jobs, blobs)
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, (remote, local, sorted(source.parts_on_disk()),
                                      sorted(source.parts_reached())), group=group)
    needs = [g[0] for g in gathered]
    wanted = {rel for files in needs for rel in files}
    held = [{rel for rel in wanted if source.part_of(rel) in g[2]} for g in gathered]
    reach = [{rel for rel in wanted if source.part_of(rel) in g[3]} for g in gathered]
    plan = assign(needs, [g[1] for g in gathered], held, reach)
    mine = sorted(rel for rel, rank in plan.items() if rank == me)
    # Both ends of each pair walk the same files in the same (sorted) order.
    inbound = {peer: sorted(rel for rel in remote if plan.get(rel) == peer)
               for peer in range(world) if peer != me}
    inbound = {peer: rels for peer, rels in inbound.items() if rels}
    sends: list[Any] = []
    buffers: dict[int, torch.Tensor] = {}
    posted: dict[int, list[tuple[str, Any, ByteView]]] = {}
    for peer, rels in inbound.items():
        buffers[peer] = buf = torch.empty(sum(remote[r] for r in rels), dtype=torch.uint8)
        # Views into the receive buffer, not copies: each file is copied once more, into
        # its tensor, by the read that checks it.
        view: ByteView = buf.numpy()
        at = 0
        posted[peer] = []
        for rel in rels:
            posted[peer].append((rel, dist.irecv(buf[at : at + remote[rel]],
                                                 _global(group, peer), group=group),
                                 view[at : at + remote[rel]]))
            at += remote[rel]

    def take(rel: str, frame: bytes | ByteView) -> None:
        source.receive({rel: frame})
        if arrived is not None:
            arrived(rel)

    def receive_from(peer: int) -> None:
        for rel, work, frame in posted[peer]:
            work.wait()
            take(rel, frame)

    def get(rel: str) -> bytes | None:
        try:
            return source.fetch(rel)
        except CkptError as exc:  # reported, not raised: the others are in the collective
            logger.warning("fetching %s for the ranks that need it failed: %s", rel, exc)
            return None

    fetched: dict[str, int] = {}
    failed: list[str] = []
    outgoing: list[torch.Tensor] = []  # alive until every send completed
    with ThreadPoolExecutor(max(1, min(len(posted), _RECEIVERS)),
                            thread_name_prefix="ckpt-share-recv") as receivers:
        receiving = [receivers.submit(receive_from, peer) for peer in posted]
        if mine:
            with ThreadPoolExecutor(max(1, min(threads, len(mine))),
                                    thread_name_prefix="ckpt-share") as pool:
                for rel, data in zip(mine, pool.map(get, mine), strict=True):
                    size = next(n[rel] for n in needs if rel in n)
                    if data is None or len(data) != size:  # not the file the index records
                        failed.append(rel)
                        data = None
                    else:
                        fetched[rel] = len(data)
                        if rel in remote:
                            take(rel, data)
                    for peer in range(world):
                        if peer != me and rel in needs[peer]:
                            outgoing.append(_frame(data, size))
                            sends.append(dist.isend(outgoing[-1], _global(group, peer),
                                                    group=group))
        for work in sends:
            if work is not None:
                work.wait()
        for done in receiving:
            done.result()
    # Which sends carried no file (a failed fetch): their receivers read their own copies.
    failures: list[Any] = [None] * world
    dist.all_gather_object(failures, failed, group=group)
    lost = {rel for f in failures for rel in f}
    source.receive({}, failed=[rel for rel in remote if rel in lost])
    for_others = [rel for rel in fetched if any(rel in needs[p] for p in range(world) if p != me)]
    stats = SharedReads(
        fetched=len(for_others), fetched_bytes=sum(fetched[r] for r in for_others),
        sent_bytes=sum(int(b.numel()) for b in outgoing),
        received=sum(len(rels) for rels in inbound.values()),
        received_bytes=sum(int(b.numel()) for b in buffers.values()),
    )
    logger.info("shared remote reads: rank %d fetched %d chunk files (%d bytes) for other "
                "ranks, sent %d bytes and received %d (%d bytes)", me, stats.fetched,
                stats.fetched_bytes, stats.sent_bytes, stats.received, stats.received_bytes)
    return stats
