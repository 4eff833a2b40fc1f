"""Snapshots: the training state staged into host shared memory every few steps.

A snapshot is the cheapest checkpoint: the state's tensors copied into shared-memory slot
files that outlive the process (not a reboot), with no catalog transaction and no disk I/O.
A restarted process on the same host reads the newest complete snapshot back
(:func:`newest_snapshot`, :func:`read_snapshot`); every ``save_interval`` steps the manager
(:mod:`ckptstore.hooks.manager`) writes the newest snapshot as a durable checkpoint straight
from its slot (:meth:`SnapshotWriter.persist_view`), so the state is never staged twice.

Where: ``<memory dir>/<store id>.snapshots/<run>/rank<r>/slot<i>.snap`` (memory dir
``memory_tier_dir``, default ``/dev/shm/ckptstore``; store id as the memory tier's).

A slot file is ``[header page][meta JSON][tensor bytes]``. The header (:data:`_HEADER`:
magic, sequence number, step, meta length, data offset, data length, crc32c of the meta and
of each tensor's bytes, crc32c of the header itself) is the commit word, in the manner of a
seqlock: a snapshot first rewrites its slot's header with an odd sequence number
(invisible), then copies the tensors and the meta, computes the crc32c of both, and only
then writes the header with the next even sequence number. A reader takes a slot only when
its header is intact (own crc), even, and the crc32c of what it copied out matches, and the
header is unchanged after the copy; so a snapshot torn by a crash, or being rewritten under
the reader, is never returned. Of the intact slots, the one with the highest sequence
number is the newest.

Slots are reused: created (and their pages reserved with ``posix_fallocate``, so a full
``/dev/shm`` is an error at creation rather than a SIGBUS mid-copy) on the first snapshot,
and again only when the state's tensors change shape, dtype or number. There are two slots
(double buffering: one always holds the newest complete snapshot while the other is
written) plus one when durable saves are made from snapshots (the slot being persisted is
pinned until its save finished). Memory per process: ``slots x (state bytes + meta) +
slots x 4 KiB``; :func:`snapshot_bytes_needed` computes it and a budget refuses what does not
fit (:class:`~ckptstore.errors.ConfigError`).

The copy runs on a worker thread; :meth:`SnapshotWriter.take` returns once the tensors are
copied (or at once with ``overlap=True``, when the caller fences the next mutation of the
state with :meth:`SnapshotWriter.wait_copied`, e.g. in an optimizer pre-step hook), and the
checksum and commit word follow on the worker. The next snapshot waits for the previous one
to be committed, so at most one snapshot is in flight: after ``take(step)`` returns, the
snapshot of the previous step is complete.

By default device tensors are copied with ``Tensor.copy_`` into the slots on the worker
(shared memory is not pinned memory). With ``async_copy=True`` (the manager's
``snapshot_async=True``, used with ``overlap=True``) :meth:`SnapshotWriter.take` records an
event on each CUDA device's compute stream, and the worker copies the device tensors on a
dedicated side stream that waits for it, ``non_blocking`` into pinned staging buffers
(allocated once, reused, remade only with the slots); once that stream is synchronised the
state is released (``wait_copied`` returns), and the commit moves the staged bytes into the
slot before the checksum. CPU tensors take the same worker path either way, so scheduling,
waiting, errors and commit are one code path, tested with CPU tensors. A failed copy or commit
is raised by the next wait as a :class:`~ckptstore.errors.SnapshotError` and its slot stays
invisible. The CUDA branch has not run on a GPU here and its stall is unmeasured (see
docs/SNAPSHOTS.md "Devices").
"""

from __future__ import annotations

import hashlib
import json
import logging
import mmap
import os
import struct
import threading
import time
import urllib.parse
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ckptstore.core import StoreCore
from ckptstore.errors import CkptError, ConfigError, IntegrityError, SnapshotError, StorageError
from ckptstore.faultpoints import fault_point
from ckptstore.format import FlatState, unflatten_state
from ckptstore.format.codecs import crc32c_combine, crc32c_update
from ckptstore.format.dtypes import dtype_by_name, dtype_info
from ckptstore.format.pool import cancel_on_error
from ckptstore.format.tree import match_into, select_tree
from ckptstore.identity import host
from ckptstore.storage.shm import DEFAULT_MEMORY_ROOT

__all__ = [
    "HEADER_BYTES",
    "SnapshotFound",
    "SnapshotView",
    "SnapshotWriter",
    "check_snapshot_options",
    "committed_slots",
    "newest_snapshot",
    "parse_header",
    "read_snapshot",
    "read_snapshot_flat",
    "snapshot_bytes_needed",
    "snapshot_dir",
    "snapshots_here",
]

logger = logging.getLogger(__name__)

