"""Progressive restore: the manifest first, then tensors in priority groups, as they complete.

``load_progressive(store, ref, order=["model/*", "optimizer/*"])`` returns at once with the
manifest read (a few milliseconds) and loads the tensors on a background thread, group by
group in the given order; everything no pattern names forms a last group. Callers wait for
the group they need (``wait(0)`` for the weights) and start evaluating or training while the
rest streams in, then take the whole state with ``result()``.

Where the bytes come from, fastest first:

* the checkpoint's memory copy on this host (:mod:`ckptstore.ops.writing.memory`);
* its hot copy;
* a remote tier (S3): the manifest is fetched, then the chunk files each group needs are
  downloaded into the hot directory in priority order by a prefetch pool, so group *n* + 1
  downloads while group *n* is decoded. When every group is read the remaining files and the
  commit marker follow, and the hot replica is recorded (PRESENT, verified: every chunk's
  crc32c was checked on the way). This holds the ``restore:hot`` lease like any restore.
  A delta streams its own chunks when every checkpoint it reads from is on the hot tier;
  otherwise (and when the hot replica is in transition) it is first restored whole with
  :func:`~ckptstore.ops.tiering.restore.ensure_hot`.
* a sealed copy on an encrypted tier (``[tiers] encrypt_to``), when a key is given
  (``key=``, else ``$CKPT_DECRYPT_KEY``, else ``decrypt_key``; without one the checkpoint is
  restored first, which asks for the key): the copy is opened and its manifest decrypted and
  checked against the catalog's digest as a restore checks it, then each group's objects are
  decrypted, by priority, into a private (0700) directory of the hot tier, every chunk checked
  against the manifest's plaintext blake3 before its group is read. At the end the copy is
  checked whole (every file the manifest lists, its sizes) and copied into the hot tier as a
  restore of a sealed copy does (:mod:`ckptstore.ops.tiering.sealed_tier`); the private
  directory is removed, whatever happens.

Each group is read with :func:`ckptstore.format.read_checkpoint` into tensors allocated up
front (or the caller's ``into`` tensors), so a completed group's tensors are final and the
later groups never touch them.

A group that meets a damaged copy (a chunk failing its crc32c, a truncated or missing file)
is read again from the hot copy restored from the next verified copy (read repair,
:mod:`ckptstore.ops.tiering.readrepair`): a damaged hot copy is marked DAMAGED and restored
over, a stream from a remote tier is dropped (that copy marked DAMAGED when its bytes were
wrong; a sealed copy is left to ``ckpt verify``, as a restore leaves it) and the checkpoint
restored from the tier after it. The groups already completed were
read whole and verified, and stay as they are.

Example:
    >>> with load_progressive(store, "run-a@latest", order=["model/*"]) as pl:  # doctest: +SKIP
    ...     model.load_state_dict(pl.wait(0)["model"])
    ...     evaluate(model)                       # while the optimizer state streams in
    ...     state = pl.result()
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from ckptstore.core import StoreCore
from ckptstore.errors import CkptError, IntegrityError, StorageError
from ckptstore.format import Manifest, read_checkpoint, read_manifest, verify_checkpoint
from ckptstore.format.chunkio import ChunkReader, Locate
from ckptstore.format.constants import COMMIT_NAME, MANIFEST_NAME, ORIGINAL_MANIFEST_NAME
from ckptstore.format.dtypes import dtype_by_name
from ckptstore.format.filecheck import check_file
from ckptstore.format.flatten import rebuild_state
from ckptstore.format.fsio import advise_hugepages
from ckptstore.format.sealed import OpenedCopy, decryption_key_path, private_dir
from ckptstore.format.tree import match_into
from ckptstore.format.verify import check_chunk
from ckptstore.ops.reading.progressive_plan import GroupPlan, Order, plan_groups
from ckptstore.ops.tiering.readrepair import is_repairable, read_repair
from ckptstore.ops.tiering.sealed_tier import (
    install_unsealed,
    member_files,
    open_sealed,
    read_unsealed_manifest,
    unseal_file,
)
from ckptstore.ops.writing.memory import memory_copy
from ckptstore.records import Checkpoint, ReplicaState, expected_digest
from ckptstore.storage import is_not_found
from ckptstore.storage.transfer import owned_files

if TYPE_CHECKING:
    from ckptstore.storage import Tier

__all__ = ["GroupPlan", "Order", "ProgressiveLoad", "load_progressive", "plan_groups"]


logger = logging.getLogger(__name__)

_LEASE = "restore:hot"
_LEASE_TTL_S = 600.0  # as ops.restore: a dead loader blocks other restores this long at most
_PREFETCH_THREADS = 4
_HUGEPAGE_MIN_BYTES = 4 * 1024 * 1024


def _fresh(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised tensor whose first touch faults in huge pages where possible (as the
    reader allocates): filling fresh memory is bound by page faults."""
    tensor = torch.empty(shape, dtype=dtype)
    nbytes = tensor.numel() * tensor.element_size()
    if nbytes >= _HUGEPAGE_MIN_BYTES:
        advise_hugepages(tensor.data_ptr(), nbytes)
    return tensor


