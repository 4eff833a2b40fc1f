"""The save transaction: PENDING row → durable files on the hot tier → COMMITTED row.

A save is: check its options (:func:`check_save`) → flatten the state once (no pickle) → a
PENDING catalog row with the next version → chunks, manifest and commit marker on the hot
tier, each durable → the COMMITTED row (:func:`write_save`, which the async saver calls with
its staged copy of the flattened state). Anything that is not COMMITTED is invisible to loads
and listings; ``gc`` removes what dead saves left behind (:mod:`ckptstore.ops.tiering.gc`).
"""

from __future__ import annotations

import logging
import shutil
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from ckptstore.catalog.checks import check_metrics, check_step
from ckptstore.core import StoreCore
from ckptstore.errors import CkptError, ConfigError, StorageError
from ckptstore.faultpoints import fault_point
from ckptstore.format import FlatState, as_flat, write_checkpoint
from ckptstore.format.gcpause import without_gc
from ckptstore.format.sources import StreamedState
from ckptstore.identity import writer_id
from ckptstore.names import validate_name, validate_tag
from ckptstore.observability.metrics import dedup_bytes
from ckptstore.ops.writing.context import record_run_context
from ckptstore.ops.writing.delta import plan_save
from ckptstore.ops.writing.lossy import lossy_record
from ckptstore.ops.writing.memory import stage_after_commit
from ckptstore.records import Checkpoint
from ckptstore.save_options import SaveOptions

__all__ = ["abandon_save", "begin_save", "check_save", "save_checkpoint", "write_save"]

logger = logging.getLogger(__name__)


def check_save(
    core: StoreCore, run: str, step: object, options: SaveOptions
) -> tuple[int, SaveOptions]:
    """Validate what a save records, before anything is written or catalogued.

    The catalog checks these too, but a save creates the run (``experiment``) and stages
    state before it begins the checkpoint row: a step beyond the ``BIGINT`` column or a
    metric beyond the float range must fail first, leaving nothing behind.

    Returns:
        The step, and the options with the metrics as ``{name: float}`` and the codec
        resolved (the store's setting when the options name none).

    Raises:
        ConfigError: If the hot tier is object storage (only distributed saves write there).
        InvalidNameError: For a bad run name, tag, step or metric.
    """
    if core.settings.hot_remote is not None:
        raise ConfigError(
            f"the hot tier is object storage ({core.settings.hot_remote}): only distributed "
            "saves of sharded states write there (store.save(..., distributed=True) with "
            "DTensor/FSDP state, or dcp.save with store.dcp_writer); set hot to a local path "
            "for other saves"
        )
    validate_name(run)
    for tag in options.tags:
        validate_tag(tag)
    checked_step, metrics = check_step(step), check_metrics(options.metrics)
    return checked_step, replace(options, metrics=metrics,
                                 codec=options.codec or core.settings.codec)


def begin_save(
    core: StoreCore,
    run: str,
    step: int,
    options: SaveOptions,
    *,
    codec: str,
    kind: str = "full",
    base_id: str | None = None,
    lossy: bool = False,
) -> Checkpoint:
    """File the run under its experiment and begin the PENDING row of a save.

    Shared by the regular save below and the DCP writer's coordinator
    (:mod:`ckptstore.ops.dcp.writer`), so both record a save's options the same way.

    Raises:
        CheckpointNotFoundError: If ``options.parent`` does not resolve.
    """
    parent_id = core.catalog.get(options.parent).id if options.parent is not None else None
    if options.experiment is not None:
        core.catalog.ensure_run(run, experiment=options.experiment)
    ck = core.catalog.begin_checkpoint(
        run,
        step,
        metrics=options.metrics,
        tags=options.tags,
        parent_id=parent_id,
        kind=kind,
        base_id=base_id,
        codec=codec,
        lossy=lossy,
        writer=writer_id(),
        tier="hot",
        uri="",
    )
    # What made it (code, command, environment, config): recorded from the version on
    # which it first applies; never fails the save (ops/writing/context.py).
    record_run_context(core, ck, options)
    return ck


# The collector is paused for the whole transaction, not only while the files are written:
# the catalog statements before them allocate enough (SQLAlchemy compiles and result rows)
# to set off a full collection of the training process's objects, measured at 170-200 ms
# inside a 1.5 GB save (:mod:`ckptstore.format.gcpause`).
@without_gc
def save_checkpoint(
    core: StoreCore,
    run: str,
    step: int,
    state: Any,
    options: SaveOptions | None = None,
    *,
    progress: Callable[[int], None] | None = None,
) -> Checkpoint:
    """Save ``state`` as a new version of ``run`` at ``step``; return it once COMMITTED.

    The arguments are those of :meth:`ckptstore.store.CheckpointStore.save` (one process;
    distributed saves go through :mod:`ckptstore.ops.dcp`), the options as one value.
    ``state`` may already be flattened (a :class:`~ckptstore.format.FlatState`): it is
    then passed down as it is, never walked again.

    Raises:
        InvalidNameError: For a bad run name, tag, metric or ``delta`` setting.
        CheckpointNotFoundError: If an explicit ``base`` or ``parent`` does not resolve.
        UnsafeObjectError: If the state holds an object that would need pickle.
        StorageError: If the hot tier fails (disk full, permissions); nothing is committed.
        ConfigError: If the hot tier is object storage (only distributed saves write there).
    """
    step, options = check_save(core, run, step, options or SaveOptions())
    # Refuse pickle-only objects before anything is written or catalogued; the flattened
    # state is what the writer and the memory tier take, so this is the only walk of it.
    # A streamed state (a merge: tensors produced while written) checks its own tree.
    flat: FlatState | StreamedState
    if isinstance(state, StreamedState):
        state.flat()
        flat = state
    else:
        flat = as_flat(state)
    return write_save(core, run, step, flat, options, progress=progress)


