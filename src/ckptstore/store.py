"""CheckpointStore: the user-facing facade over the format, the hot tier and the catalog.

A save is: validate the state (no pickle) → PENDING catalog row with the next version →
chunks, manifest and commit marker on the hot tier, each durable → COMMITTED row. Anything
that is not COMMITTED is invisible to ``load``/``list``/``latest``; ``gc`` removes what dead
saves left behind.
"""

from __future__ import annotations

import builtins
import logging
import os
import shutil
import socket
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ckptstore.catalog import Catalog
from ckptstore.config import Settings, load_settings
from ckptstore.errors import (
    CheckpointNotFoundError,
    CkptError,
    ConfigError,
    InvalidNameError,
    StorageError,
)
from ckptstore.faults import fault_point
from ckptstore.format import (
    KeyframeCache,
    Manifest,
    flatten_state,
    read_checkpoint,
    read_manifest,
    verify_checkpoint,
    write_checkpoint,
)
from ckptstore.hooks.async_save import SaveHandle, close_saver, save_async, wait_async
from ckptstore.hooks.memory_tier import load_from_memory, memory_replica_here, stage_after_commit
from ckptstore.integrations.dcp_layout import is_dcp_manifest
from ckptstore.names import validate_name, validate_tag
from ckptstore.observability.metrics import Metrics, dedup_bytes
from ckptstore.ops.delta import LATEST, Latest, lossy_record, plan_save
from ckptstore.procs import pid_alive, writer_id
from ckptstore.records import (
    Checkpoint,
    CheckpointState,
    Event,
    ReplicaState,
    RunInfo,
    UsageRow,
    expected_digest,
)

if TYPE_CHECKING:
    from ckptstore.hooks.progressive import ProgressiveLoad
    from ckptstore.integrations.dcp import ZarrStorageReader, ZarrStorageWriter
    from ckptstore.storage import Tier

__all__ = ["CheckpointStore", "GcReport"]

logger = logging.getLogger(__name__)


@dataclass
class GcReport:
    """What ``gc`` removed (or would remove with ``dry_run``)."""

    removed_dirs: list[str] = field(default_factory=list)
    failed_rows: list[str] = field(default_factory=list)
    dry_run: bool = False

    @property
    def empty(self) -> bool:
        """True when there was nothing to clean."""
        return not self.removed_dirs and not self.failed_rows


