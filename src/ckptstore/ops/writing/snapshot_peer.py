"""Peer replicas of snapshots: each node's newest snapshot also in a neighbour's memory.

With ``replicas=2`` a training process sends every committed snapshot slot
(:mod:`ckptstore.ops.writing.snapshot`) to a neighbour node over a TCP socket of the store's
own (loopback in tests), asynchronously: a sender thread sends the newest committed snapshot
and, when a newer one is committed meanwhile, the newer one next (intermediate ones are
skipped). Before the next snapshot is taken, the manager waits (:meth:`SnapshotReplicator.
wait_sent`, bounded) until the neighbour acknowledged the previous one, so a node loss costs
at most one snapshot interval; on a link that keeps up with the steps that wait is zero, and a
neighbour that hangs costs one bounded wait, not one per step. The neighbour's
:class:`SnapshotReplicaServer` keeps two replica slots per (run, rank), with the same
complete-or-invisible rule as local slots: the received bytes land under an invalidated
header, and the header is written only when the sender confirms that the slot did not change
while it was sent. After the loss of a node, the replacement pulls the newest replica back
(:func:`pull_replica`) into its own slot directory, and the normal restart path reads it.

Wire format, one message each way per operation: ``b"CKRP"``, a 4-byte big-endian length, a
JSON object; ``put`` and ``get`` replies are followed by raw slot bytes.

* ``{"op": "put", "run", "rank", "size", "seq"}`` + ``size - 4096`` bytes (the slot after its
  header page), then ``{"op": "commit", "header": hex}`` or ``{"op": "abort"}``; the server
  answers ``{"ok": true}`` or ``{"ok": false, "error": ...}``.
* ``{"op": "get", "run", "rank"}``; the server answers ``{"ok": true, "size": n}`` + the slot
  (header included), or ``{"ok": false, "error": ...}``.

* ``get`` may name a ``"seq"`` (the snapshot the ranks agreed on) and ``"replica": false``
  (the host's own slots of that rank: after a relaunch the rank may run on another node).

Who sends to whom in a ``torch.distributed`` job (a ring over nodes, one server per node,
addresses exchanged through the process group) and the step every rank resumes at are
:mod:`ckptstore.ops.writing.snapshot_world`'s; with ``peer=`` the caller names the server.

Not built: sending the bytes over the process group itself (it carries only addresses and
inventories), more than one neighbour, and resuming a sharded state at another world size
(a replica is the rank's own shards as flat tensors; resharding them needs each shard's place
in its global tensor, which the DCP layout records and a snapshot does not). A replicated
state resumes at any world size (``CheckpointManager(..., replicated=True)``).
"""

from __future__ import annotations

import json
import logging
import os
import socket
import struct
import threading
from pathlib import Path
from typing import Any

from ckptstore.core import StoreCore
from ckptstore.errors import CkptError, ConfigError, StorageError
from ckptstore.ops.writing.snapshot import (
    HEADER_BYTES,
    committed_slots,
    parse_header,
    snapshot_dir,
)

__all__ = [
    "SnapshotReplicaServer",
    "SnapshotReplicator",
    "parse_address",
    "pull_replica",
    "pulled_slot",
    "replica_dir",
]

logger = logging.getLogger(__name__)

_MAGIC = b"CKRP"
_FRAME = struct.Struct("!4sI")
_CHUNK = 8 * 1024**2
_MAX_JSON = 1024**2
_REPLICA_SLOTS = 2
#: How long the next snapshot waits for the neighbour's acknowledgement of the previous one.
_WAIT_S = 10.0


def parse_address(address: str) -> tuple[str, int]:
    """``"host:port"`` as a socket address.

    Raises:
        ConfigError: If it is not ``host:port``.
    """
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"a peer address must be host:port, got {address!r}")
    return host.strip("[]"), int(port)


def replica_dir(store: StoreCore, run: str, rank: int) -> Path:
    """Where this host keeps a neighbour's replica of ``run``'s rank ``rank``."""
    return snapshot_dir(store, run, rank).parent / f"replica{rank}"


def _send_json(sock: socket.socket, obj: dict[str, Any]) -> None:
    raw = json.dumps(obj).encode("utf-8")
    sock.sendall(_FRAME.pack(_MAGIC, len(raw)) + raw)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    parts: list[bytes] = []
    left = n
    while left:
        got = sock.recv(min(left, _CHUNK))
        if not got:
            raise ConnectionError("the peer closed the connection")
        parts.append(got)
        left -= len(got)
    return b"".join(parts)