def _destination(manifest: Manifest, into: Any | None) -> Any:
    """The full state with every tensor allocated (or taken from ``into``), not yet filled."""

    def fits(key: str, obj: Any) -> bool:
        entry = manifest.tensors[key]
        info = dtype_by_name(entry.torch_dtype)
        return (
            isinstance(obj, torch.Tensor)
            and info is not None
            and obj.dtype == info.torch_dtype
            and tuple(obj.shape) == entry.shape
        )

    live = match_into(manifest.tree, into, fits) if into is not None else {}
    tensors: dict[str, torch.Tensor] = {}
    for key, entry in manifest.tensors.items():
        found = live.get(key)
        if isinstance(found, torch.Tensor):
            tensors[key] = found
            continue
        info = dtype_by_name(entry.torch_dtype)
        if info is None:
            raise IntegrityError(f"checkpoint {manifest.id}: unknown dtype {entry.torch_dtype}")
        tensors[key] = _fresh(entry.shape, info.torch_dtype)
    arrays: dict[str, np.ndarray[Any, Any]] = {}
    return rebuild_state(manifest.tree, tensors, arrays)


# ---------------------------------------------------------------------- sources
class _Source:
    """Where a group's chunk files are read from (a local directory by default)."""

    def __init__(self, name: str, directory: Path, locate: Locate | None) -> None:
        self.name = name
        self.directory = directory
        self.locate = locate

    def start(self, manifest: Manifest, groups: Sequence[Sequence[str]]) -> None:
        """Begin fetching (remote sources); ``groups`` holds each group's tensor keys."""

    def ready(self, index: int) -> None:
        """Block until group ``index``'s files are local."""

    def finish(self) -> None:
        """Called once every group was read."""

    def abort(self) -> None:
        """Called when loading failed or was cancelled."""


def _files_under(directory: Path) -> set[str]:
    """The files under ``directory``, relative to it (none if it does not exist)."""
    if not directory.is_dir():
        return set()
    return {p.relative_to(directory).as_posix() for p in directory.rglob("*") if p.is_file()}


def _remove_added(directory: Path, added: Iterable[str], preexisting: set[str]) -> None:
    """Undo a stream into ``directory``: its marker and the files it added go; files that
    were there before stay (chunks kept for deltas that read them)."""
    with contextlib.suppress(FileNotFoundError):
        (directory / COMMIT_NAME).unlink()
    for rel in added:
        if rel not in preexisting:
            with contextlib.suppress(FileNotFoundError):
                (directory / rel).unlink()
    if directory.is_dir() and not any(p.is_file() for p in directory.rglob("*")):
        shutil.rmtree(directory, ignore_errors=True)


