"""Peer replication (``replicas = 2``): each host also keeps its neighbour host's part.

After a parted save commits, each host's lowest rank (its *leader*) sends the files of its
host's part to the next host's leader (hosts in name order, the last sends to the first) and
receives the previous host's part, over a gloo group of the leaders created collectively at
save time and reused by later saves. The transfer runs on two background threads per leader
(one sends, one receives, one file at a time: memory stays bounded by the largest file), off
the training path: ``save_distributed`` returns as soon as it has started them. The receiver
checks every file against the manifest (size, crc32c of chunk files) before recording the
copy in the catalog (``replica_parts``: the part, stored on the receiving host), so a node
that is lost is recovered from its peer's disk without touching object storage, at any
world size (the reader reshards).

This is what NVIDIA's resiliency extension does for local checkpoints; here the catalog
knows where every copy is, and loads fall back per chunk to object storage.
"""

from __future__ import annotations

import datetime
import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import crc32c as _crc32c
import torch
import torch.distributed as dist

from ckptstore.core import StoreCore, StoreService
from ckptstore.durable import fsync_dir, write_new_file
from ckptstore.errors import CkptError, IntegrityError
from ckptstore.format import Manifest
from ckptstore.format.codecs import TRAILER
from ckptstore.format.dcp.layout import rank_of_file
from ckptstore.identity import host
from ckptstore.ops.dcp.parts import PartTask
from ckptstore.ops.tiering.parts import part_files
from ckptstore.records import Checkpoint, ReplicaState

__all__ = ["PEER_TIMEOUT_S", "PeerReplication", "peers_for", "replicate_parts"]

logger = logging.getLogger(__name__)

#: Longest a peer transfer may take (the gloo group's timeout); also how long closing the
#: store waits for one still running.
PEER_TIMEOUT_S = 600.0


class PeerReplication(StoreService):
    """The background work of the store's saves across hosts: writing each host's manifest
    copy, and the peer transfers (the leaders' gloo groups and the threads using them)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self._groups: dict[tuple[int, ...], Any] = {}
        self.errors: list[str] = []

    def group(self, leaders: tuple[int, ...]) -> Any:
        """The gloo group of these leaders (global ranks); collective on first use."""
        found = self._groups.get(leaders)
        if found is None:
            found = dist.new_group(
                ranks=list(leaders), backend="gloo",
                timeout=datetime.timedelta(seconds=PEER_TIMEOUT_S),
            )
            self._groups[leaders] = found
        return found

    def start(self, name: str, target: Callable[[], object]) -> None:
        """Run ``target`` on a daemon thread (errors are logged and kept in :attr:`errors`)."""

        def run() -> None:
            try:
                target()
            except Exception as exc:  # reported, never raised into training
                message = f"{name}: {type(exc).__name__}: {exc}"
                logger.warning("peer replication failed: %s", message)
                with self._lock:
                    self.errors.append(message)

        thread = threading.Thread(target=run, name=f"ckpt-peer-{name}", daemon=True)
        with self._lock:
            self._threads.append(thread)
        thread.start()

    def wait(self, timeout: float = PEER_TIMEOUT_S) -> bool:
        """Wait for every transfer started so far; False if one is still running."""
        deadline = time.monotonic() + timeout
        with self._lock:
            threads = list(self._threads)
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        with self._lock:
            self._threads = [t for t in self._threads if t.is_alive()]
            return not self._threads

    def close(self) -> None:
        """Wait (bounded) for the transfers still running; the store closes after them."""
        if not self.wait():
            logger.warning("a peer transfer is still running after %.0fs; not waiting longer",
                           PEER_TIMEOUT_S)


def peers_for(store: StoreCore) -> PeerReplication:
    """The store's :class:`PeerReplication` (created on first use)."""
    if not isinstance(store.peers, PeerReplication):
        store.peers = PeerReplication()
    return store.peers


def _leaders(part: PartTask) -> list[tuple[str, int]]:
    """``(host, leader's rank in the save's group)``, hosts in name order."""
    return sorted((h, min(r for r, x in enumerate(part.hosts) if x == h))
                  for h in set(part.hosts))


def replicate_parts(
    store: StoreCore, ck: Checkpoint, manifest: Manifest, part: PartTask, group: Any
) -> None:
    """Send this host's part to the next host and take the previous host's (``replicas=2``).

    Collective over the save's process group (every rank calls it after the save; the
    leaders' group is created on first use). Returns at once: the transfers run on
    background threads; the next save, and ``store.close()``, wait for them.

    Args:
        store: The store.
        ck: The committed parted checkpoint.
        manifest: Its manifest (this host's part already has it on disk).
        part: This rank's :class:`~ckptstore.ops.dcp.parts.PartTask` from the save.
        group: The save's process group (None: the default group).
    """
    leaders = _leaders(part)
    if len(leaders) < 2:
        return
    # save_distributed waited for the previous save's transfers before this save began.
    service = peers_for(store)

    def global_rank(rank: int) -> int:
        return dist.get_global_rank(group, rank) if group is not None else rank

    ranks = tuple(global_rank(r) for _, r in leaders)
    sub = service.group(ranks)
    if not part.leader:
        return
    hosts = [h for h, _ in leaders]
    me = host()
    i = hosts.index(me)
    nxt, prev = (i + 1) % len(hosts), (i - 1) % len(hosts)
    mine = [r for r, h in enumerate(part.hosts) if h == me]
    theirs = [r for r, h in enumerate(part.hosts) if h == hosts[prev]]
    directory = store.checkpoint_dir(ck.run, ck.id)
    service.start("send", lambda: _send(directory, manifest, mine, ranks[nxt], sub))
    service.start("receive", lambda: _receive(store, ck, directory, manifest, hosts[prev],
                                              theirs, ranks[prev], sub))