def _recv_to_file(sock: socket.socket, fd: int, offset: int, end: int) -> None:
    """Receive ``end - offset`` bytes into the file ``fd`` at ``offset`` (``fd`` -1: drop
    them), through one reused buffer."""
    buf = bytearray(min(_CHUNK, max(end - offset, 1)))
    with memoryview(buf) as view:
        while offset < end:
            n = sock.recv_into(view[: min(len(buf), end - offset)])
            if not n:
                raise ConnectionError("the peer closed the connection")
            if fd >= 0:
                os.pwrite(fd, view[:n], offset)
            offset += n


def _recv_json(sock: socket.socket) -> dict[str, Any]:
    magic, size = _FRAME.unpack(_recv_exact(sock, _FRAME.size))
    if magic != _MAGIC or size > _MAX_JSON:
        raise ConnectionError("not a ckptstore replica message")
    obj = json.loads(_recv_exact(sock, size))
    if not isinstance(obj, dict):
        raise ConnectionError("malformed replica message")
    return obj


def _slots_by_seq(directory: Path) -> list[tuple[Path, int]]:
    """The committed slot files in ``directory`` and their sequence numbers."""
    return [(found.path, found.seq) for found in committed_slots(directory)]


def _newest_slot(directory: Path) -> tuple[Path, int] | None:
    return max(_slots_by_seq(directory), key=lambda found: found[1], default=None)