class _StreamSource(_Source):
    """What the two streaming sources share: files fetched by a pool in the groups'
    priority order, each group's futures, the ``restore:hot`` lease given back once, and
    the catalog record of the finished copy. A subclass says how one file is fetched
    (:meth:`_get`)."""

    def __init__(self, store: StoreCore, ck: Checkpoint, tier: Tier, directory: Path,
                 locate: Locate | None, owner: str, threads: int) -> None:
        super().__init__(tier.name, directory, locate)
        self.store = store
        self.ck = ck
        self.tier = tier
        self.owner = owner
        self.threads = threads
        self.manifest: Manifest | None = None
        self.fetched: dict[str, Future[int]] = {}
        self.groups: list[list[Future[int]]] = []
        self.pool: ThreadPoolExecutor | None = None
        self.preexisting: set[str] = set()
        self.released = False

    def _get(self, rel: str) -> int:
        """Fetch one file of the checkpoint into :attr:`directory`; return its size."""
        raise NotImplementedError

    def _fetch(self, rel: str) -> Future[int]:
        future = self.fetched.get(rel)
        if future is None:
            assert self.pool is not None
            future = self.pool.submit(self._get, rel)
            self.fetched[rel] = future
        return future

    def _queue(self, manifest: Manifest, groups: Sequence[Sequence[str]], name: str, *,
               own_chunks_only: bool) -> None:
        """Submit every group's chunk files in priority order; the pool runs them in that
        order, so the files of group n+1 arrive while group n is decoded."""
        self.pool = ThreadPoolExecutor(self.threads, thread_name_prefix=name)
        for keys in groups:
            futures = []
            for key in keys:
                entry = manifest.tensors[key]
                array = manifest.arrays[entry.array]
                for index in range(entry.chunk_start, entry.chunk_stop):
                    # A delta's chunks that live in a base's hot directory are not fetched.
                    if own_chunks_only and array.chunks[index].src is not None:
                        continue
                    futures.append(self._fetch(array.chunk_path(index)))
            self.groups.append(futures)

    def ready(self, index: int) -> None:
        for future in self.groups[index]:
            future.result()

    def _record(self, directory: Path, total: int, digest: str | None, **detail: Any) -> None:
        """Record the hot copy as PRESENT and verified, and the ``restored`` event."""
        catalog = self.store.catalog
        catalog.set_replica(self.ck.id, "hot", uri=str(directory), state=ReplicaState.PRESENT,
                            bytes=total, verified=True,
                            manifest_digest=None if digest == self.ck.manifest_digest
                            else digest)
        catalog.record_event(
            "restored", checkpoint_id=self.ck.id, actor=self.owner,
            detail={"from": self.tier.name, "tier": "hot", "path": str(directory),
                    "bytes": total, "progressive": True, **detail},
        )

    def _close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True)
        if not self.released:
            self.released = True
            try:
                self.store.catalog.release_lease(self.ck.id, _LEASE, self.owner)
            except CkptError:
                logger.warning("could not release the restore lease of %s", self.ck.ref,
                               exc_info=True)


class _RemoteSource(_StreamSource):
    """Downloads a checkpoint from a remote tier into its hot directory, by priority."""

    def __init__(self, store: StoreCore, ck: Checkpoint, tier: Tier, owner: str,
                 threads: int) -> None:
        super().__init__(store, ck, tier, store.checkpoint_dir(ck.run, ck.id), store.locate,
                         owner, threads)

    def _get(self, rel: str) -> int:
        return self.tier.get_file(self.tier.key_for(self.ck.run, self.ck.id, rel),
                                  self.directory / rel)

    def start(self, manifest: Manifest, groups: Sequence[Sequence[str]]) -> None:
        self.manifest = manifest
        # The directory may hold this checkpoint's chunk files kept for deltas that read
        # them (its hot replica was deleted with keep_referenced), or leftovers of a dead
        # restore: files are replaced atomically, never removed; only a stale marker goes.
        with contextlib.suppress(FileNotFoundError):
            (self.directory / COMMIT_NAME).unlink()
        self.preexisting = _files_under(self.directory)
        self._queue(manifest, groups, "ckpt-prefetch", own_chunks_only=True)

    def finish(self) -> None:
        assert self.manifest is not None
        # owned_files: a re-encoded copy's original manifest comes along (signatures).
        rest = [rel for rel in owned_files(self.manifest) if rel != COMMIT_NAME]
        total = sum(self._fetch(rel).result() for rel in rest)
        total += self._get(COMMIT_NAME)
        # The marker and manifest against the catalog, then every file's size; the chunks'
        # crc32c were all checked while the groups were read.
        # The copy streamed may be one re-encoded with the archive codec (its own digest).
        digest = expected_digest(self.ck, self.tier.name)
        read_manifest(self.directory, expected_digest=digest)
        problems = verify_checkpoint(self.directory, self.manifest, locate=self.locate,
                                     deep=False)
        if problems:
            raise IntegrityError(
                f"the copy of {self.ck.ref} streamed from {self.tier.name} is incomplete: "
                + "; ".join(problems[:5]) + f"; run `ckpt restore {self.ck.ref}` to retry"
            )
        self._record(self.directory, total, digest)
        self._close()

    def abort(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=True)
        # Only what this load added: files that were there before may be read by deltas.
        _remove_added(self.directory, self.fetched, self.preexisting)
        self._close()