def _send(directory: Path, manifest: Manifest, ranks: list[int], dst: int, group: Any) -> None:
    files = part_files(manifest, ranks)
    dist.send(torch.tensor([len(files)], dtype=torch.int64), dst, group=group)
    started, sent = time.perf_counter(), 0
    for rel, _size in files:
        path = rel.encode()
        try:
            data = (directory / rel).read_bytes()
        except OSError as exc:
            # Tell the receiver this file is missing; it then records no copy.
            logger.warning("peer replication: cannot read %s: %s", directory / rel, exc)
            dist.send(torch.tensor([len(path), -1], dtype=torch.int64), dst, group=group)
            continue
        dist.send(torch.tensor([len(path), len(data)], dtype=torch.int64), dst, group=group)
        dist.send(torch.frombuffer(bytearray(path + data), dtype=torch.uint8), dst, group=group)
        sent += len(data)
    logger.info("sent %d files (%d bytes) of this host's part to rank %d in %.1fs", len(files),
                sent, dst, time.perf_counter() - started)


def _expected(manifest: Manifest) -> dict[str, tuple[int, int | None]]:
    assert manifest.dcp is not None
    out: dict[str, tuple[int, int | None]] = {f.path: (f.nbytes, None) for f in manifest.files}
    out.update({rel: (size, crc) for rel, size, crc in manifest.dcp.files()})
    return out


def _check(rel: str, data: bytes, expected: tuple[int, int | None] | None,
           ranks: set[int]) -> str | None:
    if expected is None or rank_of_file(rel) not in ranks:
        return "is not a file of this part"
    size, crc = expected
    if len(data) != size:
        return f"is {len(data)} bytes, the manifest records {size}"
    if crc is not None:
        body = int(_crc32c.crc32c(data[: -TRAILER.size]))
        if body != crc or TRAILER.unpack(data[-TRAILER.size:])[0] != crc:
            return f"fails its crc32c ({body:#010x}, the manifest records {crc:#010x})"
    return None


def _receive(store: StoreCore, ck: Checkpoint, directory: Path, manifest: Manifest,
             peer: str, ranks: list[int], src: int, group: Any) -> None:
    me = host()
    store.catalog.set_part(ck.id, "hot", peer, stored_on=me, state=ReplicaState.COPYING)
    count = torch.zeros(1, dtype=torch.int64)
    dist.recv(count, src, group=group)
    expected = _expected(manifest)
    wanted = set(ranks)
    written: list[Path] = []
    problems: list[str] = []
    total = 0
    try:
        for _ in range(int(count.item())):
            header = torch.zeros(2, dtype=torch.int64)
            dist.recv(header, src, group=group)
            path_len, size = (int(x) for x in header.tolist())
            if size < 0:
                problems.append("the sender could not read a file")
                continue
            payload = torch.empty(path_len + size, dtype=torch.uint8)
            dist.recv(payload, src, group=group)
            raw = payload.numpy().tobytes()
            rel, data = raw[:path_len].decode(), raw[path_len:]
            problem = _check(rel, data, expected.get(rel), wanted)
            if problem is not None:
                problems.append(f"{rel} {problem}")
                continue
            target = directory / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            if target.exists():
                target.unlink()  # what an earlier, interrupted transfer left
            write_new_file(target, data)
            written.append(target)
            total += len(data)
        for folder in sorted({p.parent for p in written}):
            fsync_dir(folder)
    except (OSError, RuntimeError, CkptError) as exc:
        problems.append(f"{type(exc).__name__}: {exc}")
    if problems:
        for path in written:
            path.unlink(missing_ok=True)
        store.catalog.set_part(ck.id, "hot", peer, stored_on=me, state=ReplicaState.DELETED,
                               bytes=0, files=0)
        raise IntegrityError(
            f"the copy of host {peer}'s part of {ck.ref} was not kept on {me}: "
            + "; ".join(problems[:5])
        )
    store.catalog.set_part(ck.id, "hot", peer, stored_on=me, state=ReplicaState.PRESENT,
                           bytes=total, files=len(written), verified=True)
    logger.info("keeping host %s's part of %s on %s (%d files, %d bytes)", peer, ck.ref, me,
                len(written), total)