_MAGIC = b"CKSNAP01"
#: magic, seq, step, meta length, data offset, data length, crc32c(meta+data), crc32c(header)
_HEADER = struct.Struct("<8sQqQQQII")
#: The header page at the start of every slot file.
HEADER_BYTES = 4096
_ALIGN = 64
_MIN_META = 64 * 1024
_SLOT_GLOB = "slot*.snap"
#: Bytes read back and checksummed at a time (:func:`_read_checked`).
_READ_PIECE = 1024**2
#: Snapshots at least this large are read back on two threads (:func:`_read_checked`).
_PARALLEL_READ_BYTES = 8 * 1024**2


def _store_key(store: StoreCore) -> str:
    # As the memory tier's store id (ops/writing/memory.py): the same in every process.
    url = store.settings.resolved_catalog_url
    return hashlib.sha256(url.encode("utf-8")).hexdigest()[:16]


def snapshot_dir(store: StoreCore, run: str, rank: int = 0) -> Path:
    """Directory of the snapshot slots of ``run`` (and ``rank``) on this host."""
    base = Path(store.settings.memory_tier_dir or DEFAULT_MEMORY_ROOT)
    return base / f"{_store_key(store)}.snapshots" / run / f"rank{rank}"


def _align(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


@dataclass(frozen=True)
class _Entry:
    key: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int


def _layout(flat: FlatState) -> tuple[list[_Entry], int]:
    entries: list[_Entry] = []
    offset = 0
    for key, tensor in flat.tensors.items():
        info = dtype_info(tensor.dtype)
        if info is None:  # the flattener refuses these already
            raise ConfigError(f"tensor {key!r} has unsupported dtype {tensor.dtype}")
        nbytes = tensor.numel() * info.itemsize
        entries.append(_Entry(key, info.name, tuple(tensor.shape), offset, nbytes))
        offset = _align(offset + nbytes)
    return entries, offset


def snapshot_bytes_needed(state_bytes: int, slots: int, meta_bytes: int = _MIN_META) -> int:
    """Shared memory the snapshots of one process take: every slot whole.

    Args:
        state_bytes: Bytes of the state's tensors (aligned per tensor).
        slots: Number of slots (2, or 3 when durable saves are made from snapshots).
        meta_bytes: Room reserved for the meta JSON (tree and tensor table) per slot.
    """
    return slots * (HEADER_BYTES + meta_bytes + state_bytes)


def _view(buf: mmap.mmap, entry: _Entry, data_off: int) -> torch.Tensor:
    info = dtype_by_name(entry.dtype)
    assert info is not None
    if entry.nbytes == 0:
        return torch.empty(entry.shape, dtype=info.torch_dtype)
    raw = torch.frombuffer(buf, dtype=torch.uint8, count=entry.nbytes,
                           offset=data_off + entry.offset)
    return raw.view(info.torch_dtype).view(entry.shape)


class _Slot:
    """One slot file mapped into this process."""

    def __init__(self, path: Path, entries: list[_Entry], data_bytes: int,
                 meta_cap: int) -> None:
        self.path = path
        self.entries = entries
        self.meta_cap = meta_cap
        self.data_off = HEADER_BYTES + meta_cap
        self.size = self.data_off + max(data_bytes, 1)
        self.seq = 0
        self.step: int | None = None
        self.complete = False
        # Written by this writer (an adopted slot holds a snapshot of an earlier process:
        # it stays readable until rewritten, but no durable save is made from it).
        self.ours = False
        self.pins = 0
        try:
            reuse = path.stat().st_size == self.size
        except OSError:
            reuse = False
        flags = os.O_RDWR | os.O_CREAT | (0 if reuse else os.O_TRUNC)
        fd = os.open(path, flags, 0o600)
        try:
            try:
                # Reserve the pages now: writing a sparse tmpfs file that cannot grow is a
                # SIGBUS, an error here is a clear one.
                os.posix_fallocate(fd, 0, self.size)
            except OSError as exc:
                os.close(fd)
                fd = -1
                if not reuse:
                    path.unlink(missing_ok=True)
                raise StorageError(
                    f"cannot reserve {self.size} bytes of shared memory for a snapshot slot at "
                    f"{path}: {exc}; enlarge /dev/shm or snapshot less often / a smaller state"
                ) from exc
            self.buf = mmap.mmap(fd, self.size)
        finally:
            if fd >= 0:
                os.close(fd)
        if reuse:
            parsed = parse_header(bytes(self.buf[: _HEADER.size]))
            if parsed is not None:
                self.seq, self.step = parsed[0], parsed[1]
                self.complete = True
        self.views = [_view(self.buf, e, self.data_off) for e in entries]

    def write_header(self, seq: int, step: int, meta_len: int, data_len: int, crc: int) -> None:
        raw = _HEADER.pack(_MAGIC, seq, step, meta_len, self.data_off, data_len, crc, 0)
        hcrc = crc32c_update(raw[:-4])
        self.buf[: _HEADER.size] = _HEADER.pack(
            _MAGIC, seq, step, meta_len, self.data_off, data_len, crc, hcrc)

    def close(self) -> None:
        self.views = []
        try:
            self.buf.close()
        except BufferError:  # a durable save still holds views; the mapping goes with them
            logger.debug("snapshot slot %s still referenced at close", self.path)


@dataclass
class _Job:
    slot: _Slot
    step: int
    flat: FlatState
    meta: bytes
    seq: int
    copied: threading.Event = field(default_factory=threading.Event)
    done: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None
    #: CUDA events recorded on each device's compute stream when the snapshot was taken
    #: (async copies only): the side stream's copy starts after the step that made the state.
    ready: dict[torch.device, Any] = field(default_factory=dict)
    #: (slot view, pinned staging buffer) pairs whose bytes the commit moves into the slot.
    staged: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    copy_s: float = 0.0
    commit_s: float = 0.0


@dataclass(frozen=True)
class SnapshotView:
    """A complete snapshot held in a slot, for a durable save made from it.

    Attributes:
        step: The snapshot's step.
        flat: The state: its tensors are views of the slot (valid until :attr:`release`).
        release: Unpins the slot; call once the save is done (idempotent).
    """

    step: int
    flat: FlatState
    release: Callable[[], None]


def check_snapshot_options(interval: int | None, budget_bytes: int | None, unit: str) -> None:
    """Check an integration's ``snapshot_interval`` and ``snapshot_budget_bytes`` before
    anything is created (the Hugging Face and Lightning adapters take both).

    Args:
        interval: Snapshot every this many steps, or None (no snapshots).
        budget_bytes: Most shared memory for the slots, or None.
        unit: What a step is, for the message (``"optimizer steps"``, ``"global steps"``).

    Raises:
        ConfigError: For an interval that is not a positive int, a budget that is not a
            positive int, or a budget without an interval.
    """
    if interval is not None and (
        isinstance(interval, bool) or not isinstance(interval, int) or interval <= 0
    ):
        raise ConfigError(
            f"snapshot_interval must be a positive int ({unit}) or None, got {interval!r}")
    if budget_bytes is not None and interval is None:
        raise ConfigError(
            "snapshot_budget_bytes bounds the snapshots, which need snapshot_interval; "
            "pass snapshot_interval=N or leave the budget out")
    if budget_bytes is not None and (
        isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int) or budget_bytes <= 0
    ):
        raise ConfigError(
            f"snapshot_budget_bytes must be a positive int or None, got {budget_bytes!r}")


