"""Memory tier: the newest checkpoints staged in host shared memory, to survive a crash.

After a save commits on the hot tier, a second copy of the same state is written to
``/dev/shm/ckptstore/<store id>/<run>/<checkpoint id>/`` (the usual checkpoint directory
format, codec ``none``: loading it is a memcpy plus a crc32c check) and recorded in the catalog
as replica ``tier="memory"``, state PRESENT. A training process that is killed and restarted
on the same host then loads from shared memory without touching the disk; ``/dev/shm``
outlives the process but not a reboot.

Rules that keep this safe:

* It is an **extra** copy: it is written only after the hot save committed, and it is never
  marked verified, so tier moves and retention (which count verified copies) never treat it
  as a copy that could replace the hot one.
* The copy's own manifest differs from the hot one (another codec), so the replica URI
  records its digest: ``shm://<host>/dev/shm/ckptstore/<id>/<run>/<ckpt>?digest=<blake3>``.
  Loading checks the copy's manifest against that digest and every chunk's crc32c; a copy on
  another host is never used, a vanished one (reboot, eviction) is marked DELETED, a damaged
  one DAMAGED, and the load falls back to the hot tier.
* A byte budget (``memory_tier_bytes``; 0 = off, the default, because ``/dev/shm`` is RAM that
  counts against the job's memory limit) bounds the tier: staging evicts the oldest copies
  first, and skips a state larger than the budget or the free space.
* Copies whose catalog replica is no longer PRESENT (pruned checkpoints, other evictions) and
  staging directories of dead processes are swept before each staging.

Example:
    >>> store = StoreCore.open("./ckpt", memory_tier_bytes=8 * 2**30)  # doctest: +SKIP
    >>> ck = store.save("run-a", 100, state)          # hot commit, then the memory copy
    >>> # ... the process is killed; a new one on the same host:
    >>> state = store.load("run-a@latest")            # read from /dev/shm, no disk access
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ckptstore.core import StoreCore, StoreService
from ckptstore.errors import (
    CheckpointNotFoundError,
    CkptError,
    ConfigError,
    IncompleteCheckpointError,
    IntegrityError,
    StorageError,
)
from ckptstore.format import Manifest, read_checkpoint, read_manifest, write_checkpoint
from ckptstore.format.constants import COMMIT_NAME
from ckptstore.identity import host
from ckptstore.records import Checkpoint, CheckpointState, ReplicaState
from ckptstore.storage.shm import (
    DEFAULT_MEMORY_ROOT,
    MemoryCopy,
    MemoryLocation,
    SharedMemoryArea,
    dir_bytes,
    parse_memory_uri,
    remove_copy,
)

__all__ = [
    "DEFAULT_MEMORY_ROOT",
    "MEMORY_TIER",
    "MemoryCopy",
    "MemoryLocation",
    "MemoryTier",
    "attach_memory_tier",
    "detach_memory_tier",
    "drop_memory_copy",
    "load_from_memory",
    "memory_copy",
    "memory_replica_here",
    "memory_tier_for",
    "parse_memory_uri",
    "stage_after_commit",
    "store_id",
]

logger = logging.getLogger(__name__)

#: Tier name of memory replicas in the catalog.
MEMORY_TIER = "memory"
# Free space kept on the shared-memory file system for everyone else (other jobs use it too).
_FREE_MARGIN_BYTES = 64 * 1024**2


def store_id(store: StoreCore) -> str:
    """A short id of the store, the same in every process that opens it.

    Derived from the catalog URL (checkpoint ids are unique per catalog); hashed, so a
    password in the URL never reaches a path.
    """
    url = store.settings.resolved_catalog_url
    return hashlib.sha256(url.encode("utf-8")).hexdigest()[:16]


class MemoryTier(StoreService):
    """This store's copies in host shared memory: staging, budget, eviction, sweeping.

    Thread- and process-safe: staging, eviction and sweeping hold an exclusive ``flock`` on
    ``<root>/.lock``; loads take no lock (a copy evicted under a reader makes its read fail,
    and the reader falls back to the hot tier).

    Attributes:
        store: The store.
        budget_bytes: Most bytes the tier may hold.
        root: This store's directory in shared memory (``<memory dir>/<store id>``).
        host: This machine's host name (recorded in replica URIs).
    """

    def __init__(
        self,
        store: StoreCore,
        budget_bytes: int,
        *,
        root: str | os.PathLike[str] | None = None,
    ) -> None:
        """Create the tier (nothing is written before the first staging).

        Args:
            store: The open store.
            budget_bytes: Most bytes of shared memory the tier may use (> 0).
            root: Parent directory of the per-store tier directories
                (default :data:`DEFAULT_MEMORY_ROOT`).

        Raises:
            ConfigError: If the budget is not a positive int.
        """
        if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int) or budget_bytes <= 0:
            raise ConfigError(
                f"memory_tier_bytes must be a positive int to enable the memory tier, got "
                f"{budget_bytes!r}; set it to a few times the size of the training state"
            )
        self.store = store
        self.budget_bytes = budget_bytes
        self.area = SharedMemoryArea(
            Path(root) if root is not None else DEFAULT_MEMORY_ROOT, store_id(store)
        )
        self.base = self.area.base
        self.root = self.area.root
        self.host = host()

    # ------------------------------------------------------------------ the area
    def path_for(self, run: str, ckpt_id: str) -> Path:
        """Directory of a checkpoint's copy in this tier."""
        return self.area.path_for(run, ckpt_id)

    def owns(self, path: Path) -> bool:
        """Whether ``path`` is a checkpoint directory inside this tier (safe to delete)."""
        return self.area.owns(path)

    def copies(self) -> list[MemoryCopy]:
        """Committed copies in this tier, oldest first."""
        return self.area.copies()

    def usage(self) -> int:
        """Bytes the tier occupies now (copies and unfinished staging directories)."""
        return self.area.usage()

    def free_bytes(self) -> int | None:
        """Free space on the shared-memory file system, or None if unknown."""
        return self.area.free_bytes()

    # ------------------------------------------------------------------ staging
    def stage(self, ck: Checkpoint, state: Any) -> Path | None:
        """Write ``state`` as the memory copy of committed checkpoint ``ck`` and record it.

        Older copies are evicted first as needed to stay within the budget and the free
        space of the file system.

        Args:
            ck: The checkpoint, already COMMITTED on the hot tier.
            state: The same state that was saved, or the save's flattened state
                (:class:`~ckptstore.format.FlatState`: not walked again).

        Returns:
            The copy's directory, or None when it does not fit (logged).

        Raises:
            StorageError: If shared memory cannot be written.
            UnsafeObjectError: If the state holds an object that would need pickle.
        """
        started = time.perf_counter()
        settings = self.store.settings
        if ck.lossy:
            # A load must return what the hot copy holds (approximate values), not the state.
            logger.info("not staging %s in the memory tier: it is a lossy delta", ck.ref)
            return None
        # Codec none stores the bytes as they are, plus a 4-byte trailer per chunk and the
        # metadata files; the real size is checked after writing.
        need = ck.logical_bytes + ck.logical_bytes // 100 + 1024**2
        if need > self.budget_bytes:
            logger.warning(
                "not staging %s in the memory tier: it needs about %d bytes, over the "
                "%d-byte budget (raise memory_tier_bytes to keep it in shared memory)",
                ck.ref, need, self.budget_bytes,
            )
            return None
        with self.area.locked():
            self._sweep_locked()
            if not self._make_room_locked(need, keep=ck.id):
                return None
            final = self.path_for(ck.run, ck.id)
            staging = self.area.staging_path(ck.run, ck.id)
            shutil.rmtree(staging, ignore_errors=True)
            try:
                final.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
                manifest = write_checkpoint(
                    staging, state, ckpt_id=ck.id, run=ck.run, step=ck.step, codec="none",
                    chunk_bytes=settings.chunk_bytes, threads=settings.threads,
                )
                self._check_same_content(ck, manifest)
                if final.exists():
                    remove_copy(final)
                os.rename(staging, final)
            except BaseException:
                shutil.rmtree(staging, ignore_errors=True)
                raise
            size = dir_bytes(final)
            if size > need:  # the estimate was short: make room for what was really written
                self._make_room_locked(size - need, keep=ck.id)
            location = MemoryLocation(self.host, final, manifest.digest)
            try:
                self.store.catalog.set_replica(
                    ck.id, MEMORY_TIER, uri=location.uri(), state=ReplicaState.PRESENT,
                    bytes=size,
                )
            except BaseException:
                remove_copy(final)
                raise
        logger.info(
            "staged %s in the memory tier (%d bytes) in %.2fs",
            ck.ref, size, time.perf_counter() - started,
        )
        return final

    def _check_same_content(self, ck: Checkpoint, manifest: Manifest) -> None:
        """Refuse a copy whose tensors differ from what the hot save committed.

        Both manifests carry the blake3 of every unencoded chunk, and the chunk layout does
        not depend on the codec, so equal hashes mean the same bytes. This catches a state
        changed between the hot save and the staging.

        Raises:
            IntegrityError: If the content differs.
        """
        hot = self.store.checkpoint_dir(ck.run, ck.id)
        try:
            committed = read_manifest(hot, expected_digest=ck.manifest_digest)
        except CkptError:
            return  # no readable hot manifest to compare with (moved already): trust the state
        mine = {name: [c.blake3 for c in a.chunks] for name, a in manifest.arrays.items()}
        theirs = {name: [c.blake3 for c in a.chunks] for name, a in committed.arrays.items()}
        if mine != theirs or manifest.tree != committed.tree:
            raise IntegrityError(
                f"the memory copy of {ck.ref} differs from the committed checkpoint: the state "
                "changed after it was saved; it was not staged (pass the state that was saved)"
            )

    def _make_room_locked(self, need: int, *, keep: str) -> bool:
        copies = [c for c in self.copies() if c.checkpoint_id != keep]
        used = self.usage()
        free = self.free_bytes()
        evicted: list[str] = []
        while copies and (
            used + need > self.budget_bytes
            or (free is not None and free < need + _FREE_MARGIN_BYTES)
        ):
            oldest = copies.pop(0)
            self._evict_copy(oldest)
            evicted.append(oldest.checkpoint_id)
            used -= oldest.bytes
            if free is not None:
                free += oldest.bytes
        if evicted:
            logger.info("memory tier: evicted %d older copies: %s", len(evicted), evicted)
        if free is not None and free < need + _FREE_MARGIN_BYTES:
            logger.warning(
                "not staging in the memory tier: %s has %d bytes free, %d needed; "
                "enlarge /dev/shm or lower memory_tier_bytes",
                self.root, free, need,
            )
            return False
        return True

    def _evict_copy(self, copy: MemoryCopy) -> None:
        # The catalog first: from here on no loader picks this copy.
        self._drop_replica(copy.checkpoint_id, copy.path, ReplicaState.DELETED)
        remove_copy(copy.path)

    def _drop_replica(self, ckpt_id: str, path: Path, state: ReplicaState) -> None:
        try:
            replicas = self.store.catalog.replicas(ckpt_id)
        except CheckpointNotFoundError:
            return
        for replica in replicas:
            if replica.tier != MEMORY_TIER or replica.state != ReplicaState.PRESENT:
                continue
            location = parse_memory_uri(replica.uri)
            if location is not None and location.host == self.host and location.path == path:
                self.store.catalog.set_replica(ckpt_id, MEMORY_TIER, state=state, bytes=0)

    # ------------------------------------------------------------------ housekeeping
    def sweep(self) -> list[Path]:
        """Remove copies the catalog no longer lists as PRESENT, and dead staging dirs.

        Returns:
            The directories removed.
        """
        with self.area.locked():
            return self._sweep_locked()

    def _sweep_locked(self) -> list[Path]:
        removed: list[Path] = []
        for ck_dir, dead_staging in self.area.entries():
            if dead_staging:
                shutil.rmtree(ck_dir, ignore_errors=True)
                removed.append(ck_dir)
            elif not self._wanted(ck_dir):
                remove_copy(ck_dir)
                removed.append(ck_dir)
        self.area.prune_empty_runs()
        if removed:
            logger.info("memory tier: swept %d stale directories", len(removed))
        return removed

    def _wanted(self, ck_dir: Path) -> bool:
        try:
            ck = self.store.catalog.get_any(ck_dir.name)
        except (CheckpointNotFoundError, CkptError):
            return False
        replica = ck.replica(MEMORY_TIER)
        if ck.state != CheckpointState.COMMITTED or replica is None:
            return False
        location = parse_memory_uri(replica.uri)
        return (
            replica.state == ReplicaState.PRESENT
            and location is not None
            and location.host == self.host
            and location.path == ck_dir
        )

    def close(self) -> None:
        """Nothing to release: copies outlive the process on purpose (a restart reads them)."""

    def evict(self, ckpt_ids: Sequence[str] | None = None) -> int:
        """Evict some copies (all when ``ckpt_ids`` is None); return how many went."""
        count = 0
        with self.area.locked():
            for copy in self.copies():
                if ckpt_ids is None or copy.checkpoint_id in ckpt_ids:
                    self._evict_copy(copy)
                    count += 1
        return count


