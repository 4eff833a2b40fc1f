"""The DCP ``StorageWriter``: one catalogued checkpoint saved by every rank of a job.

DCP's call sequence, and what each step does here:

1. every rank: ``prepare_local_plan`` checks that every dtype can be stored;
2. the coordinator: ``prepare_global_plan`` sees all shards, allocates the version in the
   catalog (PENDING row), creates the directory and decides which array every shard goes to
   (:mod:`ckptstore.format.dcp.plan`); the decision and the checkpoint id travel back
   to the ranks in ``SavePlan.storage_data``, through DCP's own scatter;
3. every rank: ``write_data`` writes whole chunks of its own shards (never a chunk another
   rank writes), its small shards packed, fsyncs them, returns
   (:mod:`ckptstore.format.dcp.write`);
4. the coordinator, only after every rank returned: ``finish`` writes the manifest (with the
   index), the commit marker, and flips the catalog row to COMMITTED
   (:mod:`ckptstore.format.dcp.commit`).

If any rank fails, DCP raises on every rank and ``finish`` never runs: nothing is
committed. The writer's context manager (and ``store.save(distributed=True)``) then marks the
row FAILED and removes the directory; without it, ``ckpt gc`` does once the process exits.

Across hosts without a shared filesystem (every node's ``hot`` a local disk), or with the
hot tier in object storage, the save is *parted* (:mod:`ckptstore.ops.dcp.parts`): every
rank tells the coordinator its host in its local plan, writes its shards to the hot tier of
its own host (or uploads them) in the per-rank layout, and the coordinator commits the
manifest to its own directory and to the catalog, with one part per host. The other hosts'
parts get their manifest and marker from the catalog (the writer's context manager does it
on each host's lowest rank; ``save_distributed`` broadcasts it instead). A failed save's
files on other hosts are removed by those hosts' ``ckpt gc`` (their agents run it).
"""

from __future__ import annotations

import logging
import os
import shutil
from dataclasses import replace
from pathlib import Path
from types import TracebackType
from typing import Any

from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItemType
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from ckptstore.core import StoreCore
from ckptstore.durable import storage_error
from ckptstore.errors import CkptError, ConfigError, IncompleteCheckpointError, InvalidNameError
from ckptstore.faultpoints import fault_point
from ckptstore.format import Manifest
from ckptstore.format.codecs import AUTO, codec_spec
from ckptstore.format.constants import (
    COMMIT_NAME,
    DCP_ARRAY_GROUP,
    DCP_PACK_GROUP,
    MANIFEST_NAME,
)
from ckptstore.format.dcp.commit import build_index, build_manifest, commit_files
from ckptstore.format.dcp.plan import ArraySpec, RankTask, assign_slots, item_dtype_name
from ckptstore.format.dcp.write import ChunkSink, write_rank
from ckptstore.format.dcp.zarrdocs import shared_docs
from ckptstore.format.manifest import remember_manifest
from ckptstore.identity import host
from ckptstore.names import validate_name, validate_tag
from ckptstore.ops.dcp.parts import PartTask, RankInfo, TierSink
from ckptstore.ops.dcp.stage import StagedSet, pool_for, stage_state
from ckptstore.ops.tiering.parts import materialize, part_specs
from ckptstore.ops.writing.save import begin_save
from ckptstore.records import Checkpoint, CheckpointState
from ckptstore.save_options import SaveOptions, options_of

__all__ = ["PACK_BELOW", "ZarrStorageWriter", "dcp_writer"]

logger = logging.getLogger(__name__)

#: Shards smaller than this are packed per rank instead of getting an array of their own.
PACK_BELOW = 1024 * 1024

#: Writer threads per rank when the hot tier is object storage: uploads wait on the network,
#: not the CPU, so more run at once (each holds at most one encoded chunk).
REMOTE_THREADS = 8