class SnapshotReplicaServer:
    """Keeps neighbours' snapshot replicas in this host's shared memory.

    Lifecycle: create (binds and starts serving) → :meth:`close`. One thread per
    connection; a (run, rank)'s replicas are written under a lock of their own.

    Attributes:
        address: ``(host, port)`` it listens on.
        budget_bytes: Most bytes one (run, rank)'s replica slots may take (None: no limit).
    """

    def __init__(self, store: StoreCore, host: str = "127.0.0.1", port: int = 0, *,
                 budget_bytes: int | None = None) -> None:
        """Bind and start serving.

        Raises:
            StorageError: If the address cannot be bound.
        """
        self.store = store
        self.budget_bytes = budget_bytes
        try:
            self._sock = socket.create_server((host, port))
        except OSError as exc:
            raise StorageError(f"cannot listen for snapshot replicas on {host}:{port}: {exc}"
                               ) from exc
        self.address: tuple[str, int] = self._sock.getsockname()[:2]
        self._locks: dict[tuple[str, int], threading.Lock] = {}
        self._guard = threading.Lock()
        self._closed = False
        self._thread = threading.Thread(target=self._accept, name="ckptstore-replica-server",
                                        daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop accepting; replicas stay in shared memory."""
        self._closed = True
        try:
            # close() alone does not wake a thread blocked in accept() on Linux: the join
            # below then always ran out its 5 s. shutdown() makes that accept() fail now.
            try:
                self._sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass  # not connected / already shut (other platforms): close() still runs
            self._sock.close()
        finally:
            self._thread.join(timeout=5)

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True,
                             name="ckptstore-replica-conn").start()

    def _lock(self, run: str, rank: int) -> threading.Lock:
        with self._guard:
            return self._locks.setdefault((run, rank), threading.Lock())

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            while True:
                try:
                    request = _recv_json(conn)
                except (ConnectionError, OSError, ValueError):
                    return
                try:
                    run, rank = str(request["run"]), int(request["rank"])
                    if "/" in run or run.startswith(".") or rank < 0:
                        raise CkptError(f"bad replica name {run!r}/{rank!r}")
                    with self._lock(run, rank):
                        if request.get("op") == "put":
                            self._put(conn, run, rank, int(request["size"]))
                        elif request.get("op") == "get":
                            seq = request.get("seq")
                            self._get(conn, run, rank, None if seq is None else int(seq),
                                      bool(request.get("replica", True)))
                        else:
                            raise CkptError(f"unknown replica operation {request.get('op')!r}")
                except (ConnectionError, OSError) as exc:
                    logger.info("snapshot replica connection ended: %s", exc)
                    return
                except (CkptError, KeyError, TypeError, ValueError) as exc:
                    try:
                        _send_json(conn, {"ok": False, "error": str(exc)})
                    except OSError:
                        return

    def _put(self, conn: socket.socket, run: str, rank: int, size: int) -> None:
        directory = replica_dir(self.store, run, rank)
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        if size <= HEADER_BYTES:
            raise CkptError(f"a replica of {size} bytes is too small")
        refuse = (self.budget_bytes is not None
                  and _REPLICA_SLOTS * size > self.budget_bytes)
        newest = _newest_slot(directory)
        slots = [directory / f"slot{i}.snap" for i in range(_REPLICA_SLOTS)]
        target = next((p for p in slots if newest is None or p != newest[0]), slots[0])
        fd = -1
        if not refuse:
            fd = os.open(target, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            if fd >= 0:
                os.pwrite(fd, b"\0" * HEADER_BYTES, 0)  # invisible from here on
                os.ftruncate(fd, size)
            _recv_to_file(conn, fd, HEADER_BYTES, size)  # read whole even when refused
            done = _recv_json(conn)
            if refuse:
                raise CkptError(
                    f"a replica of {run} rank {rank} needs {_REPLICA_SLOTS} x {size} bytes, "
                    f"over this node's replica budget of {self.budget_bytes} bytes")
            if done.get("op") != "commit":
                _send_json(conn, {"ok": False, "error": "aborted by the sender"})
                return
            header = bytes.fromhex(str(done["header"]))
            if parse_header(header) is None:
                raise CkptError("the replica's header is not a committed header")
            os.pwrite(fd, header, 0)  # the commit word, last
        finally:
            if fd >= 0:
                os.close(fd)
        _send_json(conn, {"ok": True})

    def _get(self, conn: socket.socket, run: str, rank: int, seq: int | None,
             replica: bool) -> None:
        directory = (replica_dir(self.store, run, rank) if replica
                     else snapshot_dir(self.store, run, rank))
        if seq is None:
            newest = _newest_slot(directory)
        else:  # one snapshot the ranks agreed on (ops/writing/snapshot_world.py)
            newest = next((found for found in _slots_by_seq(directory) if found[1] == seq),
                          None)
        if newest is None:
            kind = "replica" if replica else "snapshot"
            wanted = "" if seq is None else f" with sequence number {seq}"
            raise CkptError(f"this node holds no {kind} of {run} rank {rank}{wanted}")
        with open(newest[0], "rb", buffering=0) as fh:
            size = os.fstat(fh.fileno()).st_size
            _send_json(conn, {"ok": True, "size": size})
            conn.sendfile(fh, 0, size)  # zero-copy from shared memory


class SnapshotReplicator:
    """Sends committed snapshot slots to a neighbour's :class:`SnapshotReplicaServer`.

    :meth:`offer` (from the snapshot worker, after each commit) never blocks: the sender
    thread sends the newest offered slot, skipping older ones it did not get to.
    :meth:`wait_sent` (from the training loop, before the next snapshot) waits for it.

    Attributes:
        address: The neighbour's ``(host, port)``.
        sent: Snapshots replicated so far (by the neighbour's acknowledgement).
        last_error: The last failure, or None.
        wait_s: Most seconds :meth:`wait_sent` waits for one send.
    """

    def __init__(self, address: tuple[str, int], run: str, rank: int) -> None:
        """Prepare the sender (it connects on the first offer)."""
        self.address = address
        self.run = run
        self.rank = rank
        self.sent = 0
        self.sent_step: int | None = None
        self.last_error: str | None = None
        self.wait_s = _WAIT_S
        self._cond = threading.Condition()
        self._offer: tuple[Path, int, int] | None = None
        self._busy = False
        self._closed = False
        self._attempts = 0  # sends finished (acknowledged or failed)
        self._stuck_at: int | None = None  # _attempts when a wait_sent last timed out
        self._sock: socket.socket | None = None
        self._thread = threading.Thread(target=self._run, name="ckptstore-replicator",
                                        daemon=True)
        self._thread.start()

    def offer(self, path: Path, seq: int, step: int) -> None:
        """Replicate the slot at ``path`` (committed with ``seq``) when the sender is free."""
        with self._cond:
            self._offer = (path, seq, step)
            self._cond.notify_all()

    def flush(self, timeout: float = 30.0) -> bool:
        """Wait until every offered snapshot was sent (or skipped); return whether idle."""
        with self._cond:
            return self._cond.wait_for(lambda: self._offer is None and not self._busy,
                                       timeout=timeout)

    def wait_sent(self) -> bool:
        """Wait until the offered snapshot was sent (or its send failed); return whether so.

        Bounds what a node loss costs: called before the next snapshot, it keeps the
        neighbour at most one snapshot behind. A send still running after :attr:`wait_s` (a
        hung neighbour) is logged once and not waited for again until it ends, so training
        then goes on at its own pace with a staler replica.
        """
        timeout = self.wait_s
        with self._cond:
            if self._stuck_at is not None:
                if self._attempts == self._stuck_at:
                    return False
                self._stuck_at = None
            if self._cond.wait_for(lambda: self._offer is None and not self._busy,
                                   timeout=timeout):
                return True
            self._stuck_at = self._attempts
        logger.warning("the snapshot replica of %s to %s:%s is still being sent after %.0fs: "
                       "training goes on without waiting for it", self.run, *self.address,
                       timeout)
        return False

    def close(self) -> None:
        """Send what is offered (bounded wait), then stop."""
        self.flush()
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout=5)
        if self._sock is not None:
            self._sock.close()

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._offer is not None or self._closed)
                if self._offer is None:
                    return
                item, self._offer = self._offer, None
                self._busy = True
            try:
                self._send(*item)
            except (OSError, ConnectionError, CkptError, ValueError) as exc:
                self.last_error = str(exc)
                logger.warning("could not replicate the snapshot of %s to %s:%s: %s",
                               self.run, *self.address, exc)
                if self._sock is not None:
                    self._sock.close()
                    self._sock = None
            finally:
                with self._cond:
                    self._busy = False
                    self._attempts += 1
                    self._cond.notify_all()

    def _send(self, path: Path, seq: int, step: int) -> None:
        if self._sock is None:
            self._sock = socket.create_connection(self.address, timeout=60)
        sock = self._sock
        with open(path, "rb", buffering=0) as fh:
            before = fh.read(HEADER_BYTES)
            parsed = parse_header(before)
            if parsed is None or parsed[0] != seq:
                return  # rewritten already: a newer one will be offered
            size = os.fstat(fh.fileno()).st_size
            _send_json(sock, {"op": "put", "run": self.run, "rank": self.rank, "size": size,
                              "seq": seq})
            # Zero-copy from shared memory to the socket: the training host's CPU is spared.
            sent = sock.sendfile(fh, HEADER_BYTES, size - HEADER_BYTES)
            if sent != size - HEADER_BYTES:
                raise ConnectionError(f"{path} shrank while it was sent")
            after = os.pread(fh.fileno(), HEADER_BYTES, 0)
        # Seqlock: what was sent is the committed snapshot only if the header did not move.
        if after == before:
            _send_json(sock, {"op": "commit", "header": before[:64].hex()})
        else:
            _send_json(sock, {"op": "abort"})
        reply = _recv_json(sock)
        if after == before and not reply.get("ok"):
            raise CkptError(str(reply.get("error")))
        if after == before:
            self.sent += 1
            self.sent_step = step


def pulled_slot(store: StoreCore, run: str, rank: int) -> Path:
    """The slot file :func:`pull_replica` writes (the rank's next snapshot removes it)."""
    return snapshot_dir(store, run, rank) / "slot-replica.snap"


def pull_replica(store: StoreCore, run: str, rank: int, address: tuple[str, int], *,
                 seq: int | None = None, replica: bool = True,
                 target: Path | None = None) -> int | None:
    """Fetch the neighbour's newest replica of ``run``'s rank into this host's slots.

    The bytes are written to a new slot file (:func:`pulled_slot`) under an invalid header
    and the header last, so the normal restart path
    (:func:`~ckptstore.ops.reading.load.load_latest_snapshot`) then finds and checks it like
    a local snapshot.

    Args:
        store: The open store.
        run: Run name.
        rank: The rank whose state is fetched.
        address: The server holding it.
        seq: Fetch the slot with this sequence number instead of the newest.
        replica: From the server's replicas (True) or its host's own slots of ``rank``
            (False: the rank ran there before the rendezvous placed it elsewhere).
            target: The slot file to write (default :func:`pulled_slot` of ``rank``).

    Returns:
        The replica's step, or None when the neighbour holds none (or cannot be reached).
    """
    target = target or pulled_slot(store, run, rank)
    directory = target.parent
    try:
        with socket.create_connection(address, timeout=60) as sock:
            request: dict[str, Any] = {"op": "get", "run": run, "rank": rank,
                                       "replica": replica}
            if seq is not None:
                request["seq"] = seq
            _send_json(sock, request)
            reply = _recv_json(sock)
            if not reply.get("ok"):
                logger.info("no replica of %s rank %s at %s:%s: %s", run, rank, *address,
                            reply.get("error"))
                return None
            size = int(reply["size"])
            header = _recv_exact(sock, HEADER_BYTES)
            parsed = parse_header(header)
            if parsed is None or size <= HEADER_BYTES:
                return None
            directory.mkdir(mode=0o700, parents=True, exist_ok=True)
            fd = os.open(target, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                os.ftruncate(fd, size)  # zero header: invisible until the end
                _recv_to_file(sock, fd, HEADER_BYTES, size)
                os.pwrite(fd, header, 0)  # the commit word, last
            except BaseException:
                os.close(fd)
                target.unlink(missing_ok=True)
                raise
            os.close(fd)
    except (OSError, ConnectionError, ValueError) as exc:
        logger.warning("could not pull the snapshot replica from %s:%s: %s", *address, exc)
        return None
    logger.info("pulled the replica of %s rank %s (step %s) from %s:%s",
                run, rank, parsed[1], *address)
    return parsed[1]
