"""Distributed checkpoints through ``torch.distributed.checkpoint`` (DCP).

Many ranks save one catalogued checkpoint in parallel, and it loads back on any number of
ranks with any placement, through the DCP API users already run::

    writer = store.dcp_writer("run-a", step=100)          # on every rank
    dcp.save(state, storage_writer=writer)                 # DTensor / FSDP2 / ShardedTensor
    dcp.load(state, storage_reader=store.dcp_reader("run-a@latest"))   # any world size

or the store's own calls: ``store.save(..., distributed=True)`` /
``store.load(ref, into=state)``. A plain ``store.load(ref)`` (no process group needed)
returns full tensors.

How a save runs (DCP's call sequence; see :mod:`ckptstore.format.dcp.layout` for the
layout on disk):

1. every rank: ``prepare_local_plan`` checks that every dtype can be stored;
2. the coordinator: ``prepare_global_plan`` sees all shards, allocates the version in the
   catalog (PENDING row), creates the directory and decides which array every shard goes to
   (:mod:`~ckptstore.format.dcp.plan`); the decision and the checkpoint id travel back
   to the ranks in ``SavePlan.storage_data``, through DCP's own scatter;
3. every rank: ``write_data`` writes whole chunks of its own shards (never a chunk another
   rank writes), its small shards packed, fsyncs them, returns (:mod:`~.dcp_write`);
4. the coordinator, only after every rank returned: ``finish`` writes the manifest (with the
   index), the commit marker, and flips the catalog row to COMMITTED (:mod:`~.dcp_commit`).

If any rank fails, DCP raises on every rank and ``finish`` never runs: nothing is
committed. The writer's context manager (and ``store.save(distributed=True)``) then marks the
row FAILED and removes the directory; without it, ``ckpt gc`` does once the process exits.

Non-tensor items: DCP's planner hands us ``torch.save`` bytes; we store them as they are
(never pickling anything ourselves). On load they go back to DCP's planner, which applies
DCP's own rules (its default planner uses ``torch.load(weights_only=False)``);
``store.load`` uses :class:`SafeLoadPlanner` (``weights_only=True``) instead, and the
full load without a process group does the same.
"""

from __future__ import annotations

import io
import logging
import os
import shutil
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    ReadItem,
    SavePlan,
    SavePlanner,
    WriteItemType,
)
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult
from torch.futures import Future

from ckptstore.core import StoreCore
from ckptstore.durable import storage_error
from ckptstore.errors import (
    CkptError,
    ConfigError,
    IncompleteCheckpointError,
    IntegrityError,
    InvalidNameError,
    StorageError,
    UnsafeObjectError,
)
from ckptstore.faultpoints import fault_point
from ckptstore.format import Manifest, read_manifest
from ckptstore.format.codecs import codec_spec
from ckptstore.format.constants import COMMIT_NAME, DCP_ARRAY_GROUP, DCP_PACK_GROUP
from ckptstore.format.dcp.boxes import BoxLoc, build_metadata, stored_boxes
from ckptstore.format.dcp.chunks import ChunkSource, Request, load_blob, run_requests
from ckptstore.format.dcp.commit import build_index, commit_files
from ckptstore.format.dcp.layout import BlobItem, is_dcp_manifest
from ckptstore.format.dcp.plan import ArraySpec, RankTask, assign_slots, item_dtype_name
from ckptstore.format.dcp.read import index_of, load_full, verify_dcp
from ckptstore.format.dcp.write import write_rank
from ckptstore.identity import writer_id
from ckptstore.names import validate_name, validate_tag
from ckptstore.ops.dcp_stage import StagedSet, pool_for, stage_state
from ckptstore.ops.save import save_checkpoint

if TYPE_CHECKING:
    from ckptstore.records import Checkpoint

__all__ = [
    "PACK_BELOW",
    "SafeLoadPlanner",
    "ZarrStorageReader",
    "ZarrStorageWriter",
    "dcp_reader",
    "dcp_writer",
    "is_dcp_manifest",
    "load_dcp",
    "load_full",
    "needs_dcp",
    "save_distributed",
    "verify_dcp",
]

