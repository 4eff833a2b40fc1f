"""CheckpointStore: the public facade. Every method is a thin call into :mod:`ckptstore.ops`.

The store *is* a :class:`~ckptstore.core.StoreCore` (settings, catalog, tiers, metrics and the
per-store services), so anything that takes a core takes a store. The work happens in the
operations: a save in :mod:`ckptstore.ops.writing.save`, a load in
:mod:`ckptstore.ops.reading.load`, hot-tier gc in :mod:`ckptstore.ops.tiering.gc`;
docs/ARCHITECTURE.md traces a save and a load through them.
"""

from __future__ import annotations

import builtins
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ckptstore.core import StoreCore
from ckptstore.errors import InvalidNameError
from ckptstore.format import Manifest
from ckptstore.ops.reading.prefetch import DEFAULT_HOLD_S, PrefetchResult, prefetch_checkpoint
from ckptstore.ops.reading.show import show_checkpoint
from ckptstore.ops.tiering.gc import DEFAULT_PENDING_GRACE_S, GcReport, gc_hot
from ckptstore.ops.tiering.thaw_poll import complete_thaw
from ckptstore.ops.trigger import trigger_flow
from ckptstore.progress import Progress
from ckptstore.records import Checkpoint, Event, RunInfo, UsageRow
from ckptstore.save_options import LATEST, Latest, SaveOptions

if TYPE_CHECKING:
    # The operations that read or write tensors are imported where used: torch (and
    # torch.distributed.checkpoint) take more than a second of CPU to import, which every
    # flow run (a fresh process per run on a worker) and CLI command would pay for nothing:
    # archiving, pruning and the catalog never touch a tensor (tests/cli/test_startup.py).
    from ckptstore.ops.dcp import ZarrStorageReader, ZarrStorageWriter
    from ckptstore.ops.reading.progressive import ProgressiveLoad
    from ckptstore.ops.reading.sweep import CheckpointSweep
    from ckptstore.ops.writing.async_save import SaveHandle

__all__ = ["CheckpointStore"]