class SnapshotWriter:
    """Writes one process's snapshots of one run into reused shared-memory slots.

    Lifecycle: :meth:`take` every snapshot step → (:meth:`persist_view` when a durable
    save is due) → :meth:`close`. :meth:`take` is called from one thread (the training
    loop); the copy and the commit run on the writer's worker thread.

    Attributes:
        directory: The slot directory.
        slots: Number of slots.
        budget_bytes: Most shared memory the slots may take (None: only the free space).
        last_copy_s: Seconds the last snapshot's copy took.
        last_blocked_s: Seconds the last :meth:`take` blocked its caller.
    """

    def __init__(
        self,
        store: StoreCore,
        run: str,
        *,
        slots: int = 2,
        budget_bytes: int | None = None,
        rank: int = 0,
        run_token: str = "",
        peer_slots: int = 0,
        on_commit: Callable[[Path, int, int], None] | None = None,
        async_copy: bool = False,
    ) -> None:
        """Prepare the writer (slot files are created at the first :meth:`take`).

        Args:
            store: The open store.
            run: Run name.
            slots: 2 (double buffering) or 3 (plus one pinned by a durable save).
            budget_bytes: Most shared memory for the slots (None: no budget of ours).
            rank: This process's rank (one slot directory per rank).
            run_token: Identifies this incarnation of the run (its creation time); a reader
                asking for another token ignores the snapshot.
            peer_slots: Slots of a neighbour's replica this node also holds (2 with
                ``replicas=2``), counted against the budget as the same size as ours.
            on_commit: Called on the worker as ``on_commit(slot path, seq, step)`` after each
                snapshot is committed (the peer replicator's ``offer``).
            async_copy: Copy CUDA tensors on a side stream into pinned staging buffers
                (``non_blocking``), after an event recorded on the compute stream at
                :meth:`take`; the staged bytes move into the slot on the worker. CPU tensors
                are copied on the worker either way. Used with ``take(overlap=True)``.

        Raises:
            ConfigError: For a bad slot count or budget.
        """
        if slots not in (2, 3):
            raise ConfigError(f"a snapshot writer needs 2 or 3 slots, got {slots!r}")
        if budget_bytes is not None and (
            isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int)
            or budget_bytes <= 0
        ):
            raise ConfigError(
                f"snapshot_budget_bytes must be a positive int or None, got {budget_bytes!r}")
        self.store = store
        self.run = run
        self.rank = rank
        self.run_token = run_token
        self.slots = slots
        self.budget_bytes = budget_bytes
        self.peer_slots = peer_slots
        self.on_commit = on_commit
        self.directory = snapshot_dir(store, run, rank)
        self._slots: list[_Slot] = []
        self._signature: tuple[tuple[str, str, tuple[int, ...]], ...] | None = None
        self._lock = threading.Condition()
        self._pending: _Job | None = None
        self._queue: list[_Job | None] = []
        self._thread: threading.Thread | None = None
        self._seq = 0
        self._closed = False
        self.last_copy_s = 0.0
        self.last_blocked_s = 0.0
        self.async_copy = async_copy
        #: Called on the worker as ``before_copy(step)`` before a snapshot's tensors are
        #: copied (a profiler marks the copy's start; tests hold the copier with it). An
        #: exception from it fails that snapshot like a failed copy.
        self.before_copy: Callable[[int], None] | None = None
        # The side streams (one per device) and the pinned staging buffers (one per device
        # tensor, the state's device bytes once: at most one snapshot is in flight), made on
        # the first async copy and again only when the slots are (the state changed shape).
        self._streams: dict[torch.device, Any] = {}
        self._staging: dict[str, torch.Tensor] = {}

    # ------------------------------------------------------------------ slots
    def _prepare(self, flat: FlatState, meta_len: int) -> None:
        signature = tuple((k, str(t.dtype), tuple(t.shape)) for k, t in flat.tensors.items())
        if signature == self._signature and all(meta_len <= s.meta_cap for s in self._slots):
            return
        entries, data_bytes = _layout(flat)
        meta_cap = max(_MIN_META, _align(2 * meta_len))
        need = snapshot_bytes_needed(data_bytes, self.slots + self.peer_slots, meta_cap)
        if self.budget_bytes is not None and need > self.budget_bytes:
            raise ConfigError(
                f"snapshots of {self.run} need {need} bytes of shared memory "
                f"({self.slots} slots of {data_bytes} bytes of state each, and "
                f"{self.peer_slots} for a neighbour's replica), over snapshot_budget_bytes="
                f"{self.budget_bytes}; raise the budget to at least {need}, or set "
                "snapshot_interval=None to save without snapshots"
            )
        self._wait_idle()
        for slot in self._slots:
            if slot.pins:
                raise CkptError(
                    f"the state of {self.run} changed shape while a durable save still reads "
                    "its previous snapshot; wait for pending saves first")
        self._drop_slots()
        self._staging = {}
        self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        old = sum(p.stat().st_size for p in self.directory.glob(_SLOT_GLOB))
        free = _free_bytes(self.directory)
        if free is not None and need > free + old:
            raise ConfigError(
                f"snapshots of {self.run} need {need} bytes of shared memory but "
                f"{self.directory} has {free + old} free; enlarge /dev/shm "
                "(docker --shm-size) or use a smaller state per process"
            )
        logger.info("snapshot slots of %s: %d x %d bytes in %s",
                    self.run, self.slots, HEADER_BYTES + meta_cap + data_bytes, self.directory)
        wanted = {self.directory / f"slot{i}.snap" for i in range(self.slots)}
        for path in self.directory.glob(_SLOT_GLOB):
            if path not in wanted:
                path.unlink(missing_ok=True)
        # Slot files of the right size are reused as they are: the newest snapshot of an
        # earlier process stays readable until this one has committed a newer one.
        self._slots = [
            _Slot(self.directory / f"slot{i}.snap", entries, data_bytes, meta_cap)
            for i in range(self.slots)
        ]
        self._seq = max([self._seq, *(s.seq for s in self._slots)])
        self._seq += self._seq % 2
        self._signature = signature
        self._record_area(self._slots[0].size)

    def _record_area(self, slot_bytes: int) -> None:
        """The run's one catalog row for this process's slots (never one per snapshot)."""
        uri = f"shm://{host()}{urllib.parse.quote(str(self.directory))}"
        try:
            self.store.catalog.record_snapshot_area(
                self.run, host(), self.rank, uri, slots=self.slots, slot_bytes=slot_bytes)
        except CkptError:
            # Only a listing for operators: restarts find the slots by their path.
            logger.warning("could not record the snapshot area of %s", self.run, exc_info=True)

    def _drop_slots(self) -> None:
        for slot in self._slots:
            slot.close()
        self._slots = []
        self._signature = None

    def _choose(self) -> _Slot:
        newest = max((s for s in self._slots if s.complete), key=lambda s: s.seq, default=None)
        free = [s for s in self._slots if s is not newest and not s.pins]
        with self._lock:
            while not free:
                # Only when a durable save still reads the one slot left: wait for it.
                self._lock.wait(timeout=0.5)
                free = [s for s in self._slots if s is not newest and not s.pins]
        return min(free, key=lambda s: s.seq)

    def continue_after(self, seq: int) -> None:
        """Number the next snapshots after ``seq``: the highest sequence number of this
        rank anywhere (other hosts' slots and replicas included) at a restart.

        Keeps "a higher sequence number is newer" true across the hosts a rank moves
        between, so a snapshot of a timeline a restart abandoned is recognised as such
        (:func:`ckptstore.ops.writing.snapshot_world.current_snapshots`) and a replica
        server replaces the older of its two slots, not the newer.
        """
        with self._lock:
            self._seq = max(self._seq, seq + seq % 2)

    # ------------------------------------------------------------------ snapshots
    def take(self, step: int, flat: FlatState, *, overlap: bool = False,
             extra_meta: dict[str, Any] | None = None) -> None:
        """Snapshot ``flat`` (the state at ``step``) into the next slot.

        Waits for the previous snapshot to be committed, makes the chosen slot invisible,
        then has the worker copy the tensors and commit the slot.

        Args:
            step: The training step of the state.
            flat: The flattened state.
            overlap: Return before the tensors are copied; the caller must then call
                :meth:`wait_copied` before it changes any tensor of the state.
            extra_meta: More JSON-able fields for the meta (a sharded state's ``world`` and
                ``shards``: :mod:`ckptstore.ops.writing.snapshot_shards`).

        Raises:
            ConfigError: If the slots would not fit the budget or the free shared memory.
            StorageError: If shared memory cannot be reserved.
            CkptError: The previous snapshot's failure, or a closed writer.
        """
        if self._closed:
            raise CkptError(f"the snapshot writer of {self.run} is closed")
        started = time.perf_counter()
        self._wait_idle()
        meta = json.dumps({
            "format": 1, "run": self.run, "token": self.run_token, "step": step,
            "tree": flat.tree,
            "tensors": [[k, str(t.dtype).removeprefix("torch."), list(t.shape)]
                        for k, t in flat.tensors.items()],
            **(extra_meta or {}),
        }, separators=(",", ":")).encode("utf-8")
        self._prepare(flat, len(meta))
        slot = self._choose()
        self._seq += 2
        slot.complete = False
        slot.ours = True
        slot.step = None
        # The commit word first: from here on no reader takes this slot.
        slot.write_header(self._seq - 1, step, 0, 0, 0)
        job = _Job(slot, step, flat, meta, self._seq)
        if self.async_copy:
            job.ready = _compute_events(flat)
        with self._lock:
            self._pending = job
            self._queue.append(job)
            self._ensure_thread()
            self._lock.notify_all()
        if not overlap:
            self.wait_copied()
        self.last_blocked_s = time.perf_counter() - started

    def wait_copied(self) -> None:
        """Return once the pending snapshot's tensors are copied (the state may change).

        Raises:
            CkptError: If the copy failed.
        """
        job = self._pending
        if job is None:
            return
        job.copied.wait()
        if job.error is not None:
            self._pending = None
            raise self._failure(job)

    def _wait_idle(self) -> None:
        job = self._pending
        if job is None:
            return
        job.done.wait()
        self._pending = None
        if job.error is not None:
            raise self._failure(job)

    def _failure(self, job: _Job) -> SnapshotError:
        err = SnapshotError(
            f"snapshot of {self.run} at step {job.step} failed: {job.error!r}; its slot stays "
            "invisible (the previous snapshot is the newest)")
        err.__cause__ = job.error
        return err

    def flush(self) -> None:
        """Wait until the pending snapshot is committed.

        Raises:
            CkptError: If it failed.
        """
        self._wait_idle()

    def persist_view(self) -> SnapshotView | None:
        """Pin the newest complete snapshot for a durable save made from it.

        Waits for the pending snapshot first. The slot is not rewritten until the view's
        ``release`` is called.

        Returns:
            The view, or None when there is no complete snapshot.
        """
        self._wait_idle()
        newest = max((s for s in self._slots if s.complete), key=lambda s: s.seq, default=None)
        if newest is None or newest.step is None or not newest.ours:
            return None
        slot, step = newest, newest.step
        slot.pins += 1
        released = threading.Event()

        def release() -> None:
            with self._lock:
                if not released.is_set():
                    released.set()
                    slot.pins -= 1
                    self._lock.notify_all()

        tensors = dict(zip((e.key for e in slot.entries), slot.views, strict=True))
        tree = json.loads(bytes(slot.buf[HEADER_BYTES: HEADER_BYTES + _meta_len(slot)]))
        return SnapshotView(step, FlatState(tensors, tree["tree"]), release)

    def close(self) -> None:
        """Wait for the pending snapshot, stop the worker; the slot files stay (restarts)."""
        if self._closed:
            return
        try:
            self._wait_idle()
        finally:
            self._closed = True
            with self._lock:
                self._queue.append(None)
                self._lock.notify_all()
                thread, self._thread = self._thread, None
            if thread is not None:
                thread.join()
            self._drop_slots()
            self._staging = {}
            self._streams = {}

    # ------------------------------------------------------------------ worker
    def _ensure_thread(self) -> None:
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._work, name="ckptstore-snapshot",
                                            daemon=True)
            self._thread.start()

    def _work(self) -> None:
        while True:
            with self._lock:
                while not self._queue:
                    self._lock.wait()
                job = self._queue.pop(0)
            if job is None:
                return
            try:
                if self.before_copy is not None:
                    self.before_copy(job.step)
                self._copy(job)
            except BaseException as exc:  # reported to the training loop by take()/wait
                job.error = exc
                logger.error("snapshot of %s at step %s failed: %s", self.run, job.step, exc)
            finally:
                job.copied.set()
            if job.error is None:
                try:
                    self._commit(job)
                except BaseException as exc:
                    job.error = exc
                    logger.error("snapshot of %s at step %s failed: %s", self.run, job.step, exc)
            job.done.set()

    def _copy(self, job: _Job) -> None:
        """Copy the state out of the caller's tensors; once this returns they may change."""
        started = time.perf_counter()
        with torch.no_grad():
            if job.ready:
                self._copy_device(job)
            for view, src in zip(job.slot.views, job.flat.tensors.values(), strict=True):
                if src.numel() and not (job.ready and src.is_cuda):
                    # Synchronous: a CPU tensor, or (without async_copy) a device tensor
                    # copied into the unpinned slot on the default stream.
                    view.copy_(src.detach())
                fault_point("snapshot.tensor")
        job.copy_s = self.last_copy_s = time.perf_counter() - started

    def _copy_device(self, job: _Job) -> None:
        """The CUDA branch: device-to-host copies on a side stream into pinned buffers.

        Each device's side stream waits for the event recorded on its compute stream at
        :meth:`take`, copies with ``non_blocking=True`` into the reused pinned staging
        buffers, and is synchronised here; the move into the slot (a host memcpy) is left
        to the commit, so the state is released as soon as the device copies are done.
        """
        streams: list[Any] = []
        for (key, src), view in zip(job.flat.tensors.items(), job.slot.views, strict=True):
            if not (src.is_cuda and src.numel()):
                continue
            stream = self._streams.get(src.device)
            if stream is None:
                stream = self._streams[src.device] = torch.cuda.Stream(  # type: ignore[no-untyped-call]
                    device=src.device)
            staging = self._staging.get(key)
            if staging is None:
                staging = self._staging[key] = torch.empty(
                    src.shape, dtype=src.dtype, pin_memory=True)
            with torch.cuda.stream(stream):
                if stream not in streams:
                    stream.wait_event(job.ready[src.device])
                    streams.append(stream)
                staging.copy_(src.detach(), non_blocking=True)
                # The caching allocator must not hand the source's memory to the compute
                # stream before the side stream has read it.
                src.record_stream(stream)
            job.staged.append((view, staging))
        for stream in streams:
            stream.synchronize()

    def _commit(self, job: _Job) -> None:
        started = time.perf_counter()
        slot = job.slot
        for view, staging in job.staged:  # async device copies: pinned buffer -> slot
            view.copy_(staging)
        job.staged = []
        meta_off = HEADER_BYTES
        slot.buf[meta_off: meta_off + len(job.meta)] = job.meta
        data_len = slot.size - slot.data_off
        # Meta, then each tensor's bytes in table order (not the alignment padding): a reader
        # can then check the bytes where it put them, e.g. in the caller's own tensors.
        with memoryview(slot.buf) as whole:
            crc = crc32c_update(whole[meta_off: meta_off + len(job.meta)])
            for entry in slot.entries:
                start = slot.data_off + entry.offset
                crc = crc32c_update(whole[start: start + entry.nbytes], crc)
        fault_point("snapshot.copied")
        slot.write_header(job.seq, job.step, len(job.meta), data_len, crc)
        slot.step = job.step
        slot.seq = job.seq
        slot.complete = True
        job.flat = FlatState({}, None)  # the caller's tensors are not kept alive
        if self.on_commit is not None:
            try:
                self.on_commit(slot.path, job.seq, job.step)
            except Exception:  # replication is best effort; the snapshot is committed
                logger.exception("snapshot commit hook failed for %s", self.run)
        job.commit_s = time.perf_counter() - started