logger = logging.getLogger(__name__)

#: Shards smaller than this are packed per rank instead of getting an array of their own.
PACK_BELOW = 1024 * 1024


def _dist_on() -> bool:
    return dist.is_available() and dist.is_initialized()


# --------------------------------------------------------------------------- writer
class ZarrStorageWriter(StorageWriter, AsyncStager):
    """DCP ``StorageWriter`` that saves one catalogued ckptstore checkpoint from all ranks.

    Create one per save on every rank (``store.dcp_writer(run, step)``) with the same
    arguments; only the coordinator (rank 0) touches the catalog. All ranks must see the
    store's hot tier at the same path (a shared filesystem across hosts), as with DCP's
    ``FileSystemWriter``. The writer is also an ``AsyncStager``: ``dcp.async_save`` stages
    into the store's bounded, reused staging buffers.

    Use it as a context manager so a failed save is marked FAILED and its files removed at
    once::

        with store.dcp_writer("run-a", 100) as writer:
            dcp.save(state, storage_writer=writer)
        ck = writer.checkpoint

    Args:
        store: The open store (on every rank).
        run: Run name.
        step: Training step.
        metrics: Metrics recorded with the checkpoint.
        tags: Tags.
        parent: Reference of the checkpoint this run resumed from.
        codec: Codec preset (default: the store's).
        experiment: Experiment to file the run under.
        pack_below: Shards smaller than this many bytes are packed per rank.

    Raises:
        InvalidNameError: For a bad run name, step, tag or codec (on every rank, before any
            I/O or collective).
    """

    # Our stage() returns the staged state itself: nothing to synchronize afterwards.
    _synchronize_after_execute = False

    def __init__(
        self,
        store: StoreCore,
        run: str,
        step: int,
        *,
        metrics: Mapping[str, float] | None = None,
        tags: Sequence[str] = (),
        parent: str | None = None,
        codec: str | None = None,
        experiment: str | None = None,
        pack_below: int = PACK_BELOW,
    ) -> None:
        validate_name(run)
        for tag in tags:
            validate_tag(tag)
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise InvalidNameError(f"step must be a non-negative int, got {step!r}")
        self.store = store
        self.run = run
        self.step = step
        self.metrics = dict(metrics) if metrics is not None else None
        self.tags = tuple(tags)
        self.parent = parent
        self.codec = codec or store.settings.codec
        try:
            codec_spec(self.codec)
        except ValueError as exc:
            raise InvalidNameError(str(exc)) from None
        self.experiment = experiment
        self.pack_below = int(pack_below)
        self.is_coordinator = False
        self._pending: Checkpoint | None = None  # coordinator: the row of the save under way
        self._directory: Path | None = None
        self._specs: dict[str, ArraySpec] = {}
        self._ckpt_id: str | None = None
        self._committed: Checkpoint | None = None
        self._staged: StagedSet | None = None

    # -- DCP StorageWriter ----------------------------------------------------------------
    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        """Start a new save; ``checkpoint_id`` is refused (the catalog names checkpoints).

        Raises:
            ConfigError: If a ``checkpoint_id`` is given.
        """
        if checkpoint_id is not None:
            raise ConfigError(
                f"ZarrStorageWriter names checkpoints through the catalog; do not pass "
                f"checkpoint_id={checkpoint_id!r} to dcp.save (use store.dcp_writer(run, step))"
            )

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        """Take the coordinator role or not; forget any earlier save of this writer.

        Raises:
            ConfigError: With ``use_collectives=False`` (there would be no coordinator to
                commit one checkpoint for all ranks).
        """
        if kwargs.get("use_collectives") is False:
            raise ConfigError(
                "dcp.save(use_collectives=False) is not supported by ZarrStorageWriter: one "
                "coordinator must commit the checkpoint after every rank finished"
            )
        if self._pending is not None and self._committed is None:
            self.abort(CkptError("a new save started with the same writer"))
        self.is_coordinator = is_coordinator
        self._pending = None
        self._directory = None
        self._specs = {}
        self._ckpt_id = None
        self._committed = None

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        """Refuse dtypes the format cannot store, before anything is written."""
        for item in plan.items:
            if item.type != WriteItemType.BYTE_IO and item.tensor_data is not None:
                item_dtype_name(item.tensor_data.properties.dtype, item.index.fqn)
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        """Coordinator: allocate the version, create the directory, assign every shard."""
        settings = self.store.settings
        catalog = self.store.catalog
        slots, specs = assign_slots(
            plans, chunk_bytes=settings.chunk_bytes, pack_below=self.pack_below
        )
        parent_id = catalog.get(self.parent).id if self.parent is not None else None
        if self.experiment is not None:
            catalog.ensure_run(self.run, experiment=self.experiment)
        ck = catalog.begin_checkpoint(
            self.run,
            self.step,
            metrics=self.metrics,
            tags=self.tags,
            parent_id=parent_id,
            codec=self.codec,
            writer=writer_id(),
            tier="hot",
            uri="",
        )
        self._pending = ck
        directory = self.store.checkpoint_dir(self.run, ck.id)
        self._directory = directory
        self._specs = specs
        try:
            directory.parent.mkdir(parents=True, exist_ok=True)
            directory.mkdir()
            (directory / DCP_ARRAY_GROUP).mkdir()
            (directory / DCP_PACK_GROUP).mkdir()
        except OSError as exc:
            err = storage_error(directory, "create checkpoint directory", exc)
            self.abort(err)
            raise err from exc
        fault_point("dcp.pending")
        logger.debug("DCP save %s step %s -> %s (%d ranks)", self.run, self.step, ck.id, len(plans))
        return [
            replace(
                plan,
                storage_data=RankTask(
                    ckpt_id=ck.id,
                    directory=str(directory),
                    rank=rank,
                    codec=self.codec,
                    chunk_bytes=settings.chunk_bytes,
                    threads=settings.threads,
                    slots=slots[rank],
                ),
            )
            for rank, plan in enumerate(plans)
        ]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        """Write this rank's shards (whole chunks only) and fsync them.

        Raises:
            CkptError: If the plan did not come from this writer's coordinator (DCP plan
                caching is not supported).
            StorageError: On OS errors.
        """
        try:
            task = plan.storage_data
            if not isinstance(task, RankTask):
                raise CkptError(
                    "the save plan carries no ZarrStorageWriter task: use ZarrStorageWriter on "
                    "every rank and do not enable DCP plan caching"
                )
            self._ckpt_id = task.ckpt_id
            results = write_rank(task, plan, planner, fault=fault_point)
        finally:
            self._release_staging()
        future: Future[list[WriteResult]] = Future()
        future.set_result(results)
        return future

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """Coordinator, after every rank wrote: manifest, marker, catalog COMMITTED."""
        ck, directory = self._pending, self._directory
        if ck is None or directory is None:
            raise CkptError("finish() called before prepare_global_plan(); this is a DCP misuse")
        try:
            index, meta_files = build_index(metadata, results, self._specs, self.codec)
            manifest = commit_files(
                directory,
                ckpt_id=ck.id,
                run=self.run,
                step=self.step,
                chunk_bytes=self.store.settings.chunk_bytes,
                index=index,
                meta_files=meta_files,
                fault=fault_point,
            )
            self._committed = self.store.catalog.commit_checkpoint(
                ck.id,
                manifest_digest=manifest.digest,
                logical_bytes=manifest.logical_bytes,
                stored_bytes=manifest.stored_bytes,
                tier="hot",
                uri=str(directory),
            )
        except BaseException as exc:
            self.abort(exc)
            raise
        fault_point("dcp.committed")
        logger.info(
            "saved %s step %s as v%s from %d ranks (%s bytes stored)",
            self.run, self.step, self._committed.version, len(results), manifest.stored_bytes,
        )

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        """Never chosen automatically from a path: use ``store.dcp_writer``."""
        return False

    # -- DCP AsyncStager -----------------------------------------------------------------
    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """Copy the state into the store's bounded staging buffers (``dcp.async_save``).

        Waits while earlier saves still hold ``staging_budget_bytes``. States holding tensor
        types other than plain tensors and DTensors fall back to DCP's default stager.
        """
        self._release_staging()
        try:
            staged, handle = stage_state(state_dict, pool_for(self.store))
        except TypeError as exc:
            from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

            logger.info("staging with DCP's default stager (unbounded): %s", exc)
            stager = DefaultStager(StagingOptions(False, False, False, False))
            try:
                result = stager.stage(state_dict)
            finally:
                stager.close()
            assert isinstance(result, dict)
            return result
        self._staged = handle
        return staged

    def synchronize_staging(self) -> None:
        """Nothing to wait for: :meth:`stage` returns once the copy is complete."""

    def close(self) -> None:
        """Return any staging buffers still held."""
        self._release_staging()

    # -- ours ----------------------------------------------------------------------------
    @property
    def ckpt_id(self) -> str | None:
        """The checkpoint id, once the plan reached this rank."""
        return self._ckpt_id or (self._pending.id if self._pending is not None else None)

    @property
    def checkpoint(self) -> Checkpoint:
        """The committed checkpoint (every rank may ask once ``dcp.save`` returned).

        Raises:
            IncompleteCheckpointError: If this writer's save did not commit.
        """
        if self._committed is not None:
            return self._committed
        if self.ckpt_id is None:
            raise IncompleteCheckpointError(
                f"no checkpoint of {self.run}@{self.step} was saved through this writer yet"
            )
        ck = self.store.catalog.get_any(self.ckpt_id)
        if str(ck.state) != "COMMITTED":
            raise IncompleteCheckpointError(
                f"checkpoint {ck.id} of {self.run}@{self.step} is {ck.state}, not COMMITTED: "
                "the distributed save failed on some rank; save again"
            )
        return ck

    def abort(self, exc: BaseException | None = None) -> None:
        """After a failed save: mark the row FAILED and remove the directory (coordinator).

        Best effort and idempotent; on other ranks it only returns staging buffers.
        """
        self._release_staging()
        ck, directory = self._pending, self._directory
        if ck is None or self._committed is not None:
            return
        reason = f"{type(exc).__name__}: {exc}" if exc is not None else "aborted"
        try:
            self.store.catalog.fail_checkpoint(ck.id, reason[:2000])
        except Exception:  # the catalog may be what failed; gc finishes the job
            logger.warning("could not mark checkpoint %s FAILED", ck.id, exc_info=True)
        if directory is not None:
            shutil.rmtree(directory, ignore_errors=True)
        self._pending = None

    def _release_staging(self) -> None:
        staged, self._staged = self._staged, None
        if staged is not None:
            staged.release()

    def __enter__(self) -> ZarrStorageWriter:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc is not None:
            self.abort(exc)
        self._release_staging()