class _SealedSource(_StreamSource):
    """Decrypts a sealed copy (an encrypted tier) into a private directory, by priority.

    Made by :func:`_open_sealed` once the copy is open and its manifest decrypted and
    checked; it then holds the ``restore:hot`` lease and the private directory, and gives
    both back in :meth:`finish` or :meth:`abort`.
    """

    def __init__(self, store: StoreCore, ck: Checkpoint, tier: Tier, opened: OpenedCopy,
                 files: dict[str, int], workdir: Path, stack: contextlib.ExitStack,
                 owner: str, threads: int) -> None:
        super().__init__(store, ck, tier, workdir / ck.run / ck.id, None, owner, threads)
        self.opened = opened
        self.files = files
        self.workdir = workdir
        self.stack = stack
        self.reader: ChunkReader | None = None
        self.chunks: dict[str, tuple[str, int]] = {}
        self.hot_dir = store.checkpoint_dir(ck.run, ck.id)
        self.installing = False

    def _get(self, rel: str) -> int:
        """Decrypt one file; a chunk is checked against the manifest before it counts."""
        size = unseal_file(self.opened, self.files[rel], self.directory / rel)
        chunk = self.chunks.get(rel)
        if chunk is not None:
            assert self.reader is not None and self.manifest is not None
            problem = check_chunk(self.reader, self.manifest.arrays[chunk[0]], chunk[1])
            if problem is not None:
                raise IntegrityError(
                    f"the encrypted {self.tier.name} copy of {self.ck.ref} ({self.ck.id}) "
                    f"decrypts, but fails verification: {problem}; run `ckpt verify "
                    f"{self.ck.ref} --tier {self.tier.name}` to repair it")
        return size

    def start(self, manifest: Manifest, groups: Sequence[Sequence[str]]) -> None:
        self.manifest = manifest
        self.reader = ChunkReader(self.directory, manifest, None)
        self.chunks = {array.chunk_path(chunk.i): (array.name, chunk.i)
                       for array in manifest.arrays.values() for chunk in array.chunks}
        # What the hot directory holds already (chunks kept for deltas that read them):
        # an abort during the final copy removes only what it added.
        self.preexisting = _files_under(self.hot_dir)
        # A sealed copy is self-contained: every chunk is in it.
        self._queue(manifest, groups, "ckpt-unseal", own_chunks_only=False)

    def finish(self) -> None:
        assert self.manifest is not None
        # The files no group needed (Zarr documents, chunks of no tensor, the signature);
        # the manifest, its original and the marker were decrypted when the copy was opened.
        rest = [self._fetch(rel) for rel in self.files
                if rel in self.fetched or not (self.directory / rel).exists()]
        for future in rest:
            future.result()
        # Every chunk was checked as it landed: the rest of what a restore checks (the
        # files the manifest lists, their sizes, the Zarr documents, other files' digests).
        problems = verify_checkpoint(self.directory, self.manifest, deep=False)
        problems += [p for p in (check_file(self.directory, True, entry)
                                 for entry in self.manifest.files) if p is not None]
        if problems:
            raise IntegrityError(
                f"the encrypted {self.tier.name} copy of {self.ck.ref} ({self.ck.id}) "
                "decrypts, but fails verification: " + "; ".join(problems[:5])
                + f"; run `ckpt verify {self.ck.ref} --tier {self.tier.name}` to repair it")
        from ckptstore.ops.tiering.replicas import store_tiers

        self.installing = True
        directory, total = install_unsealed(self.ck, self.workdir, self.manifest,
                                            store_tiers(self.store)["hot"],
                                            threads=self.threads)
        self._record(directory, total, self.manifest.digest, encrypted=True)
        self.installing = False
        self._close()

    def abort(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=True)
        if self.installing:
            # The final copy into the hot tier failed half way: only what it added goes.
            _remove_added(self.hot_dir, self.files, self.preexisting)
        self._close()

    def _close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True)
        self.stack.close()  # the private directory, plaintext and all
        super()._close()