def _compute_events(flat: FlatState) -> dict[torch.device, Any]:
    """An event on the current (compute) stream of each CUDA device the state is on."""
    events: dict[torch.device, Any] = {}
    for tensor in flat.tensors.values():
        if tensor.is_cuda and tensor.device not in events:
            events[tensor.device] = torch.cuda.current_stream(tensor.device).record_event()
    return events


def _meta_len(slot: _Slot) -> int:
    header = _HEADER.unpack_from(slot.buf, 0)
    return int(header[3])


def _free_bytes(path: Path) -> int | None:
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


# ---------------------------------------------------------------------- reading
@dataclass(frozen=True)
class SnapshotFound:
    """A complete snapshot found on this host (its header checked, not yet its bytes).

    Attributes:
        path: The slot file.
        seq: Its sequence number (higher is newer).
        step: Its training step.
    """

    path: Path
    seq: int
    step: int


def parse_header(raw: bytes) -> tuple[int, int, int, int, int, int] | None:
    """``(seq, step, meta_len, data_off, data_len, crc)`` of an intact, committed header.

    None for anything else: another file, a torn header, a slot being written (odd seq).
    """
    if len(raw) < _HEADER.size:
        return None
    magic, seq, step, meta_len, data_off, data_len, crc, hcrc = _HEADER.unpack_from(raw)
    if magic != _MAGIC or crc32c_update(raw[: _HEADER.size - 4]) != hcrc or seq % 2:
        return None
    if data_off < HEADER_BYTES + meta_len:
        return None
    return seq, step, meta_len, data_off, data_len, crc