# ---------------------------------------------------------------------- store wiring
def attach_memory_tier(
    store: StoreCore,
    budget_bytes: int,
    *,
    root: str | os.PathLike[str] | None = None,
) -> MemoryTier:
    """Enable the memory tier for this store object (instead of the settings).

    Args:
        store: The open store.
        budget_bytes: Most bytes of shared memory to use.
        root: Parent directory of per-store tier directories (default ``/dev/shm/ckptstore``).

    Returns:
        The tier, also used by later saves and loads through this store.

    Raises:
        ConfigError: If the budget is not a positive int.
    """
    tier = MemoryTier(store, budget_bytes, root=root)
    store.memory_tier = tier
    store.memory_tier_resolved = True
    return tier


def detach_memory_tier(store: StoreCore) -> None:
    """Turn the memory tier off for this store object (existing copies stay usable)."""
    store.memory_tier = None
    store.memory_tier_resolved = True


def memory_tier_for(store: StoreCore) -> MemoryTier | None:
    """The store's memory tier: attached, or from ``memory_tier_bytes``; None when off."""
    if not store.memory_tier_resolved:
        budget = int(store.settings.memory_tier_bytes or 0)
        root = store.settings.memory_tier_dir
        store.memory_tier = MemoryTier(store, budget, root=root) if budget > 0 else None
        store.memory_tier_resolved = True
    tier = store.memory_tier
    return tier if isinstance(tier, MemoryTier) else None