class ZarrStorageWriter(StorageWriter, AsyncStager):
    """DCP ``StorageWriter`` that saves one catalogued ckptstore checkpoint from all ranks.

    Create one per save on every rank (``store.dcp_writer(run, step)``) with the same
    arguments; only the coordinator (rank 0) writes the checkpoint's row. Each rank writes to
    the hot tier of its own host (``settings.hot_path``, or ``hot = "s3://..."``): ranks on
    several hosts need no shared filesystem, only the PostgreSQL catalog (see
    :mod:`ckptstore.ops.dcp.parts`). The writer is also an ``AsyncStager``:
    ``dcp.async_save`` stages into the store's bounded, reused staging buffers.

    Use it as a context manager so a failed save is marked FAILED and its files removed at
    once::

        with store.dcp_writer("run-a", 100) as writer:
            dcp.save(state, storage_writer=writer)
        ck = writer.checkpoint

    Args:
        store: The open store (on every rank).
        run: Run name.
        step: Training step.
        options: The save's options: metrics, tags, parent, codec (default: the store's),
            experiment. ``delta`` and ``base`` do not apply: a DCP save is written in full.
        pack_below: Shards smaller than this many bytes are packed per rank (default:
            :data:`PACK_BELOW`; in a save across hosts, where no array is shared between
            ranks anyway, the chunk size: a shard that fits one chunk costs no files of its
            own).
        **fields: The options as keywords (``metrics=``, ``tags=``, ...), for a caller that
            passes no ``options``.

    Raises:
        InvalidNameError: For a bad run name, step, tag or codec, or a ``delta`` or ``base``
            (on every rank, before any I/O or collective).
        TypeError: For both ``options`` and keywords, or a keyword that is no option.
    """

    # Our stage() returns the staged state itself: nothing to synchronize afterwards.
    _synchronize_after_execute = False

    def __init__(
        self,
        store: StoreCore,
        run: str,
        step: int,
        options: SaveOptions | None = None,
        *,
        pack_below: int | None = None,
        **fields: Any,
    ) -> None:
        options = options_of(options, **fields)
        validate_name(run)
        for tag in options.tags:
            validate_tag(tag)
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise InvalidNameError(f"step must be a non-negative int, got {step!r}")
        if not options.default_encoding:
            raise InvalidNameError(
                "a DCP save is written in full: delta and base do not apply to it; leave "
                "them out (store.save(..., distributed=True) drops them for sharded states)"
            )
        self.store = store
        self.run = run
        self.step = step
        self.options = options
        self.codec = options.codec or store.settings.codec
        if self.codec == AUTO:
            # The DCP layout stores a checkpoint with one codec; the per-array choice of
            # ``auto`` keeps 4-byte and wider dtypes (most of a sharded state) raw.
            self.codec = "none"
        try:
            codec_spec(self.codec)
        except ValueError as exc:
            raise InvalidNameError(str(exc)) from None
        self.pack_below = None if pack_below is None else int(pack_below)
        self.is_coordinator = False
        self._pending: Checkpoint | None = None  # coordinator: the row of the save under way
        self._directory: Path | None = None
        self._specs: dict[str, ArraySpec] = {}
        self._ckpt_id: str | None = None
        self._committed: Checkpoint | None = None
        self._staged: StagedSet | None = None
        self._part: PartTask | None = None  # this rank's answer from the coordinator
        self._hosts: tuple[str, ...] = ()  # coordinator: the host of every rank
        self._parted = False
        self._remote = False
        self._manifest_data: bytes | None = None  # coordinator: the committed manifest
        #: Give this host's part its manifest on a clean exit of the context manager (each
        #: host's lowest rank; ``save_distributed`` broadcasts the manifest instead).
        self.materialize_on_exit = True

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
        self._part = None
        self._hosts = ()
        self._parted = False
        self._remote = False
        self._manifest_data = None

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        """Refuse dtypes the format cannot store, before anything is written; tell the
        coordinator this rank's host."""
        for item in plan.items:
            if item.type != WriteItemType.BYTE_IO and item.tensor_data is not None:
                item_dtype_name(item.tensor_data.properties.dtype, item.index.fqn)
        remote = self.store.settings.hot_remote is not None
        return replace(plan, storage_data=RankInfo(host(), remote))

    def _topology(self, plans: list[SavePlan]) -> tuple[tuple[str, ...], bool]:
        """The host of every rank, and whether the save is parted; refuse what cannot work."""
        remote = self.store.settings.hot_remote is not None
        infos = [
            p.storage_data if isinstance(p.storage_data, RankInfo) else RankInfo(host(), remote)
            for p in plans
        ]
        hosts = tuple(i.host for i in infos)
        if any(i.remote != remote for i in infos):
            odd = sorted({i.host for i in infos if i.remote != remote})
            raise ConfigError(
                f"ranks on {', '.join(odd)} save to a hot tier of another kind than the "
                "coordinator's (object storage vs local disk); use the same config file on "
                "every node"
            )
        multi = len(set(hosts)) > 1
        if multi and self.store.catalog.dialect == "sqlite":
            raise ConfigError(
                f"this save spans {len(set(hosts))} hosts ({', '.join(sorted(set(hosts))[:4])}"
                f"{', ...' if len(set(hosts)) > 4 else ''}) and needs the PostgreSQL catalog: "
                "an embedded SQLite catalog lives on one host. Set catalog_url (or "
                "CKPT_CATALOG_URL) to postgresql+psycopg://... on every node"
            )
        return hosts, multi or remote

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        """Coordinator: allocate the version, create the directory, assign every shard."""
        settings = self.store.settings
        hosts, parted = self._topology(plans)
        remote = settings.hot_remote is not None
        pack_below = self.pack_below
        if pack_below is None:
            pack_below = settings.chunk_bytes if parted else PACK_BELOW
        slots, specs = assign_slots(
            plans, chunk_bytes=settings.chunk_bytes, pack_below=pack_below, per_rank=parted,
        )
        ck = begin_save(self.store, self.run, self.step, self.options, codec=self.codec)
        self._pending = ck
        self._hosts, self._parted, self._remote = hosts, parted, remote
        directory = self.store.checkpoint_dir(self.run, ck.id)
        self._directory = None if remote else directory
        self._specs = specs
        try:
            if not remote:
                directory.parent.mkdir(parents=True, exist_ok=True)
                # Parted: ranks on this host create it too, whoever comes first.
                directory.mkdir(exist_ok=parted)
                (directory / DCP_ARRAY_GROUP).mkdir(exist_ok=parted)
                (directory / DCP_PACK_GROUP).mkdir(exist_ok=parted)
        except OSError as exc:
            err = storage_error(directory, "create checkpoint directory", exc)
            self.abort(err)
            raise err from exc
        fault_point("dcp.pending")
        logger.debug("DCP save %s step %s -> %s (%d ranks on %d hosts)", self.run, self.step,
                     ck.id, len(plans), len(set(hosts)))
        leaders = {h: min(r for r, x in enumerate(hosts) if x == h) for h in set(hosts)}
        threads = max(settings.threads, REMOTE_THREADS) if remote else settings.threads
        tasks = [
            RankTask(
                ckpt_id=ck.id,
                directory=str(directory),
                rank=rank,
                codec=self.codec,
                chunk_bytes=settings.chunk_bytes,
                threads=threads,
                slots=slots[rank],
            )
            for rank in range(len(plans))
        ]
        return [
            replace(plan, storage_data=PartTask(task, parted, leaders[hosts[rank]] == rank,
                                                remote, hosts))
            for rank, (plan, task) in enumerate(zip(plans, tasks, strict=True))
        ]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        """Write this rank's shards (whole chunks only) and fsync them.

        Raises:
            CkptError: If the plan did not come from this writer's coordinator (DCP plan
                caching is not supported).
            StorageError: On OS errors.
        """
        try:
            part = plan.storage_data
            if not isinstance(part, PartTask):
                raise CkptError(
                    "the save plan carries no ZarrStorageWriter task: use ZarrStorageWriter on "
                    "every rank and do not enable DCP plan caching"
                )
            self._part = part
            task = part.task
            self._ckpt_id = task.ckpt_id
            sink: ChunkSink | None = None
            if part.remote:
                sink = TierSink(self.store.tier("hot"), self.run, task.ckpt_id)
            elif part.parted:
                # The hot tier of this rank's own host, wherever the coordinator runs.
                directory = self.store.checkpoint_dir(self.run, task.ckpt_id)
                try:
                    directory.mkdir(parents=True, exist_ok=True)
                except OSError as exc:
                    raise storage_error(directory, "create checkpoint directory", exc) from exc
                task = replace(task, directory=str(directory))
            results = write_rank(task, plan, planner, fault=fault_point, sink=sink)
        finally:
            self._release_staging()
        future: Future[list[WriteResult]] = Future()
        future.set_result(results)
        return future

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """Coordinator, after every rank wrote: manifest, marker, catalog COMMITTED."""
        ck, directory = self._pending, self._directory
        if ck is None or (directory is None and not self._remote):
            raise CkptError("finish() called before prepare_global_plan(); this is a DCP misuse")
        if self._parted:
            self._finish_parted(ck, metadata, results)
            return
        assert directory is not None
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

    def _finish_parted(self, ck: Checkpoint, metadata: Metadata,
                       results: list[list[WriteResult]]) -> None:
        """Commit a parted save: the coordinator's copy of the shared files, then the catalog
        (row, manifest bytes and one part per host, in one transaction)."""
        try:
            index, meta_files = build_index(metadata, results, self._specs, self.codec)
            manifest = build_manifest(
                ckpt_id=ck.id, run=self.run, step=self.step,
                chunk_bytes=self.store.settings.chunk_bytes, index=index, meta_files=meta_files,
            )
            data = manifest.to_json()
            if self._remote:
                uri = self._publish_remote(ck, manifest, data)
            else:
                # The catalog holds the manifest every host materialises its part's copy
                # from, right after the commit (off the save's critical path): every part
                # is durable already, and the catalog is the one source of truth.
                assert self._directory is not None
                fault_point("dcp.manifest_written")
                uri = str(self._directory)
            remember_manifest(manifest, manifest.digest)
            self._committed = self.store.catalog.commit_parted(
                ck.id, manifest=data, manifest_digest=manifest.digest,
                logical_bytes=manifest.logical_bytes, stored_bytes=manifest.stored_bytes,
                parts=part_specs(manifest, self._hosts), shared=self._remote, uri=uri,
            )
            self._manifest_data = data
        except BaseException as exc:
            self.abort(exc)
            raise
        fault_point("dcp.committed")
        logger.info(
            "saved %s step %s as v%s from %d ranks on %d hosts (%s bytes stored)",
            self.run, self.step, self._committed.version, len(results), len(set(self._hosts)),
            manifest.stored_bytes,
        )

    def _publish_remote(self, ck: Checkpoint, manifest: Manifest, data: bytes) -> str:
        """The shared documents, manifest and marker of a save to object storage (marker
        last: the tier's rule for a complete copy)."""
        tier = self.store.tier("hot")
        for rel, doc in shared_docs(manifest).items():
            tier.put_bytes(tier.key_for(self.run, ck.id, rel), doc)
        tier.put_bytes(tier.key_for(self.run, ck.id, MANIFEST_NAME), data)
        fault_point("dcp.manifest_written")
        tier.put_bytes(tier.key_for(self.run, ck.id, COMMIT_NAME),
                       (manifest.digest + "\n").encode("ascii"))
        return tier.uri_for(self.run, ck.id)

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
    def part(self) -> PartTask | None:
        """This rank's answer from the coordinator (its host's part, leader or not), once the
        plan reached it."""
        return self._part

    @property
    def manifest_data(self) -> bytes | None:
        """Coordinator, after a parted commit: the manifest bytes it committed."""
        return self._manifest_data

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
        if ck.state != CheckpointState.COMMITTED:
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
        if self._remote:
            # Every rank's uploads share the one tier: remove them all (best effort).
            try:
                tier = self.store.tier("hot")
                prefix = tier.prefix_for(self.run, ck.id)
                tier.delete_prefix(prefix)
                tier.abort_multipart_uploads(prefix)
            except CkptError:
                logger.warning("could not remove the uploads of failed save %s; `ckpt gc` "
                               "retries", ck.id, exc_info=True)
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
        part = self._part
        if (exc is None and self.materialize_on_exit and part is not None and part.parted
                and part.leader and not part.remote and self.ckpt_id is not None):
            # This host's part gets its manifest and marker now (the coordinator from the
            # bytes it committed, the other hosts with one catalog read each).
            materialize(self.store, self.checkpoint, data=self._manifest_data)


def dcp_writer(store: StoreCore, run: str, step: int, **kw: Any) -> ZarrStorageWriter:
    """A :class:`ZarrStorageWriter` for ``store`` (see its arguments)."""
    return ZarrStorageWriter(store, run, step, **kw)