def _open_sealed(store: StoreCore, ck: Checkpoint, tier: Tier,
                 key: str | os.PathLike[str] | None,
                 threads: int) -> tuple[_SealedSource, Manifest] | None:
    """Open the sealed copy of ``ck`` on ``tier`` for streaming: its manifest decrypted
    into a private directory and checked, the ``restore:hot`` lease taken. None when
    another restore holds the lease or the hot replica is no longer DELETED.

    Raises:
        DecryptionError: As :func:`~ckptstore.ops.tiering.sealed_tier.open_sealed`.
        IntegrityError: If the manifest fails its checks.
    """
    from ckptstore.ops.leases import lease_owner

    opened = open_sealed(store, ck, tier, key)
    files = member_files(opened, f"the encrypted {tier.name} copy of {ck.ref} ({ck.id})")
    stack = contextlib.ExitStack()
    try:
        workdir = stack.enter_context(private_dir(store.hot))
        directory = workdir / ck.run / ck.id
        directory.mkdir(parents=True)
        for rel in (MANIFEST_NAME, COMMIT_NAME, ORIGINAL_MANIFEST_NAME):
            if rel in files:
                unseal_file(opened, files[rel], directory / rel)
        manifest = read_unsealed_manifest(ck, tier, directory, set(files))
        if manifest.referenced_checkpoints():
            # Sealed copies are self-contained by construction; one that is not cannot be
            # read from its private directory: let the restore say what is wrong.
            stack.close()
            return None
        owner = lease_owner()
        if not store.catalog.acquire_lease(ck.id, _LEASE, owner, _LEASE_TTL_S):
            stack.close()
            return None
        current = store.catalog.get_any(ck.id).replica("hot")
        if current is not None and current.state != ReplicaState.DELETED:
            store.catalog.release_lease(ck.id, _LEASE, owner)
            stack.close()
            return None
    except BaseException:
        stack.close()
        raise
    return _SealedSource(store, ck, tier, opened, files, workdir, stack, owner,
                         threads), manifest


# ---------------------------------------------------------------------- the handle
@dataclass
class _Progress:
    parts: dict[int, Any] = field(default_factory=dict)
    seconds: dict[int, float] = field(default_factory=dict)
    error: BaseException | None = None