@without_gc
def write_save(
    core: StoreCore,
    run: str,
    step: int,
    flat: FlatState | StreamedState,
    options: SaveOptions,
    *,
    progress: Callable[[int], None] | None = None,
) -> Checkpoint:
    """The transaction of a checked save: PENDING row → files → COMMITTED row.

    Args:
        core: The open store.
        run: Run name.
        step: The step as :func:`check_save` returned it.
        flat: The flattened state (the async saver's staged copy, for a background save),
            or a :class:`~ckptstore.format.sources.StreamedState` (a merge).
        options: The options as :func:`check_save` returned them.
        progress: Called with the number of bytes written after each chunk.

    Raises:
        CheckpointNotFoundError: If an explicit ``base`` or ``parent`` does not resolve.
        InvalidNameError: For a bad ``delta`` setting.
        StorageError: If the hot tier fails (disk full, permissions); nothing is committed.
    """
    codec = options.codec or core.settings.codec
    plan = plan_save(core, run, options.delta, options.base)
    ck = begin_save(core, run, step, options, codec=codec, kind=plan.kind,
                    base_id=plan.base_id, lossy=plan.lossy)
    directory = core.checkpoint_dir(run, ck.id)
    fault_point("save.pending")
    started = time.perf_counter()
    with core.metrics.timed("save", run=run, tier="hot", step=step, blocking=True) as timer:
        try:
            _check_run_dir(core, directory)
            manifest = write_checkpoint(
                directory,
                flat,
                ckpt_id=ck.id,
                run=run,
                step=step,
                codec=codec,
                chunk_bytes=core.settings.chunk_bytes,
                threads=core.settings.threads,
                base=plan.base,
                delta=plan.spec,
                depth=plan.depth,
                fault_point=lambda phase: fault_point(f"save.{phase}"),
                progress=progress,
                base_cache=core.keyframe_cache,
            )
        except BaseException as exc:
            abandon_save(core, ck.id, directory, exc)
            if isinstance(exc, OSError) and not isinstance(exc, CkptError):
                raise StorageError(f"saving {run}@{step} failed: {exc}") from exc
            raise
        try:
            committed = core.catalog.commit_checkpoint(
                ck.id,
                manifest_digest=manifest.digest,
                logical_bytes=manifest.logical_bytes,
                stored_bytes=manifest.stored_bytes,
                tier="hot",
                uri=str(directory),
                **lossy_record(manifest),
            )
        except BaseException as exc:
            # The data is durable but the catalog did not take it. Only delete it once the
            # row is known to be FAILED: the commit may have landed before the error (a
            # connection lost after COMMIT), and then the data is the checkpoint.
            abandon_save(core, ck.id, directory, exc, data_may_be_committed=True)
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
    # copy is committed; it never fails the save. A streamed state (a merge) has no tensors
    # in memory to copy: it is loaded from the hot tier like any other checkpoint.
    if isinstance(flat, FlatState) and stage_after_commit(core, committed, flat):
        committed = core.catalog.get_any(committed.id)
    return committed


def _check_run_dir(core: StoreCore, directory: Path) -> None:
    directory.parent.mkdir(parents=True, exist_ok=True)
    if directory.parent.is_symlink() or directory.parent.resolve().parent != core.hot.resolve():
        # A run directory replaced by a link would make us write outside the root.
        raise StorageError(
            f"{directory.parent} is a symlink or lies outside the hot tier {core.hot}; "
            "remove the link (checkpoints are never written through links)"
        )


def abandon_save(
    core: StoreCore,
    ckpt_id: str,
    directory: Path,
    exc: BaseException,
    *,
    data_may_be_committed: bool = False,
) -> None:
    """Mark a failed save FAILED and remove its partial directory (best effort).

    When the catalog cannot be told (it may be what failed), the id is remembered in
    :attr:`~ckptstore.core.StoreCore.abandoned` and ``gc`` finishes the job in this process;
    other processes' gc does it once this one has exited.
    """
    try:
        core.catalog.fail_checkpoint(ckpt_id, f"{type(exc).__name__}: {exc}")
    except Exception:  # the catalog may be the thing that failed; gc finishes the job
        logger.warning("could not mark checkpoint %s FAILED", ckpt_id, exc_info=True)
        core.abandoned.add(ckpt_id)
        if data_may_be_committed:
            return
    shutil.rmtree(directory, ignore_errors=True)