def stage_after_commit(store: StoreCore, ck: Checkpoint, state: Any) -> bool:
    """Stage a just-committed checkpoint in the memory tier, if the store has one.

    Never raises: the hot save is committed, and a memory copy is only a speed-up.

    Returns:
        Whether a memory copy was recorded (the catalog record of ``ck`` then changed).
    """
    tier = memory_tier_for(store)
    if tier is None:
        return False
    try:
        return tier.stage(ck, state) is not None
    except Exception:
        logger.warning("could not stage %s in the memory tier", ck.ref, exc_info=True)
        return False


def memory_replica_here(ck: Checkpoint) -> bool:
    """Whether the catalog lists a PRESENT memory copy of ``ck`` on this host (no I/O)."""
    replica = ck.replica(MEMORY_TIER)
    if replica is None or replica.state != ReplicaState.PRESENT:
        return False
    location = parse_memory_uri(replica.uri)
    return location is not None and location.host == host()


def drop_memory_copy(store: StoreCore, ck: Checkpoint, *, actor: str | None = None) -> int:
    """Delete a checkpoint's memory copy: the replica becomes DELETED, then its files go.

    This is what deleting the ``memory`` replica means (retention pruning a checkpoint, a
    forced delete). Files are removed only when they are on this host, at the place this
    store's memory tier keeps them; copies on other hosts are swept by their own tier.

    Returns:
        The number of files deleted.
    """
    try:
        current = store.catalog.get_any(ck.id)
    except CheckpointNotFoundError:
        return 0
    replica = current.replica(MEMORY_TIER)
    if replica is None or replica.state == ReplicaState.DELETED:
        return 0
    store.catalog.set_replica(ck.id, MEMORY_TIER, state=ReplicaState.DELETED, bytes=0)
    location = parse_memory_uri(replica.uri)
    tier = memory_tier_for(store)
    base = tier.base if tier is not None else Path(
        store.settings.memory_tier_dir or DEFAULT_MEMORY_ROOT)
    files = 0
    # Only ever delete where this store keeps copies: the URI came from the catalog.
    if (location is not None and location.host == host()
            and location.path == base / store_id(store) / current.run / current.id):
        files = sum(len(names) for _d, _s, names in os.walk(location.path))
        remove_copy(location.path)
    store.catalog.record_event("replica_deleted", checkpoint_id=ck.id, actor=actor,
                               detail={"tier": MEMORY_TIER, "files": files, "kept_chunks": 0})
    return files