class ProgressiveLoad:
    """A load in progress: groups become available one by one, in priority order.

    Created by :func:`load_progressive`. Thread-safe. Use it as a context manager (or call
    :meth:`close`) so an abandoned load stops after the current group.

    Attributes:
        checkpoint: The checkpoint being loaded.
        manifest: Its manifest.
        groups: The groups in load order.
        source: Where the chunks come from: ``memory``, ``hot``, or a remote tier name.
        time_to_manifest_s: Seconds from the call to the manifest being read and checked.
        time_to_plan_s: Seconds from the call to the groups being planned (the call's own
            duration, minus allocating the destination).
    """

    def __init__(
        self,
        checkpoint: Checkpoint,
        manifest: Manifest,
        groups: list[GroupPlan],
        source: _Source,
        destination: Any,
        *,
        threads: int,
        started: float,
        time_to_manifest_s: float,
        time_to_plan_s: float,
        store: StoreCore | None = None,
        key: str | os.PathLike[str] | None = None,
    ) -> None:
        self.checkpoint = checkpoint
        self.manifest = manifest
        self.groups = groups
        self.source = source.name
        self.time_to_manifest_s = time_to_manifest_s
        self.time_to_plan_s = time_to_plan_s
        self._store = store
        self._key = key
        # The catalog's view of the copies as reading starts (after any restore the source
        # needed): what read repair compares against when a group meets damage.
        self._seen = store.catalog.get_any(checkpoint.id) if store is not None else checkpoint
        self._src = source
        self._state = destination
        self._threads = threads
        self._started = started
        self._progress = _Progress()
        self._events = [threading.Event() for _ in groups]
        self._finished = threading.Event()
        self._cancel = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ckpt-progressive", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            self._src.start(self.manifest, [g.keys for g in self.groups])
            for group, event in zip(self.groups, self._events, strict=True):
                if self._cancel.is_set():
                    raise CkptError(
                        f"loading {self.checkpoint.ref} was cancelled before group "
                        f"{group.index}; start a new load to get the rest"
                    )
                part = self._read_group(group)
                self._progress.parts[group.index] = part
                self._progress.seconds[group.index] = time.perf_counter() - self._started
                event.set()
                logger.debug("group %d of %s ready after %.3fs", group.index,
                             self.checkpoint.ref, self._progress.seconds[group.index])
            self._src.finish()
        except BaseException as exc:
            self._progress.error = exc
            try:
                self._src.abort()
            except Exception:
                logger.warning("cleaning up after a failed load of %s failed",
                               self.checkpoint.ref, exc_info=True)
            if not isinstance(exc, Exception):
                raise
        finally:
            for event in self._events:
                event.set()
            self._finished.set()

    def _read_group(self, group: GroupPlan) -> Any:
        """Read one group, falling back once to the next verified copy when the source
        turns out damaged (read repair): the group is read again whole, the groups before it
        were read and verified already."""
        repaired = False
        while True:
            try:
                self._src.ready(group.index)
                return read_checkpoint(
                    self._src.directory, self.manifest, keys=list(group.select),
                    into=self._state, locate=self._src.locate, threads=self._threads,
                )
            except CkptError as exc:
                remote = isinstance(self._src, _RemoteSource | _SealedSource)
                if self._store is None or repaired or not (
                        is_repairable(exc) or (remote and is_not_found(exc))):
                    raise
                self._fall_back(exc)
                repaired = True

    def _fall_back(self, exc: CkptError) -> None:
        """Switch to the hot copy restored from the next verified copy after ``exc``."""
        from ckptstore.ops.tiering.damage import mark_damaged, other_copies
        from ckptstore.ops.tiering.restore import ensure_hot, hot_digest

        store = self._store
        assert store is not None
        failed = self._src
        if failed.name == "hot":
            directory = read_repair(store, self._seen, exc, found_by="progressive load")
        else:
            # A copy streamed from a remote tier (or this host's memory copy) failed: drop
            # what was fetched, mark a damaged remote copy (a sealed one is left to `ckpt
            # verify`, as a restore leaves it), read the hot copy restored from the next
            # verified one.
            failed.abort()
            if not other_copies(store, store.catalog.get_any(self.checkpoint.id), failed.name):
                raise exc
            if isinstance(failed, _RemoteSource) and is_repairable(exc):
                mark_damaged(store, self._seen, failed.name, [str(exc)],
                             found_by="progressive load", seen=self._seen.replica(failed.name))
            try:
                directory = ensure_hot(store, store.catalog.get_any(self.checkpoint.id),
                                       key=self._key)
            except CkptError as failure:
                exc.add_note(f"reading another copy of {self.checkpoint.ref} failed too "
                             f"({failure})")
                raise exc from failure
        self._seen = store.catalog.get_any(self.checkpoint.id)
        self.manifest = read_manifest(directory, expected_digest=hot_digest(store, self._seen))
        self._src = _Source("hot", directory, store.locate)
        self.source = "hot"
        logger.warning("loading %s: the %s copy failed (%s); the rest comes from the hot "
                       "copy restored from the next verified copy", self.checkpoint.ref,
                       failed.name, exc)

    # ------------------------------------------------------------------ waiting
    def done(self, index: int) -> bool:
        """Whether group ``index`` has been loaded."""
        return index in self._progress.parts

    def seconds_to(self, index: int) -> float | None:
        """Seconds from the call to group ``index`` being loaded (None while pending)."""
        return self._progress.seconds.get(index)

    def wait(self, index: int, timeout: float | None = None) -> Any:
        """Wait for group ``index`` and return its part of the state.

        The part holds the group's tensors (final: later groups never write them) inside the
        containers that hold them, like ``load(keys=...)``.

        Args:
            index: Group position (0 is the first priority).
            timeout: Seconds to wait at most (None: no limit).

        Raises:
            IndexError: If there is no such group.
            TimeoutError: If the group is not loaded within ``timeout``.
            CkptError: Whatever made the load fail (IntegrityError, StorageError, ...).
        """
        if not 0 <= index < len(self.groups):
            raise IndexError(f"{self.checkpoint.ref} loads {len(self.groups)} groups; no {index}")
        if not self._events[index].wait(timeout):
            raise TimeoutError(
                f"group {index} of {self.checkpoint.ref} was not loaded within {timeout}s"
            )
        if index not in self._progress.parts:
            assert self._progress.error is not None
            raise self._progress.error
        return self._progress.parts[index]

    def __iter__(self) -> Iterator[tuple[int, Any]]:
        """Yield ``(index, part)`` for every group, in order, as each completes."""
        for index in range(len(self.groups)):
            yield index, self.wait(index)

    def result(self, timeout: float | None = None) -> Any:
        """Wait for every group (and the hot copy, when streaming) and return the whole state.

        Raises:
            TimeoutError: If the load does not finish within ``timeout``.
            CkptError: Whatever made the load fail.
        """
        if not self._finished.wait(timeout):
            raise TimeoutError(f"loading {self.checkpoint.ref} did not finish within {timeout}s")
        if self._progress.error is not None:
            raise self._progress.error
        return self._state

    def close(self) -> None:
        """Stop after the current group and wait for the loader (idempotent)."""
        self._cancel.set()
        self._thread.join()

    def __enter__(self) -> ProgressiveLoad:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        done = len(self._progress.parts)
        return (f"ProgressiveLoad({self.checkpoint.ref}, from {self.source}, "
                f"{done}/{len(self.groups)} groups)")