class CheckpointStore(StoreCore):
    """Save, load, find and manage checkpoints.

    Open it with :meth:`open`; close it with :meth:`close` (or use it as a context manager).

    Example:
        >>> store = CheckpointStore.open("./ckpt")                      # doctest: +SKIP
        >>> ck = store.save("run-a", step=100, state=model.state_dict(),  # doctest: +SKIP
        ...                 metrics={"loss": 2.3})
        >>> state = store.load("run-a@latest")                          # doctest: +SKIP
    """

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
        config: Any = None,
        data_version: str | None = None,
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
            codec: Codec preset (default from the settings: ``auto``, chosen per array).
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
            config: The run's training configuration (a mapping, or an object with
                ``to_dict()``), recorded with the run's context: JSON-safe, secrets masked
                (docs/REPRODUCE.md). The context (git commit and change, command,
                environment) is recorded on the run's first save and when it changes,
                unless the ``capture`` setting is off.
            data_version: The data set's version, recorded with the context.
            distributed: Call on every rank of a process group. Sharded states (DTensor,
                FSDP2, ShardedTensor, top-level ``Stateful`` objects) are saved by every
                rank through DCP into one checkpoint (``delta``/``base`` do not apply);
                plain (DDP) states are saved by rank 0 while the others wait. See
                :func:`ckptstore.ops.dcp.save_distributed`.
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
        options = SaveOptions(metrics=metrics, tags=tuple(tags), parent=parent, codec=codec,
                              experiment=experiment, delta=delta, base=base, config=config,
                              data_version=data_version)
        if distributed:
            from ckptstore.ops.dcp import save_distributed

            return save_distributed(self, run, step, state, options,
                                    process_group=process_group)
        from ckptstore.ops.writing.save import save_checkpoint

        return save_checkpoint(self, run, step, state, options, progress=progress)

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
        config: Any = None,
        data_version: str | None = None,
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
            config: As for :meth:`save`.
            data_version: As for :meth:`save`.

        Returns:
            A :class:`~ckptstore.ops.writing.async_save.SaveHandle`; ``.result()`` waits for
            the commit.

        Raises:
            CkptError: An earlier async save's failure (raised once, by the next call).
            ConfigError: If the state is larger than ``staging_budget_bytes``.
            UnsafeObjectError: If the state holds an object that would need pickle.
        """
        options = SaveOptions(metrics=metrics, tags=tuple(tags), parent=parent, codec=codec,
                              experiment=experiment, delta=delta, base=base, config=config,
                              data_version=data_version)
        from ckptstore.ops.writing.async_save import save_async

        return save_async(self, run, step, state, options, on_commit=on_commit)

    def wait(self) -> None:
        """Wait for every pending async save; raise the first failure not yet reported."""
        from ckptstore.ops.writing.async_save import wait_async

        wait_async(self)

    def dcp_writer(self, run: str, step: int, **kw: Any) -> ZarrStorageWriter:
        """A ``torch.distributed.checkpoint`` storage writer saving one checkpoint of ``run``.

        Create it on every rank, then ``dcp.save(state, storage_writer=writer)`` (or
        ``dcp.async_save``); ``kw``: ``metrics``, ``tags``, ``parent``, ``codec``,
        ``experiment`` (see :class:`ckptstore.ops.dcp.ZarrStorageWriter`).
        """
        from ckptstore.ops.dcp import ZarrStorageWriter

        return ZarrStorageWriter(self, run, step, **kw)

    def dcp_reader(self, ref: str) -> ZarrStorageReader:
        """A ``torch.distributed.checkpoint`` storage reader for a checkpoint saved via DCP.

        ``dcp.load(state, storage_reader=store.dcp_reader(ref))`` loads it at any world size
        and placement; every rank reads only the chunks holding its slices.
        """
        from ckptstore.ops.dcp import dcp_reader

        return dcp_reader(self, ref)

    def merge(
        self,
        refs: Sequence[str],
        *,
        run: str,
        step: int,
        method: str | None = None,
        weights: Sequence[float] | None = None,
        weights_from_metric: str | None = None,
        keys: Sequence[str] | None = None,
        accumulate: str = "auto",
        metrics: dict[str, float] | None = None,
        tags: Sequence[str] = (),
        codec: str | None = None,
        progress: Progress | None = None,
    ) -> Checkpoint:
        """Merge checkpoints into a new one: the weighted mean of their floating-point tensors.

        Model soups, averaging a run's last checkpoints, federated averaging. The merge
        streams chunk by chunk (memory: one chunk per input per writer thread, never a
        state) and the result is an ordinary checkpoint of ``run`` at ``step`` whose lineage
        lists every input (a ``merged-from`` edge each, with its weight and position; the
        method and weights in a ``merged`` event). Integer and bool tensors and non-tensor
        values come from the first input. Merging the same inputs the same way into the
        same run and step again returns the existing checkpoint.

        Args:
            refs: Two or more checkpoint references, each naming a different checkpoint.
            run: Run of the merged checkpoint.
            step: Its step.
            method: ``mean`` (equal weights) or ``weighted``; default ``weighted`` when
                weights are given, else ``mean``.
            weights: One finite, non-negative weight per input, normalised to sum to 1.
            weights_from_metric: Take each input's weight from this recorded metric (e.g.
                ``samples``, for federated averaging).
            keys: fnmatch patterns selecting what is merged and kept (e.g. ``["model/*"]``);
                the rest is left out of the result.
            accumulate: ``auto`` (float32 and float64 in their own dtype, float32 for 16/8-bit
                ones), ``float32`` or ``float64``.
            metrics: Metrics to record with the merged checkpoint.
            tags: Tags to record.
            codec: Codec preset (default from the settings).
            progress: Called with the bytes of each chunk written (one with ``set_total`` is
                told the total first).

        Returns:
            The merged (COMMITTED) checkpoint.

        Raises:
            InvalidNameError: For fewer than two inputs, one named twice, an unknown method,
                weights that are missing, miscounted, NaN/inf, negative or sum to zero, a
                missing metric, or inputs whose keys, shapes or dtypes differ (the first
                such key is named).
            CheckpointNotFoundError: If an input does not resolve.
            IntegrityError: If an input's chunk is damaged (named); nothing is committed.

        Example:
            >>> store.merge(["site-a@latest", "site-b@latest"], run="global", step=10,
            ...             weights_from_metric="samples")  # doctest: +SKIP
        """
        from ckptstore.ops.upkeep.merge import merge_checkpoints

        return merge_checkpoints(
            self, refs, run=run, step=step, method=method, weights=weights,
            weights_from_metric=weights_from_metric, keys=keys, accumulate=accumulate,
            metrics=metrics, tags=tags, codec=codec, progress=progress,
        )

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
        trigger_flow(self, flow_name, checkpoint, **params)

    # ------------------------------------------------------------------ load
    def manifest(self, ref: str) -> Manifest:
        """Read and verify the manifest of a committed checkpoint (no tensor data)."""
        from ckptstore.ops.reading.load import read_any_manifest

        return read_any_manifest(self, ref)

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
        from ckptstore.ops.reading.load import load_checkpoint

        return load_checkpoint(self, ref, keys=keys, into=into,
                               require_signature=require_signature)

    def load_progressive(
        self,
        ref: str,
        order: Sequence[str | Sequence[str]],
        *,
        into: Any | None = None,
        strict: bool = True,
        key: str | os.PathLike[str] | None = None,
    ) -> ProgressiveLoad:
        """Start loading a checkpoint in priority groups; return once the manifest is read.

        Groups complete in ``order`` (fnmatch patterns; everything else last), so training
        or evaluation can start on the first group while the rest streams in. From the
        memory tier, the hot tier, or straight from S3 chunk by chunk (from an encrypted
        tier too, decrypted and checked object by object, given a key).

        Args:
            ref: A checkpoint reference.
            order: Groups in load order, each a pattern or a list of patterns.
            into: A live state whose matching tensors are filled in place.
            strict: Raise if a pattern matches no tensor.
            key: Private key that opens a sealed copy (an encrypted tier); default
                ``$CKPT_DECRYPT_KEY``, else ``decrypt_key``.

        Returns:
            A :class:`~ckptstore.ops.reading.progressive.ProgressiveLoad`: ``wait(i)`` or
            iteration for groups as they complete, ``result()`` for the whole state.

        Raises:
            CheckpointNotFoundError: If the reference does not resolve.
            InvalidNameError: If ``order`` is malformed or a pattern matches nothing.
            DecryptionError: If the only copies are sealed and no key, or a key they were
                not encrypted to, was given.
        """
        from ckptstore.ops.reading.progressive import load_progressive

        return load_progressive(self, ref, order, into=into, strict=strict, key=key)

    def prefetch(self, ref: str, *, to: str = "hot",
                 hold_s: float = DEFAULT_HOLD_S) -> PrefetchResult:
        """Bring a checkpoint to this host's hot (or memory) tier ahead of need, verified,
        and keep retention away from it for ``hold_s`` seconds or until it is loaded.

        Raises:
            ThawPendingError: If its only copy is archival (GLACIER): a thaw was requested.

        See :func:`ckptstore.ops.reading.prefetch.prefetch_checkpoint`.
        """
        if to not in ("hot", "memory"):
            raise InvalidNameError(f"prefetch destination {to!r} is not 'hot' or 'memory'")
        return prefetch_checkpoint(self, ref, to="memory" if to == "memory" else "hot",
                                   hold_s=hold_s)

    def iter_checkpoints(self, run: str, *, prefetch: int = 2,
                         keys: Sequence[str] | None = None,
                         preload: bool = True) -> CheckpointSweep:
        """Iterate ``(checkpoint, state)`` over a run's checkpoints, oldest first, while the
        next ``prefetch`` ones are brought to the hot tier in a background thread and (with
        ``preload``) the next one is loaded into memory.

        Close it (or use ``with``) when stopping early; an abandoned one is closed when
        collected. See :class:`ckptstore.ops.reading.sweep.CheckpointSweep`.

        Example:
            >>> for ck, state in store.iter_checkpoints("run-a", prefetch=2):  # doctest: +SKIP
            ...     evaluate(ck.step, state)
        """
        from ckptstore.ops.reading.sweep import CheckpointSweep

        return CheckpointSweep(self, run, prefetch=prefetch, keys=keys, preload=preload)

    def thaw(self, ref: str, *, poll_s: float = 300.0, timeout_s: float | None = None,
             key: str | os.PathLike[str] | None = None) -> Path:
        """Wait until a checkpoint's archival (GLACIER) copy has thawed, then restore it to
        the hot tier (a sealed copy decrypted with ``key``, default ``$CKPT_DECRYPT_KEY``,
        else ``decrypt_key``); see :func:`ckptstore.ops.tiering.thaw_poll.complete_thaw`."""
        return complete_thaw(self, ref, poll_s=poll_s, timeout_s=timeout_s, key=key)

    def restore_latest(self, run: str, *, into: Any | None = None) -> Any | None:
        """Load the newest committed checkpoint of ``run``, or None if it has none."""
        from ckptstore.ops.reading.load import restore_latest

        return restore_latest(self, run, into=into)

    def verify(self, ref: str, *, deep: bool = True) -> builtins.list[str]:
        """Re-hash a checkpoint on the hot tier; return the problems found ([] when intact)."""
        from ckptstore.ops.reading.load import verify_hot

        return verify_hot(self, ref, deep=deep)

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
        return show_checkpoint(self, ref)

    # ------------------------------------------------------------------ gc
    def gc(self, *, dry_run: bool = False,
           older_than_s: float = DEFAULT_PENDING_GRACE_S) -> GcReport:
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
        return gc_hot(self, dry_run=dry_run, older_than_s=older_than_s)