def committed_slots(directory: Path) -> list[SnapshotFound]:
    """The committed slot files in ``directory`` (own slots or a neighbour's replicas),
    newest first, by their headers alone; none if the directory cannot be read.

    Costs a few small reads; :func:`read_snapshot` checks the bytes.
    """
    found: list[SnapshotFound] = []
    try:
        paths = sorted(directory.glob(_SLOT_GLOB))
    except OSError:
        return []
    for path in paths:
        try:
            with open(path, "rb") as fh:
                parsed = parse_header(fh.read(_HEADER.size))
        except OSError:
            continue
        if parsed is not None:
            found.append(SnapshotFound(path, parsed[0], parsed[1]))
    return sorted(found, key=lambda f: f.seq, reverse=True)


def snapshots_here(store: StoreCore, run: str, rank: int = 0) -> list[SnapshotFound]:
    """The committed snapshots of ``run`` on this host, newest first (:func:`committed_slots`)."""
    return committed_slots(snapshot_dir(store, run, rank))


def newest_snapshot(store: StoreCore, run: str, rank: int = 0) -> SnapshotFound | None:
    """The newest committed snapshot of ``run`` on this host (header checked only)."""
    found = snapshots_here(store, run, rank)
    return found[0] if found else None


def read_snapshot(
    found: SnapshotFound,
    *,
    run_token: str | None = None,
    keys: Sequence[str] | None = None,
    into: Any | None = None,
) -> Any:
    """Read a snapshot, checked whole; return the state.

    Each tensor is read straight to its destination (a fresh CPU tensor, or with ``into``
    the caller's tensor at the same path when it is a contiguous CPU tensor of the same
    shape and dtype: no allocation, no second copy), and the crc32c is computed over the
    bytes where they landed.

    Args:
        found: From :func:`newest_snapshot`.
        run_token: Refuse a snapshot written for another incarnation of the run.
        keys: fnmatch patterns selecting part of the state (as ``store.load``).
        into: A live state whose tensors at the same paths are filled in place. If the
            snapshot turns out damaged, they may be partly overwritten (as with any load).

    Returns:
        The state (CPU tensors, or ``into``'s own tensors).

    Raises:
        IntegrityError: If the slot is torn, damaged, rewritten meanwhile or belongs to
            another incarnation of the run (the caller then uses a durable checkpoint).
    """
    tree, tensors, _info = _read_parts(found, run_token=run_token, keys=keys, into=into)
    return unflatten_state(tree, tensors)