def _forget(store: StoreCore, ck: Checkpoint, location: MemoryLocation,
            state: ReplicaState, why: str) -> None:
    """Mark a memory replica unusable (if still the one we read) and drop our own files."""
    logger.info("memory copy of %s at %s %s: using another tier", ck.ref, location.path, why)
    try:
        for replica in store.catalog.replicas(ck.id):
            if (
                replica.tier == MEMORY_TIER
                and replica.state == ReplicaState.PRESENT
                and parse_memory_uri(replica.uri) == location
            ):
                store.catalog.set_replica(ck.id, MEMORY_TIER, state=state, bytes=0)
    except CkptError:
        logger.warning("could not update the memory replica of %s", ck.ref, exc_info=True)
    tier = memory_tier_for(store)
    # Only ever delete inside our own tier: the path came from the catalog.
    if tier is not None and tier.owns(location.path):
        remove_copy(location.path)


def memory_copy(store: StoreCore, ck: Checkpoint) -> tuple[Path, Manifest] | None:
    """The checkpoint's usable memory copy on this host, with its checked manifest.

    Costs nothing when the catalog lists no PRESENT memory replica on this host. A copy that
    is gone is marked DELETED, one whose manifest does not match DAMAGED.

    Returns:
        ``(directory, manifest)``, or None when there is no usable copy.
    """
    if not memory_replica_here(ck):
        return None
    replica = ck.replica(MEMORY_TIER)
    location = parse_memory_uri(replica.uri) if replica is not None else None
    if location is None:
        return None
    try:
        manifest = read_manifest(location.path, expected_digest=location.digest)
    except (CheckpointNotFoundError, IncompleteCheckpointError):
        _forget(store, ck, location, ReplicaState.DELETED, "is gone (reboot or eviction)")
        return None
    except IntegrityError as exc:
        _forget(store, ck, location, ReplicaState.DAMAGED, f"is damaged ({exc})")
        return None
    except StorageError as exc:
        logger.warning("cannot read the memory copy of %s: %s", ck.ref, exc)
        return None
    if manifest.id != ck.id:
        _forget(store, ck, location, ReplicaState.DAMAGED, "holds another checkpoint")
        return None
    return location.path, manifest