# ---------------------------------------------------------------------- entry point
def _pick_source(
    store: StoreCore, ck: Checkpoint, prefer_memory: bool, threads: int,
    key: str | os.PathLike[str] | None = None,
) -> tuple[_Source, Manifest]:
    from ckptstore.ops.leases import lease_owner
    from ckptstore.ops.tiering.replicas import manifest_on, store_tiers, tier_rank
    from ckptstore.ops.tiering.restore import ensure_hot, hot_digest

    if prefer_memory:
        found = memory_copy(store, ck)
        if found is not None:
            return _Source("memory", found[0], None), found[1]

    def hot() -> tuple[_Source, Manifest]:
        directory = ensure_hot(store, ck, key=key)
        return (_Source("hot", directory, store.locate),
                read_manifest(directory, expected_digest=hot_digest(store, ck)))

    replica = ck.replica("hot")
    if replica is not None and replica.state == ReplicaState.PRESENT:
        return hot()
    tiers = store_tiers(store)
    # Sealed copies only with a key to open them; without one the restore (hot()) asks.
    unseal = decryption_key_path(key, store.settings.decrypt_key) is not None
    remote = sorted(
        (tiers[r.tier] for r in ck.replicas
         if r.state == ReplicaState.PRESENT and r.tier in tiers and r.tier != "hot"
         and tiers[r.tier].readable and (unseal or not r.sealed)),
        key=lambda t: tier_rank(t.name),
    )
    if not remote or (replica is not None and replica.state != ReplicaState.DELETED):
        return hot()  # nothing to stream from, or the hot copy is in transition
    first = ck.replica(remote[0].name)
    if first is not None and first.sealed:
        try:
            sealed = _open_sealed(store, ck, remote[0], key, max(threads, _PREFETCH_THREADS))
        except (IntegrityError, StorageError) as exc:
            # A key it was not encrypted to, a damaged copy, an outage: the restore tries
            # every copy in turn and says what is wrong with each (DecryptionError included).
            logger.warning("cannot stream %s from the encrypted %s copy (%s); restoring it "
                           "first", ck.ref, remote[0].name, exc)
            return hot()
        return hot() if sealed is None else sealed
    manifest = manifest_on(remote[0], ck)
    for base_id in manifest.referenced_checkpoints():
        base = store.catalog.get_any(base_id).replica("hot")
        if base is None or base.state != ReplicaState.PRESENT:
            return hot()  # a delta reads its bases' hot directories: restore them whole
    owner = lease_owner()
    if not store.catalog.acquire_lease(ck.id, _LEASE, owner, _LEASE_TTL_S):
        return hot()  # another restore is running: wait for it
    current = store.catalog.get_any(ck.id).replica("hot")
    if current is not None and current.state != ReplicaState.DELETED:
        store.catalog.release_lease(ck.id, _LEASE, owner)
        return hot()
    return _RemoteSource(store, ck, remote[0], owner, max(threads, _PREFETCH_THREADS)), manifest