def read_snapshot_flat(found: SnapshotFound, *,
                       run_token: str | None = None) -> tuple[FlatState, dict[str, Any]]:
    """Read a snapshot, checked whole (as :func:`read_snapshot`), without rebuilding it.

    Returns:
        The flat state (fresh CPU tensors by key, and the tree) and the snapshot's meta
        (the resharding restart reads its ``world`` and ``shards``).

    Raises:
        IntegrityError: As :func:`read_snapshot`.
    """
    tree, tensors, info = _read_parts(found, run_token=run_token)
    return FlatState(tensors, tree), info


def _read_parts(
    found: SnapshotFound,
    *,
    run_token: str | None = None,
    keys: Sequence[str] | None = None,
    into: Any | None = None,
) -> tuple[Any, dict[str, torch.Tensor], dict[str, Any]]:
    """:func:`read_snapshot`, returning ``(tree, tensors by key, meta)``."""
    try:
        fd = os.open(found.path, os.O_RDONLY)
    except OSError as exc:
        raise IntegrityError(f"snapshot {found.path} cannot be read: {exc}") from exc
    try:
        before = os.pread(fd, _HEADER.size, 0)
        parsed = parse_header(before)
        if parsed is None or parsed[0] != found.seq:
            raise IntegrityError(f"snapshot {found.path} changed or is incomplete")
        _seq, step, meta_len, data_off, data_len, crc = parsed
        meta = os.pread(fd, meta_len, HEADER_BYTES)
        got = crc32c_update(meta)
        try:
            info = json.loads(meta)
            tree = info["tree"]
            table = [(str(k), str(d), tuple(int(x) for x in shape))
                     for k, d, shape in info["tensors"]]
        except (ValueError, KeyError, TypeError) as exc:
            raise IntegrityError(f"snapshot {found.path} has unreadable meta: {exc}") from exc
        if run_token is not None and info.get("token") != run_token:
            raise IntegrityError(
                f"snapshot {found.path} belongs to another run of the same name")
        if keys is not None:
            tree, _matched = select_tree(tree, list(keys))
        live: dict[str, Any] = {}
        if into is not None:
            shapes = {k: (d, shape) for k, d, shape in table}
            live = match_into(tree, into, lambda k, obj: _fits(obj, shapes.get(k)))
        tensors: dict[str, torch.Tensor] = {}
        reads: list[tuple[torch.Tensor, int]] = []  # (destination, offset in the file)
        offset = 0
        for key, dtype_name, shape in table:
            dinfo = dtype_by_name(dtype_name)
            if dinfo is None:
                raise IntegrityError(f"snapshot {found.path}: unknown dtype {dtype_name!r}")
            dest = live.get(key)
            if dest is None:
                dest = torch.empty(shape, dtype=dinfo.torch_dtype)
            tensors[key] = dest
            nbytes = dest.numel() * dinfo.itemsize
            if offset + nbytes > data_len:
                raise IntegrityError(f"snapshot {found.path} is shorter than its table says")
            if nbytes:
                reads.append((dest, data_off + offset))
            offset = _align(offset + nbytes)
        got = _read_checked(fd, reads, got, found.path)
        after = os.pread(fd, _HEADER.size, 0)
    except OSError as exc:
        raise IntegrityError(f"snapshot {found.path} cannot be read: {exc}") from exc
    finally:
        os.close(fd)
    if after != before:
        raise IntegrityError(f"snapshot {found.path} was rewritten while it was read")
    if got != crc:
        raise IntegrityError(
            f"snapshot {found.path} (step {step}) has crc32c {got:#010x}, its header says "
            f"{crc:#010x}: it is damaged")
    return tree, tensors, info