# --------------------------------------------------------------------------- reader
class ZarrStorageReader(StorageReader):
    """DCP ``StorageReader`` for a committed DCP-layout checkpoint directory.

    Every rank reads only the chunks that overlap its shards, whatever the world size and
    placement at save time. Usually made by ``store.dcp_reader(ref)``.

    Args:
        directory: The checkpoint directory (hot tier).
        manifest: Its verified manifest (read and checked against ``COMMITTED`` if None).
        threads: Reader threads.

    Raises:
        IncompleteCheckpointError: If the directory was never committed.
        IntegrityError: If the manifest or index is damaged, or the checkpoint is not a DCP
            checkpoint.
    """

    def __init__(
        self, directory: str | os.PathLike[str], manifest: Manifest | None = None,
        *, threads: int = 2,
    ) -> None:
        self.threads = threads
        self._open(Path(directory), manifest)

    def _open(self, directory: Path, manifest: Manifest | None) -> None:
        self.directory = directory
        self.manifest = manifest if manifest is not None else read_manifest(directory)
        self.index = index_of(self.manifest)
        self._source = ChunkSource(directory, self.manifest.id, self.index)
        self._metadata: Metadata | None = None
        self._where: dict[MetadataIndex, BoxLoc | BlobItem] = {}

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        """Switch to another checkpoint directory when ``checkpoint_id`` (a path) is given."""
        if checkpoint_id is not None:
            self._open(Path(checkpoint_id), None)

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """DCP metadata rebuilt from our JSON index (no pickle is ever read)."""
        if self._metadata is None:
            self._metadata, self._where = build_metadata(self.index, stored_boxes(self.index))
        return self._metadata

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        """Nothing to set up: every rank opened the same directory."""
        if self._metadata is None:
            self.read_metadata()

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        """Unchanged."""
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        """Unchanged."""
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """Read the plan's items: tensors in parallel into their targets, then bytes items.

        Raises:
            IntegrityError: On a damaged or missing chunk, or an item not in the checkpoint.
        """
        self.read_metadata()
        requests: list[Request] = []
        resolved: list[tuple[ReadItem, torch.Tensor]] = []
        blob_items: list[ReadItem] = []
        for item in plan.items:
            if item.type == LoadItemType.BYTE_IO:
                blob_items.append(item)
                continue
            box = self._where.get(item.storage_index)
            if not isinstance(box, BoxLoc):
                raise IntegrityError(
                    f"checkpoint {self.manifest.id} holds no chunk of {item.storage_index.fqn!r} "
                    f"at {tuple(item.storage_index.offset or ())}; the load plan does not match "
                    "this checkpoint"
                )
            target = planner.resolve_tensor(item).detach()
            if tuple(target.shape) != tuple(item.lengths):
                raise CkptError(
                    f"the load planner gave a {tuple(target.shape)} target for "
                    f"{item.dest_index.fqn!r}, expected {tuple(item.lengths)}"
                )
            requests.append(
                Request(box, tuple(item.storage_offsets), tuple(item.lengths), target)
            )
            resolved.append((item, target))
        run_requests(self._source, requests, self.threads)
        for item, target in resolved:
            planner.commit_tensor(item, target)
        for item in blob_items:
            blob = self._where.get(item.storage_index)
            if not isinstance(blob, BlobItem):
                raise IntegrityError(
                    f"checkpoint {self.manifest.id} holds no item {item.storage_index.fqn!r}"
                )
            planner.load_bytes(item, io.BytesIO(load_blob(self._source, blob)))
        future: Future[None] = Future()
        future.set_result(None)
        return future

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        """Whether ``checkpoint_id`` is a committed DCP-layout checkpoint directory."""
        path = Path(checkpoint_id)
        return (path / COMMIT_NAME).is_file() and (path / DCP_ARRAY_GROUP).is_dir()


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, but non-tensor items load with ``weights_only=True``.

    DCP's own planner unpickles them with ``weights_only=False`` (arbitrary code); the store
    never does.
    """

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        """Load one non-tensor item without arbitrary unpickling.

        Raises:
            UnsafeObjectError: If the item needs arbitrary unpickling.
        """
        import pickle

        fqn = read_item.dest_index.fqn
        try:
            obj = torch.load(value, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as exc:
            raise UnsafeObjectError(
                f"non-tensor item {fqn!r} needs arbitrary unpickling, which the store refuses: "
                f"{str(exc).splitlines()[0]}; load with dcp.load and a planner you trust"
            ) from exc
        if self.flatten_state_dict:
            # What DefaultLoadPlanner.load_bytes does with its (unsafe) result.
            from torch.distributed.checkpoint._traverse import set_element

            set_element(self.original_state_dict, self.mappings[fqn], obj)
        else:
            self.state_dict[fqn] = obj


# --------------------------------------------------------------------------- store helpers
def dcp_writer(store: StoreCore, run: str, step: int, **kw: Any) -> ZarrStorageWriter:
    """A :class:`ZarrStorageWriter` for ``store`` (see its arguments)."""
    return ZarrStorageWriter(store, run, step, **kw)


def dcp_reader(store: StoreCore, ref: str) -> ZarrStorageReader:
    """A :class:`ZarrStorageReader` for a committed checkpoint (restored to hot if needed).

    Raises:
        CheckpointNotFoundError: If the reference does not resolve.
        IntegrityError: If the manifest is damaged or it is not a DCP checkpoint.
    """
    from ckptstore.ops.restore import ensure_hot

    ck = store.catalog.get(ref)
    directory = ensure_hot(store, ck)
    manifest = read_manifest(directory, expected_digest=ck.manifest_digest)
    return ZarrStorageReader(directory, manifest, threads=store.settings.threads)


def needs_dcp(state: Any) -> bool:
    """Whether a state must go through DCP: it holds DTensors/ShardedTensors or Statefuls."""
    from torch.distributed.checkpoint.stateful import Stateful
    from torch.distributed.tensor import DTensor

    try:
        from torch.distributed._shard.sharded_tensor import (  # type: ignore[attr-defined]
            ShardedTensor,
        )

        sharded: tuple[type, ...] = (DTensor, ShardedTensor)
    except ImportError:  # pragma: no cover
        sharded = (DTensor,)

    def walk(obj: Any, depth: int) -> bool:
        if isinstance(obj, sharded):
            return True
        if depth == 1 and isinstance(obj, Stateful):
            return True
        if depth > 64:
            return False
        if isinstance(obj, Mapping):
            return any(walk(v, depth + 1) for v in obj.values())
        if isinstance(obj, list | tuple):
            return any(walk(v, depth + 1) for v in obj)
        return False

    return walk(state, 0)


def _failures(exc: BaseException) -> tuple[BaseException, list[int]]:
    failures = getattr(exc, "failures", None)
    if isinstance(exc, CheckpointException) and isinstance(failures, Mapping) and failures:
        ranks = sorted(failures)
        first = failures[ranks[0]]
        inner = first[0] if isinstance(first, tuple) else first
        return (inner if isinstance(inner, BaseException) else exc), ranks
    return exc, []


def _dcp_error(what: str, exc: BaseException, advice: str) -> CkptError:
    """A CkptError for a failed DCP call, naming the failing ranks and the first cause.

    DCP's own CheckpointException derives from BaseException (``except Exception`` misses
    it); callers of the store get a CkptError of the cause's class where it is one of ours.
    """
    inner, ranks = _failures(exc)
    where = f" on rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}" if ranks else ""
    cause = f"{type(inner).__name__}: {str(inner).strip().splitlines()[0] if str(inner) else ''}"
    if isinstance(inner, RuntimeError) and not ranks:
        cause += " (a rank died or lost its connection)"
    message = f"{what} failed{where}: {cause}; {advice}"
    cls: type[CkptError]
    if isinstance(inner, CkptError):
        cls = type(inner)
    elif isinstance(inner, OSError):
        cls = StorageError
    else:
        cls = CkptError
    try:
        return cls(message)
    except TypeError:  # a subclass with another constructor
        return CkptError(message)


def save_distributed(
    store: StoreCore,
    run: str,
    step: int,
    state: Any,
    *,
    process_group: Any = None,
    **kw: Any,
) -> Checkpoint:
    """Save from every rank of a process group; return the committed checkpoint on all.

    * Sharded state (DTensor, FSDP2, ShardedTensor, or ``Stateful`` objects at the top
      level): DCP with :class:`ZarrStorageWriter`; every rank writes its own shards.
    * Plain replicated state (DDP): rank 0 saves it in the regular format; the others wait
      for the result (a broadcast, which is also the barrier).
    * No process group: a plain ``store.save``.

    Args:
        store: The store (open on every rank).
        run: Run name.
        step: Training step.
        state: The state (a dict for sharded states).
        process_group: Process group (default: the default group).
        **kw: ``metrics``, ``tags``, ``parent``, ``codec``, ``experiment``; ``delta`` and
            ``base`` reach ``store.save`` for plain states and are ignored for sharded ones.

    Raises:
        CkptError: On every rank if any rank failed; nothing is committed and earlier
            checkpoints are untouched. The class is the cause's where it is a CkptError.
    """
    sharded = needs_dcp(state)
    if not _dist_on() and not sharded:
        return save_checkpoint(store, run, step, state, **kw)
    if sharded:
        # Chunk dedup and delta encoding apply to the regular format only.
        dcp_kw = {k: v for k, v in kw.items() if k not in ("delta", "base")}
        return _save_sharded(store, run, step, state, process_group, dcp_kw)
    return _save_replicated(store, run, step, state, process_group, kw)


def _save_sharded(store: StoreCore, run: str, step: int, state: Any, group: Any,
                  kw: dict[str, Any]) -> Checkpoint:
    from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

    if not isinstance(state, dict):
        raise InvalidNameError(
            f"a sharded state must be a dict (DCP's state_dict), got {type(state).__name__}"
        )
    writer = ZarrStorageWriter(store, run, step, **kw)
    try:
        with writer, warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp_save(state, storage_writer=writer, process_group=group, no_dist=not _dist_on())
    except (Exception, CheckpointException) as exc:
        raise _dcp_error(
            f"distributed save of {run}@{step}", exc,
            "nothing was committed and earlier checkpoints are intact; fix the cause and save "
            "again",
        ) from exc
    return writer.checkpoint


def _save_replicated(store: StoreCore, run: str, step: int, state: Any, group: Any,
                     kw: dict[str, Any]) -> Checkpoint:
    rank = dist.get_rank(group)
    src = dist.get_global_rank(group, 0) if group is not None else 0
    payload: list[Any] = [None]
    failure: BaseException | None = None
    if rank == 0:
        try:
            payload = [("ok", save_checkpoint(store, run, step, state, **kw).id)]
        except Exception as exc:
            failure = exc
            payload = [("error", type(exc).__name__, str(exc))]
    try:
        dist.broadcast_object_list(payload, src=src, group=group)
    except (Exception, CheckpointException) as exc:
        raise _dcp_error(
            f"distributed save of {run}@{step} (rank 0 writes, the others wait)", exc,
            "check that rank 0 is alive and that the newest checkpoint is COMMITTED",
        ) from exc
    if failure is not None:
        raise failure
    result = payload[0]
    if result is None or result[0] != "ok":
        name, message = (result[1], result[2]) if result else ("unknown", "no result")
        raise CkptError(
            f"distributed save of {run}@{step} failed on rank 0: {name}: {message}; nothing was "
            "committed and earlier checkpoints are intact"
        )
    return store.catalog.get_any(result[1])


def load_dcp(
    directory: Path,
    manifest: Manifest,
    *,
    keys: Sequence[str] | None = None,
    into: Any | None = None,
    threads: int = 2,
    process_group: Any = None,
) -> Any:
    """Load a DCP-layout checkpoint (the hook ``store.load`` calls for one).

    Without ``into``: full tensors, no process group needed (every rank that calls it reads
    everything). With ``into``: ``dcp.load`` into that state in place — DTensors and FSDP2
    shards of any world size and placement are filled with just their slices, each rank
    reading only the chunks it needs. Under a process group every rank must call it.

    Args:
        directory: The checkpoint directory.
        manifest: Its verified manifest.
        keys: Patterns selecting items (full loads only).
        into: A state dict to load into (DCP semantics).
        threads: Reader threads.
        process_group: Process group for ``dcp.load`` (default: the default group).

    Returns:
        The state (``into`` itself when given).

    Raises:
        InvalidNameError: If ``keys`` is combined with ``into``, or a key matches nothing.
        IntegrityError: On damaged chunks.
        CkptError: If DCP fails on any rank (the class is the cause's where it is ours).
    """
    if into is None:
        return load_full(directory, manifest, keys=keys, threads=threads)
    if keys is not None:
        raise InvalidNameError(
            "keys= cannot be combined with into= for a DCP checkpoint: DCP loads exactly the "
            "keys of the target state; pass a state with only the keys you want"
        )
    if not isinstance(into, dict):
        raise InvalidNameError(
            f"into= must be a dict (a DCP state_dict) for a DCP checkpoint, got "
            f"{type(into).__name__}"
        )
    from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

    reader = ZarrStorageReader(directory, manifest, threads=threads)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp_load(into, storage_reader=reader, planner=SafeLoadPlanner(),
                     process_group=process_group, no_dist=not _dist_on())
    except (Exception, CheckpointException) as exc:
        raise _dcp_error(
            f"loading checkpoint {manifest.id}", exc,
            "check that every rank loads the same checkpoint into a state with the saved keys",
        ) from exc
    return into