class CheckpointStore:
    """Save, load, find and manage checkpoints.

    Open it with :meth:`open`; close it with :meth:`close` (or use it as a context manager).

    Example:
        >>> store = CheckpointStore.open("./ckpt")                      # doctest: +SKIP
        >>> ck = store.save("run-a", step=100, state=model.state_dict(),  # doctest: +SKIP
        ...                 metrics={"loss": 2.3})
        >>> state = store.load("run-a@latest")                          # doctest: +SKIP
    """

    def __init__(self, settings: Settings, catalog: Catalog) -> None:
        """Wrap an already opened catalog; prefer :meth:`open`."""
        self.settings = settings
        self.catalog = catalog
        self.hot = settings.hot_path
        # Saves of this process that failed while the catalog was unreachable: gc fails and
        # removes them (their writer, this process, is alive, so gc would otherwise wait).
        self._abandoned: set[str] = set()
        self._closed = False
        self._flows_triggered = False  # close() then waits for them (see trigger())
        self._tiers: dict[str, Tier] | None = None
        # Per-store recorder (own Prometheus registry): ~20 µs per observation.
        self.metrics = Metrics()
        # The latest xor/lossy keyframe's chunks, so the deltas after it need not read it
        # back (allocated only as a keyframe is written).
        self._keyframe_cache = (
            KeyframeCache(settings.delta_cache_bytes) if settings.delta_cache_bytes else None
        )

    # ------------------------------------------------------------------ opening
    @classmethod
    def open(
        cls,
        root: str | os.PathLike[str] | None = None,
        *,
        config: str | os.PathLike[str] | None = None,
        catalog_url: str | None = None,
        **overrides: Any,
    ) -> CheckpointStore:
        """Open (and on first use create) a store.

        Args:
            root: Store directory; holds ``catalog.db`` and ``hot/`` by default.
            config: A TOML config file (default ``$CKPT_CONFIG``).
            catalog_url: Catalog URL (default ``$CKPT_CATALOG_URL`` or the embedded SQLite).
            **overrides: Any other :class:`~ckptstore.config.Settings` field.

        Returns:
            The open store. The catalog schema is upgraded to the newest revision.

        Raises:
            ConfigError: If the configuration is invalid.
            StorageError: If the hot tier cannot be created.
        """
        settings = load_settings(config, root=root, catalog_url=catalog_url, **overrides)
        try:
            settings.root.mkdir(parents=True, exist_ok=True)
            settings.hot_path.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise StorageError(
                f"cannot create the store directory {settings.hot_path}: {exc.strerror}; "
                "check the path and its permissions"
            ) from exc
        catalog = Catalog(settings.resolved_catalog_url, upgrade=True)
        return cls(settings, catalog)

    def close(self) -> None:
        """Wait for pending async saves and triggered flows, then release the catalog and tiers.

        Raises:
            CkptError: The first async save failure not yet reported (the store is closed
                anyway).
        """
        if not self._closed:
            try:
                close_saver(self)
            finally:
                self._closed = True
                if self._flows_triggered:
                    # Once the interpreter shuts down, a queued flow can no longer run
                    # (flows/embedded.py): wait for them while it still can.
                    from ckptstore.flows.embedded import wait_for_flows

                    config = str(self.settings.source) if self.settings.source else None
                    wait_for_flows(str(self.settings.root), config)
                for tier in (self._tiers or {}).values():
                    tier.close()
                self.metrics.close()
                self.catalog.close()
                if self._keyframe_cache is not None:
                    self._keyframe_cache.clear()

    @property
    def tiers(self) -> dict[str, Tier]:
        """Configured storage tiers by name: ``hot`` always, ``warm``/``cold`` if set.

        Raises:
            ConfigError: If a tier URL or the storage options are invalid.
        """
        if self._tiers is None:
            from ckptstore.storage import build_tiers

            self._tiers = build_tiers(self.settings)
        return self._tiers

    def __enter__(self) -> CheckpointStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ paths
    def checkpoint_dir(self, run: str, ckpt_id: str) -> Path:
        """Directory of a checkpoint on the hot tier."""
        return self.hot / validate_name(run) / ckpt_id

    def locate(self, ckpt_id: str) -> Path:
        """Hot directory of any catalogued checkpoint (used for chunks a delta references)."""
        ck = self.catalog.get_any(ckpt_id)
        return self.checkpoint_dir(ck.run, ck.id)

    # ------------------------------------------------------------------ save
    def save(
        self,
        run: str,
        step: int,
        state: Any,
        *,
        metrics: dict[str, float] | None = None,
        tags: Sequence[str] = (),
        parent: str | None = None,
        codec: str | None = None,
        experiment: str | None = None,
        progress: Callable[[int], None] | None = None,
        delta: Any = None,
        base: str | Latest | None = LATEST,
        distributed: bool = False,
        process_group: Any = None,
    ) -> Checkpoint:
        """Save ``state`` as a new version of ``run`` at ``step``; return it once COMMITTED.

        Args:
            run: Run name (letters, digits, ``._+=,-``).
            step: Training step (non-negative int). Saving a step again makes a new version.
            state: Any nesting of dicts/lists/tuples of tensors and plain values.
            metrics: Finite numbers recorded with the checkpoint (queryable).
            tags: Labels for filtering.
            parent: Reference of the checkpoint this run was resumed or fine-tuned from.
            codec: Codec preset (default from the settings, ``lz4``).
            experiment: Experiment to file the run under (on first save of the run).
            progress: Called with the number of bytes written after each chunk.
            delta: How the save is encoded against ``base`` (default: the ``delta``
                setting, ``"dedup"``): ``"dedup"`` writes only the chunks that differ from
                the base's; ``False`` writes everything; ``"xor"`` also stores changed
                chunks XOR-encoded against the chain's keyframe (lossless); a table such as
                ``{"threshold": 1e-4, "quantize": 8}`` stores optimizer moments (or the
                ``scope`` given) as thresholded, quantized deltas (lossy, recorded). xor and
                lossy chains write a full keyframe every ``keyframe_every`` saves.
            base: The checkpoint to encode against: the run's latest committed one by
                default, a reference, or None for a full save.
            distributed: Call on every rank of a process group. Sharded states (DTensor,
                FSDP2, ShardedTensor, top-level ``Stateful`` objects) are saved by every
                rank through DCP into one checkpoint (``delta``/``base`` do not apply);
                plain (DDP) states are saved by rank 0 while the others wait. See
                :func:`ckptstore.integrations.dcp.save_distributed`.
            process_group: The process group for ``distributed`` (default: the default one).

        Returns:
            The committed :class:`Checkpoint` (on every rank when ``distributed``).

        Raises:
            InvalidNameError: For a bad run name, tag, metric or ``delta`` setting.
            CheckpointNotFoundError: If an explicit ``base`` does not resolve.
            UnsafeObjectError: If the state holds an object that would need pickle.
            StorageError: If the hot tier fails (disk full, permissions); nothing is committed.
            CkptError: With ``distributed``, on every rank when any rank failed.
        """
        if distributed:
            from ckptstore.integrations.dcp import save_distributed

            extra = {} if delta is None and base is LATEST else {"delta": delta, "base": base}
            return save_distributed(
                self, run, step, state, process_group=process_group, metrics=metrics,
                tags=tags, parent=parent, codec=codec, experiment=experiment, **extra,
            )
        validate_name(run)
        for tag in tags:
            validate_tag(tag)
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise InvalidNameError(f"step must be a non-negative int, got {step!r}")
        codec = codec or self.settings.codec
        # Refuse pickle-only objects before anything is written or catalogued.
        flatten_state(state)
        parent_id = self.catalog.get(parent).id if parent is not None else None
        if experiment is not None:
            self.catalog.ensure_run(run, experiment=experiment)
        plan = plan_save(self, run, delta, base)
        ck = self.catalog.begin_checkpoint(
            run,
            step,
            metrics=metrics,
            tags=tuple(tags),
            parent_id=parent_id,
            kind=plan.kind,
            base_id=plan.base_id,
            codec=codec,
            lossy=plan.lossy,
            writer=writer_id(),
            tier="hot",
            uri="",
        )
        directory = self.checkpoint_dir(run, ck.id)
        fault_point("save.pending")
        started = time.perf_counter()
        with self.metrics.timed("save", run=run, tier="hot", step=step, blocking=True) as timer:
            try:
                directory.parent.mkdir(parents=True, exist_ok=True)
                if directory.parent.is_symlink() or directory.parent.resolve().parent != \
                        self.hot.resolve():
                    # A run directory replaced by a link would make us write outside the root.
                    raise StorageError(
                        f"{directory.parent} is a symlink or lies outside the hot tier "
                        f"{self.hot}; remove the link (checkpoints are never written through "
                        "links)"
                    )
                manifest = write_checkpoint(
                    directory,
                    state,
                    ckpt_id=ck.id,
                    run=run,
                    step=step,
                    codec=codec,
                    chunk_bytes=self.settings.chunk_bytes,
                    threads=self.settings.threads,
                    base=plan.base,
                    delta=plan.spec,
                    depth=plan.depth,
                    fault_point=lambda phase: fault_point(f"save.{phase}"),
                    progress=progress,
                    base_cache=self._keyframe_cache,
                )
            except BaseException as exc:
                self._abandon(ck.id, directory, exc)
                if isinstance(exc, OSError) and not isinstance(exc, CkptError):
                    raise StorageError(f"saving {run}@{step} failed: {exc}") from exc
                raise
            try:
                committed = self.catalog.commit_checkpoint(
                    ck.id,
                    manifest_digest=manifest.digest,
                    logical_bytes=manifest.logical_bytes,
                    stored_bytes=manifest.stored_bytes,
                    tier="hot",
                    uri=str(directory),
                    **lossy_record(manifest),
                )
            except BaseException as exc:
                # The data is durable but the catalog did not take it. Only delete it once
                # the row is known to be FAILED: the commit may have landed before the error
                # (a connection lost after COMMIT), and then the data is the checkpoint.
                self._abandon(ck.id, directory, exc, data_may_be_committed=True)
                raise
            timer.add(
                bytes_logical=manifest.logical_bytes,
                bytes_stored=manifest.stored_bytes,
                bytes_deduplicated=dedup_bytes(manifest),
            )
        fault_point("save.committed")
        logger.info(
            "saved %s step %s as v%s (%s bytes stored, %s) in %.2fs",
            run, step, committed.version, manifest.stored_bytes,
            manifest.delta.mode if manifest.delta is not None else "full",
            time.perf_counter() - started,
        )
        if manifest.delta is not None and manifest.delta.lossy:
            logger.info(
                "%s is lossy: %d values of %s stored approximately, max abs error %g",
                committed.ref, manifest.delta.lossy_elements, list(manifest.delta.scope),
                manifest.delta.max_abs_error,
            )
        # An extra copy in host shared memory (memory_tier_bytes > 0), only now that the hot
        # copy is committed; it never fails the save.
        if stage_after_commit(self, committed, state):
            committed = self.catalog.get_any(committed.id)
        return committed

    def save_async(
        self,
        run: str,
        step: int,
        state: Any,
        *,
        metrics: dict[str, float] | None = None,
        tags: Sequence[str] = (),
        parent: str | None = None,
        codec: str | None = None,
        experiment: str | None = None,
        on_commit: Callable[[Checkpoint], None] | None = None,
        delta: Any = None,
        base: str | Latest | None = LATEST,
    ) -> SaveHandle:
        """Like :meth:`save`, but return once the state is staged in host memory.

        The tensors are copied into reused staging buffers (bounded by
        ``staging_budget_bytes``; waits for earlier saves when the budget is in use) and the
        save runs on a background thread. ``state`` may be changed as soon as this returns.

        Args:
            run: Run name.
            step: Training step.
            state: The training state.
            metrics: Finite numbers recorded with the checkpoint.
            tags: Labels for filtering.
            parent: Reference of the checkpoint this run was resumed or fine-tuned from.
            codec: Codec preset.
            experiment: Experiment to file the run under.
            on_commit: Called on the background thread with the committed checkpoint.
            delta: As for :meth:`save`.
            base: As for :meth:`save`.

        Returns:
            A :class:`~ckptstore.hooks.SaveHandle`; ``.result()`` waits for the commit.

        Raises:
            CkptError: An earlier async save's failure (raised once, by the next call).
            ConfigError: If the state is larger than ``staging_budget_bytes``.
            UnsafeObjectError: If the state holds an object that would need pickle.
        """
        return save_async(
            self, run, step, state, on_commit=on_commit, metrics=metrics, tags=tuple(tags),
            parent=parent, codec=codec, experiment=experiment, delta=delta, base=base,
        )

    def wait(self) -> None:
        """Wait for every pending async save; raise the first failure not yet reported."""
        wait_async(self)

    def dcp_writer(self, run: str, step: int, **kw: Any) -> ZarrStorageWriter:
        """A ``torch.distributed.checkpoint`` storage writer saving one checkpoint of ``run``.

        Create it on every rank, then ``dcp.save(state, storage_writer=writer)`` (or
        ``dcp.async_save``); ``kw``: ``metrics``, ``tags``, ``parent``, ``codec``,
        ``experiment`` (see :class:`ckptstore.integrations.dcp.ZarrStorageWriter`).
        """
        from ckptstore.integrations.dcp import ZarrStorageWriter

        return ZarrStorageWriter(self, run, step, **kw)

    def dcp_reader(self, ref: str) -> ZarrStorageReader:
        """A ``torch.distributed.checkpoint`` storage reader for a checkpoint saved via DCP.

        ``dcp.load(state, storage_reader=store.dcp_reader(ref))`` loads it at any world size
        and placement; every rank reads only the chunks holding its slices.
        """
        from ckptstore.integrations.dcp import dcp_reader

        return dcp_reader(self, ref)

    def trigger(
        self, flow_name: str, checkpoint: Checkpoint | None = None, **params: Any
    ) -> None:
        """Start a background flow (``archive``, ``retention``, ``verify``, ...); never waits.

        Without a Prefect server the flow runs on this process's one embedded background worker
        (started on first use); with ``PREFECT_API_URL`` set it becomes a ``run_deployment``
        of the deployment ``ckpt serve`` serves. The flow reopens the store from its root and
        config file, so settings given only as ``open()`` arguments do not reach it.

        :meth:`close` waits for the flows started here.

        Args:
            flow_name: Short flow name.
            checkpoint: The checkpoint the flow is about (passed as ``ref``).
            **params: Other flow parameters (plain values, never credentials).

        Raises:
            ConfigError: For an unknown flow, or when a tier the flow moves data to or from
                is not configured (the flow would only fail in the background).
        """
        from ckptstore.flows.embedded import trigger_flow  # Prefect loads on the worker only

        # The tier parameters of the flows that move data between tiers, with their defaults
        # (flows/archive.py).
        tier_params = {"archive": {"tier": "warm"}, "demote": {"src": "warm", "dst": "cold"}}
        configured = self.settings.tier_urls()
        for param, default in tier_params.get(flow_name, {}).items():
            tier = params.get(param, default)
            if tier not in configured:
                raise ConfigError(
                    f"cannot start the {flow_name} flow: tier {tier!r} is not configured; set "
                    "it under [tiers] in the config"
                )
        key = None
        if checkpoint is not None:
            if flow_name == "retention":
                params.setdefault("run", checkpoint.run)
            else:
                params.setdefault("ref", checkpoint.id)
            key = f"{flow_name}:{checkpoint.id}"
        config = str(self.settings.source) if self.settings.source else None
        trigger_flow(str(self.settings.root), flow_name, params, config=config,
                     idempotency_key=key)
        self._flows_triggered = True

    def _abandon(
        self,
        ckpt_id: str,
        directory: Path,
        exc: BaseException,
        *,
        data_may_be_committed: bool = False,
    ) -> None:
        """Mark a failed save FAILED and remove its partial directory (best effort).

        When the catalog cannot be told (it may be what failed), the id is remembered and
        :meth:`gc` finishes the job in this process; other processes' gc does it once this
        one has exited.
        """
        try:
            self.catalog.fail_checkpoint(ckpt_id, f"{type(exc).__name__}: {exc}")
        except Exception:  # the catalog may be the thing that failed; gc finishes the job
            logger.warning("could not mark checkpoint %s FAILED", ckpt_id, exc_info=True)
            self._abandoned.add(ckpt_id)
            if data_may_be_committed:
                return
        shutil.rmtree(directory, ignore_errors=True)

    # ------------------------------------------------------------------ load
    def manifest(self, ref: str) -> Manifest:
        """Read and verify the manifest of a committed checkpoint (no tensor data)."""
        from ckptstore.ops.replicas import manifest_of

        ck = self.catalog.get(ref)
        # From the fastest copy that has it; no need to restore tensors to read the index.
        return manifest_of(self, ck)

    def _hot_dir_of(self, ck: Checkpoint) -> Path:
        replica = ck.replica("hot")
        if replica is None or replica.state != ReplicaState.PRESENT:
            where = ", ".join(f"{r.tier}:{r.state}" for r in ck.replicas) or "nowhere"
            raise CheckpointNotFoundError(
                f"checkpoint {ck.ref} ({ck.id}) has no copy on the hot tier (replicas: {where}); "
                f"restore it first with `ckpt restore {ck.ref}`"
            )
        return self.checkpoint_dir(ck.run, ck.id)

    def load(
        self,
        ref: str,
        *,
        keys: Sequence[str] | None = None,
        into: Any | None = None,
        require_signature: str | os.PathLike[str] | None = None,
    ) -> Any:
        """Load a committed checkpoint.

        Args:
            ref: A checkpoint reference (uuid, ``run@latest``, ``run@<step>``, ``run@v<n>``,
                ``run@best:<metric>[:max]`` or an alias).
            keys: fnmatch patterns over tensor/value paths (e.g. ``["model/*"]``); only the
                chunks holding matching tensors are read.
            into: A state of the same structure whose tensors are filled in place
                (the fastest restore: no new allocations). For a checkpoint saved through
                DCP: a state dict that may hold DTensors of any world size and placement
                (under a process group every rank calls it; each reads only its slices).
            require_signature: A PEM Ed25519 public key: refuse to load unless the
                checkpoint carries a valid signature by that key (``ckpt sign``). The
                signature covers the manifest digest, which covers every chunk's hash, so
                every byte loaded is then vouched for.

        Returns:
            The state, with the same nesting and container types; tensors on CPU (for a
            checkpoint saved through DCP without ``into``: full tensors, no process group).

        Raises:
            CheckpointNotFoundError: If the reference does not resolve.
            IncompleteCheckpointError: If it names a checkpoint that was never committed.
            IntegrityError: If any chunk or the manifest is damaged or missing, or (with
                ``require_signature``) the checkpoint is unsigned, signed by another key or
                its signature does not match.
        """
        from ckptstore.ops.restore import ensure_hot, hot_digest

        ck = self.catalog.get(ref)
        if require_signature is not None:
            from ckptstore.ops.signing import verify_signature

            # Before any tensor is read: nothing unvouched reaches the caller. A checkpoint
            # only an archive tier holds is restored first, so the copy that will be read
            # (possibly re-encoded, with a digest the catalog alone vouches for) is the one
            # checked against the signed digest.
            if not memory_replica_here(ck):
                ensure_hot(self, ck)
            verify_signature(self, ck.id, require_signature)
        in_memory = memory_replica_here(ck)
        with self.metrics.timed("load", run=ck.run, tier="memory" if in_memory else "hot",
                                step=ck.step, blocking=True) as timer:
            if in_memory:
                # This host's shared-memory copy (a restart after a crash): no disk reads.
                # A vanished or damaged copy is marked so, and the hot tier is used.
                hit, state = load_from_memory(self, ck, keys=keys, into=into)
                if hit:
                    timer.add(bytes_logical=ck.logical_bytes, bytes_stored=ck.logical_bytes)
                    return state
            # A checkpoint that only S3 holds is restored to the hot tier first (verified).
            directory = ensure_hot(self, ck)
            # The hot copy may be a re-encoded one (restored from the archive codec's copy).
            manifest = read_manifest(directory, expected_digest=hot_digest(self, ck))
            if manifest.delta is not None and manifest.delta.lossy:
                logger.warning(
                    "loading %s: values of %s are approximate (lossy delta, max abs error "
                    "%g, mean %g); compact it or save in full where exact values matter",
                    ck.ref, list(manifest.delta.scope), manifest.delta.max_abs_error,
                    manifest.delta.mean_abs_error,
                )
            if is_dcp_manifest(manifest):
                from ckptstore.integrations.dcp import load_dcp

                state = load_dcp(self, directory, manifest, keys=keys, into=into,
                                 threads=self.settings.threads)
            else:
                state = read_checkpoint(
                    directory,
                    manifest,
                    keys=keys,
                    into=into,
                    locate=self.locate,
                    threads=self.settings.threads,
                )
            timer.add(bytes_logical=manifest.logical_bytes, bytes_stored=manifest.stored_bytes)
        return state

    def load_progressive(
        self,
        ref: str,
        order: Sequence[str | Sequence[str]],
        *,
        into: Any | None = None,
        strict: bool = True,
    ) -> ProgressiveLoad:
        """Start loading a checkpoint in priority groups; return once the manifest is read.

        Groups complete in ``order`` (fnmatch patterns; everything else last), so training
        or evaluation can start on the first group while the rest streams in. From the
        memory tier, the hot tier, or straight from S3 chunk by chunk.

        Args:
            ref: A checkpoint reference.
            order: Groups in load order, each a pattern or a list of patterns.
            into: A live state whose matching tensors are filled in place.
            strict: Raise if a pattern matches no tensor.

        Returns:
            A :class:`~ckptstore.hooks.progressive.ProgressiveLoad`: ``wait(i)`` or
            iteration for groups as they complete, ``result()`` for the whole state.

        Raises:
            CheckpointNotFoundError: If the reference does not resolve.
            InvalidNameError: If ``order`` is malformed or a pattern matches nothing.
        """
        from ckptstore.hooks.progressive import load_progressive

        return load_progressive(self, ref, order, into=into, strict=strict)

    def restore_latest(self, run: str, *, into: Any | None = None) -> Any | None:
        """Load the newest committed checkpoint of ``run``, or None if it has none."""
        try:
            ck = self.catalog.latest(run)
        except CheckpointNotFoundError:
            return None
        return self.load(ck.id, into=into)

    def verify(self, ref: str, *, deep: bool = True) -> builtins.list[str]:
        """Re-hash a checkpoint on the hot tier; return the problems found ([] when intact)."""
        ck = self.catalog.get(ref)
        directory = self._hot_dir_of(ck)
        manifest = read_manifest(directory, expected_digest=expected_digest(ck, "hot"))
        if is_dcp_manifest(manifest):
            from ckptstore.integrations.dcp_read import verify_dcp

            problems = verify_dcp(directory, manifest, deep=deep)
        else:
            problems = verify_checkpoint(directory, manifest, locate=self.locate, deep=deep)
        self.catalog.record_event(
            "verified",
            checkpoint_id=ck.id,
            detail={"tier": "hot", "ok": not problems, "problems": problems[:20]},
        )
        return problems

    # ------------------------------------------------------------------ queries
    def get(self, ref: str) -> Checkpoint:
        """Resolve a reference to its committed :class:`Checkpoint`."""
        return self.catalog.get(ref)

    def list(self, **filters: Any) -> builtins.list[Checkpoint]:
        """List checkpoints; see :meth:`ckptstore.catalog.Catalog.list` for the filters."""
        return self.catalog.list(**filters)

    def runs(self) -> builtins.list[RunInfo]:
        """All runs with their committed checkpoint counts."""
        return self.catalog.runs()

    def run(self, name: str, **fields: Any) -> RunInfo:
        """Get or create a run, recording experiment/config/code and data versions."""
        return self.catalog.ensure_run(name, **fields)

    def latest(self, run: str) -> Checkpoint:
        """Newest committed checkpoint of a run."""
        return self.catalog.latest(run)

    def best(self, run: str, metric: str, mode: str = "min") -> Checkpoint:
        """Committed checkpoint of a run with the lowest (``min``) or highest metric."""
        return self.catalog.best(run, metric, mode)

    def lineage(self, ref: str) -> builtins.list[Checkpoint]:
        """Ancestors of a checkpoint (parent first), across runs."""
        return self.catalog.lineage(ref)

    def descendants(self, ref: str) -> builtins.list[Checkpoint]:
        """Checkpoints resumed or fine-tuned from this one, transitively."""
        return self.catalog.descendants(ref)

    def alias(self, ref: str, name: str) -> None:
        """Point alias ``name`` at a checkpoint (moving it if it exists); aliased = kept."""
        self.catalog.alias(ref, name)

    def pin(self, ref: str) -> None:
        """Protect a checkpoint from retention pruning."""
        self.catalog.pin(ref)

    def unpin(self, ref: str) -> None:
        """Remove the pin of a checkpoint."""
        self.catalog.unpin(ref)

    def events(self, ref: str | None = None, **kw: Any) -> builtins.list[Event]:
        """Audit log entries (of one checkpoint, or all)."""
        return self.catalog.events(ref, **kw)

    def usage(self) -> builtins.list[UsageRow]:
        """Bytes stored by run and tier."""
        return self.catalog.usage()

    def show(self, ref: str) -> dict[str, Any]:
        """Everything needed to understand and reproduce a checkpoint.

        Returns:
            A JSON-able dict: the catalog record, the run's reproduction record and a summary
            of the manifest (tensor count, dtypes, bytes, codec, chunks).
        """
        ck = self.catalog.get(ref)
        info: dict[str, Any] = {"checkpoint": _checkpoint_dict(ck)}
        record = self.catalog.run_record(ck.id)
        info["reproduction"] = {
            **record.get("run", {}),
            "parents": [p["ref"] for p in record.get("parents", [])],
            "metrics_at_save": record.get("metrics", {}),
            "edges": record.get("edges", []),
        }
        try:
            manifest = read_manifest(self._hot_dir_of(ck),
                                     expected_digest=expected_digest(ck, "hot"))
        except CkptError as exc:
            info["manifest"] = {"error": str(exc)}
            return info
        info["manifest"] = manifest_summary(manifest)
        return info

    # ------------------------------------------------------------------ gc
    def gc(self, *, dry_run: bool = False, older_than_s: float = 24 * 3600) -> GcReport:
        """Remove what dead saves left behind on the hot tier.

        A PENDING row is dead when its writer process on this host is gone, or when it is older
        than ``older_than_s`` (writers on other hosts). Its directory is deleted and the row is
        marked FAILED. Directories without a catalog row and without a commit marker are removed
        too. Committed data is never touched.

        Args:
            dry_run: Only report what would be removed.
            older_than_s: Age after which a PENDING row of another host counts as dead.

        Returns:
            A :class:`GcReport`.
        """
        from ckptstore.ops.replicas import acquire_lease

        report = GcReport(dry_run=dry_run)
        host = socket.gethostname()
        dead: list[Checkpoint] = []
        for ck in self.catalog.list(state=CheckpointState.PENDING):
            writer = getattr(ck, "writer", None) or ""
            w_host, _, w_pid = writer.rpartition(":")
            age = time.time() - ck.created_at.timestamp()
            if ck.id in self._abandoned:
                dead.append(ck)
            elif w_host == host and w_pid.isdigit():
                if not pid_alive(int(w_pid)):
                    dead.append(ck)
            elif age > older_than_s:
                dead.append(ck)
        known: set[str] = set()
        unowned: list[Checkpoint] = []
        for ck in self.catalog.list(state=None):
            known.add(ck.id)
            hot = ck.replica("hot")
            if ck.state == CheckpointState.COMMITTED and (
                hot is None or hot.state == ReplicaState.DELETED
            ):
                unowned.append(ck)
        for ck in dead:
            report.failed_rows.append(ck.id)
            directory = self.checkpoint_dir(ck.run, ck.id)
            if directory.exists():
                report.removed_dirs.append(str(directory))
            if not dry_run:
                self.catalog.fail_checkpoint(ck.id, "abandoned save removed by gc")
                shutil.rmtree(directory, ignore_errors=True)
        for ck in self.catalog.list(state=CheckpointState.FAILED):
            directory = self.checkpoint_dir(ck.run, ck.id)
            if directory.exists() and str(directory) not in report.removed_dirs:
                report.removed_dirs.append(str(directory))
                if not dry_run:
                    shutil.rmtree(directory, ignore_errors=True)
        for directory in self._orphan_dirs(known):
            report.removed_dirs.append(str(directory))
            if not dry_run:
                shutil.rmtree(directory, ignore_errors=True)
        for ck in unowned:
            # A killed restore's partial copy: no marker, and the catalog records no hot
            # copy. Taken under the restore lease, so a running restore is never disturbed
            # (a killed restore's lease names a dead process: taken over, not waited for).
            directory = self.checkpoint_dir(ck.run, ck.id)
            if not directory.is_dir() or (directory / "COMMITTED").exists():
                continue
            owner = f"gc:{writer_id()}"
            if not acquire_lease(self, ck.id, "restore:hot", owner, 600.0):
                continue
            try:
                report.removed_dirs.append(str(directory))
                if not dry_run:
                    shutil.rmtree(directory, ignore_errors=True)
            finally:
                self.catalog.release_lease(ck.id, "restore:hot", owner)
        if not dry_run:
            self._abandoned.difference_update(report.failed_rows)
        if not dry_run and not report.empty:
            self.catalog.record_event(
                "gc", detail={"removed": len(report.removed_dirs), "failed": report.failed_rows}
            )
        return report

    def _orphan_dirs(self, known: set[str]) -> Iterator[Path]:
        """Checkpoint directories with no catalog row and no commit marker."""
        if not self.hot.is_dir():
            return
        for run_dir in self.hot.iterdir():
            if not run_dir.is_dir() or run_dir.name.startswith("."):
                continue
            for ck_dir in run_dir.iterdir():
                if ck_dir.name in known or not ck_dir.is_dir():
                    continue
                if not (ck_dir / "COMMITTED").exists():
                    yield ck_dir