def load_progressive(
    store: StoreCore,
    ref: str,
    order: Order,
    *,
    into: Any | None = None,
    strict: bool = True,
    prefer_memory: bool = True,
    threads: int | None = None,
    key: str | os.PathLike[str] | None = None,
) -> ProgressiveLoad:
    """Start loading a checkpoint group by group in priority order; return at once.

    Args:
        store: The open store.
        ref: Checkpoint reference.
        order: Groups in load order, each an fnmatch pattern or a list of patterns
            (e.g. ``["model/*", "optimizer/state/*"]``); the rest loads last.
        into: A live state whose tensors (same path, shape and dtype) are filled in place.
        strict: Raise if a pattern matches no tensor.
        prefer_memory: Use this host's memory copy when there is one.
        threads: Reader threads per group (default the store's ``threads``).
        key: Private key that opens a sealed copy (an encrypted tier), which is then
            streamed; default ``$CKPT_DECRYPT_KEY``, else ``decrypt_key``. Without one a
            sealed copy is restored first (which raises DecryptionError).

    Returns:
        A :class:`ProgressiveLoad`; ``wait(i)``/iteration give groups as they complete,
        ``result()`` the whole state.

    Raises:
        CheckpointNotFoundError: If the reference does not resolve or no tier has a copy.
        InvalidNameError: If ``order`` is malformed or (``strict``) a pattern matches nothing.
        IntegrityError: If the manifest is damaged.
        DecryptionError: If the only copies are sealed and no key, or a key they were not
            encrypted to, was given, or they are altered.
    """
    started = time.perf_counter()
    threads = threads or store.settings.threads
    ck = store.catalog.get(ref)
    source, manifest = _pick_source(store, ck, prefer_memory, threads, key)
    manifest_s = time.perf_counter() - started
    try:
        groups = plan_groups(manifest, order, strict=strict)
        plan_s = time.perf_counter() - started
        destination = _destination(manifest, into)
    except BaseException:
        source.abort()
        raise
    logger.info(
        "progressive load of %s from %s: manifest after %.1f ms, %d groups planned after "
        "%.1f ms", ck.ref, source.name, manifest_s * 1000, len(groups), plan_s * 1000,
    )
    return ProgressiveLoad(ck, manifest, groups, source, destination, threads=threads,
                           started=started, time_to_manifest_s=manifest_s,
                           time_to_plan_s=plan_s, store=store, key=key)