def _fits(obj: Any, want: tuple[str, tuple[int, ...]] | None) -> bool:
    """Whether a live tensor can take a snapshot tensor's bytes in place."""
    if want is None or not isinstance(obj, torch.Tensor) or obj.device.type != "cpu":
        return False
    info = dtype_info(obj.dtype)
    return (info is not None and info.name == want[0] and tuple(obj.shape) == want[1]
            and obj.is_contiguous())


def _read_checked(fd: int, reads: list[tuple[torch.Tensor, int]], crc: int, path: Path) -> int:
    """Read each ``(destination, file offset)`` in order; return ``crc`` extended over the
    bytes read.

    A restart waits for this copy (docs/SNAPSHOTS.md). It is read :data:`_READ_PIECE` bytes
    at a time, each piece checksummed while it is still in the CPU's cache (reading a whole
    tensor and then checksumming it streams it through memory twice: 28 ms against 19 ms
    for a 50 MB state on our 2-core machine). A large snapshot is read as two consecutive
    halves on two threads (``preadv`` and crc32c release the GIL; one thread's copy does
    not use the memory bandwidth of the machine: 14.6 ms against 7.7 ms for 50 MB there),
    and the halves' crc32c joined with :func:`crc32c_combine`.
    """
    pieces: list[tuple[memoryview, int]] = []
    views: list[memoryview] = []
    for dest, offset in reads:
        view = dest.detach().reshape(-1).view(torch.uint8).numpy().data
        views.append(view)
        pieces.extend((view[start: start + _READ_PIECE], offset + start)
                      for start in range(0, len(view), _READ_PIECE))
    try:
        total = sum(len(piece) for piece, _ in pieces)
        if total < _PARALLEL_READ_BYTES or (os.cpu_count() or 1) < 2:
            return _read_pieces(fd, pieces, crc, path)
        split, first_bytes = 0, 0
        while first_bytes < total // 2:
            first_bytes += len(pieces[split][0])
            split += 1
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckptstore-snapread") as pool:
            second = pool.submit(_read_pieces, fd, pieces[split:], 0, path)
            with cancel_on_error([second]):
                first = _read_pieces(fd, pieces[:split], crc, path)
                return crc32c_combine(first, second.result(), total - first_bytes)
    finally:
        for piece, _ in pieces:
            piece.release()
        for view in views:
            view.release()


def _read_pieces(fd: int, pieces: list[tuple[memoryview, int]], crc: int, path: Path) -> int:
    for piece, offset in pieces:
        _pread_into(fd, piece, offset, path)
        crc = crc32c_update(piece, crc)
    return crc


def _pread_into(fd: int, view: memoryview, offset: int, path: Path) -> None:
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if n <= 0:
            raise IntegrityError(f"snapshot {path} is shorter than its header says")
        done += n