def _checkpoint_dict(ck: Checkpoint) -> dict[str, Any]:
    return {
        "id": ck.id,
        "ref": ck.ref,
        "run": ck.run,
        "step": ck.step,
        "version": ck.version,
        "state": str(ck.state),
        "kind": ck.kind,
        "base_id": ck.base_id,
        "parent_id": ck.parent_id,
        "created_at": ck.created_at.isoformat(),
        "metrics": dict(ck.metrics),
        "tags": list(ck.tags),
        "logical_bytes": ck.logical_bytes,
        "stored_bytes": ck.stored_bytes,
        "codec": ck.codec,
        "manifest_digest": ck.manifest_digest,
        "lossy": ck.lossy,
        "error_bound": ck.error_bound,
        "lossy_scope": list(ck.lossy_scope),
        "pinned": ck.pinned,
        "aliases": list(ck.aliases),
        "replicas": [
            {
                "tier": r.tier,
                "state": str(r.state),
                "bytes": r.bytes,
                "verified_at": r.verified_at.isoformat() if r.verified_at else None,
                "manifest_digest": r.manifest_digest,
            }
            for r in ck.replicas
        ],
    }


def manifest_summary(manifest: Manifest) -> dict[str, Any]:
    """A short JSON-able summary of a manifest for ``ckpt show``."""
    dtypes: dict[str, int] = {}
    for entry in manifest.tensors.values():
        dtype = str(entry["torch_dtype"] if isinstance(entry, dict) else entry.torch_dtype)
        dtypes[dtype] = dtypes.get(dtype, 0) + 1
    chunks = 0
    for arr in manifest.arrays.values():
        chunk_list = arr["chunks"] if isinstance(arr, dict) else arr.chunks
        chunks += len(chunk_list)
    return {
        "format_version": manifest.format_version,
        "codec": manifest.codec,
        "kind": manifest.kind,
        "tensors": len(manifest.tensors),
        "dtypes": dtypes,
        "arrays": len(manifest.arrays),
        "chunks": chunks,
        "logical_bytes": manifest.logical_bytes,
        "stored_bytes": manifest.stored_bytes,
        "delta": manifest.delta.to_dict() if manifest.delta is not None else None,
    }