def load_from_memory(
    store: StoreCore,
    ck: Checkpoint,
    *,
    keys: Sequence[str] | None = None,
    into: Any | None = None,
) -> tuple[bool, Any]:
    """Load a checkpoint from its memory copy on this host, if it has a good one.

    Args:
        store: The open store.
        ck: The committed checkpoint.
        keys: fnmatch patterns, as :meth:`StoreCore.load`.
        into: A live state to fill in place, as :meth:`StoreCore.load`.

    Returns:
        ``(True, state)`` when loaded from shared memory, ``(False, None)`` when the caller
        must load from another tier (``into`` may then be partly overwritten).

    Raises:
        InvalidNameError: If a key pattern matches nothing.
    """
    found = memory_copy(store, ck)
    if found is None:
        return False, None
    path, manifest = found
    started = time.perf_counter()
    try:
        state = read_checkpoint(path, manifest, keys=keys, into=into,
                                threads=store.settings.threads)
    except (IntegrityError, StorageError) as exc:
        gone = not (path / COMMIT_NAME).exists()
        replica = ck.replica(MEMORY_TIER)
        location = parse_memory_uri(replica.uri) if replica is not None else None
        if location is not None:
            _forget(store, ck, location,
                    ReplicaState.DELETED if gone else ReplicaState.DAMAGED,
                    "vanished while reading" if gone else f"failed to read ({exc})")
        return False, None
    logger.info("loaded %s from the memory tier in %.3fs", ck.ref, time.perf_counter() - started)
    return True, state
