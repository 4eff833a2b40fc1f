"""The store's distributed save and load: which path a state takes, and DCP's failures.

* :func:`save_distributed`: sharded states (DTensor, FSDP2, ShardedTensor, ``Stateful``)
  go through DCP with :class:`~ckptstore.ops.dcp.writer.ZarrStorageWriter`; a plain
  replicated state is saved once by rank 0 in the regular format.
* :func:`load_dcp`: a DCP-layout checkpoint loads as full tensors without a process group,
  or into a (sharded) state with ``dcp.load``; :func:`load_parted` does the same for a
  checkpoint saved across hosts, reading each host's part from the best copy this host
  reaches (:mod:`ckptstore.ops.dcp.parts`).
* After a save across hosts, :func:`save_distributed` hands every host's part its manifest
  (one broadcast from the coordinator, written on a background thread) and, with
  ``replicas = 2``, starts sending each part to a neighbour host
  (:mod:`ckptstore.ops.dcp.peers`).
* DCP reports a failure on any rank as a ``CheckpointException`` (a BaseException); it is
  turned into the CkptError of its cause, naming the failing ranks.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import blake3
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from ckptstore.core import StoreCore
from ckptstore.errors import (
    CkptError,
    IncompleteCheckpointError,
    IntegrityError,
    InvalidNameError,
    StorageError,
)
from ckptstore.format import Manifest
from ckptstore.format.dcp.chunks import ChunkSource
from ckptstore.format.dcp.read import load_full
from ckptstore.format.manifest import parse_verified
from ckptstore.ops.dcp.peers import peers_for, replicate_parts
from ckptstore.ops.dcp.reader import REMOTE_READ_THREADS, SafeLoadPlanner, ZarrStorageReader
from ckptstore.ops.dcp.writer import ZarrStorageWriter
from ckptstore.ops.tiering.parts import PartsSource, materialize, parts_source
from ckptstore.ops.tiering.thaw import thawed_source
from ckptstore.ops.writing.save import save_checkpoint
from ckptstore.records import Checkpoint
from ckptstore.save_options import LATEST, SaveOptions, options_of

__all__ = ["load_dcp", "load_parted", "needs_dcp", "save_distributed"]

logger = logging.getLogger(__name__)


def _dist_on() -> bool:
    return dist.is_available() and dist.is_initialized()


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
    options: SaveOptions | None = None,
    *,
    process_group: Any = None,
    pack_below: int | None = None,
    **fields: Any,
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
        options: The save's options; ``delta`` and ``base`` apply to plain states and are
            ignored for sharded ones.
        process_group: Process group (default: the default group).
        pack_below: For sharded states, see :class:`ZarrStorageWriter`.
        **fields: The options as keywords (``metrics=``, ``tags=``, ...), for a caller that
            passes no ``options``.

    Raises:
        CkptError: On every rank if any rank failed; nothing is committed and earlier
            checkpoints are untouched. The class is the cause's where it is a CkptError.
    """
    options = options_of(options, **fields)
    sharded = needs_dcp(state)
    if not _dist_on() and not sharded:
        return save_checkpoint(store, run, step, state, options)
    if sharded:
        # Chunk dedup and delta encoding apply to the regular format only.
        dcp_options = replace(options, delta=None, base=LATEST)
        return _save_sharded(store, run, step, state, process_group, dcp_options, pack_below)
    return _save_replicated(store, run, step, state, process_group, options)


def _save_sharded(store: StoreCore, run: str, step: int, state: Any, group: Any,
                  options: SaveOptions, pack_below: int | None) -> Checkpoint:
    from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

    if not isinstance(state, dict):
        raise InvalidNameError(
            f"a sharded state must be a dict (DCP's state_dict), got {type(state).__name__}"
        )
    if store.peers is not None:
        # A neighbour may still be receiving the previous save's part: one transfer at a time.
        peers_for(store).wait()
    writer = ZarrStorageWriter(store, run, step, options, pack_below=pack_below)
    writer.materialize_on_exit = False  # one broadcast below instead of a catalog read per host
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
    part = writer.part
    if part is None or not part.parted or part.remote or not _dist_on():
        return writer.checkpoint
    try:
        ck, manifest = _share_manifest(store, writer, group)
        if store.settings.replicas > 1:
            replicate_parts(store, ck, manifest, part, group)
    except (Exception, CheckpointException) as exc:
        raise _dcp_error(
            f"handing the manifest of {run}@{step} to every host", exc,
            "the checkpoint is committed; each host gets its manifest from the catalog when "
            "it first needs it",
        ) from exc
    return ck


def _share_manifest(store: StoreCore, writer: ZarrStorageWriter,
                    group: Any) -> tuple[Checkpoint, Manifest]:
    """Broadcast the committed manifest from the coordinator; each host's lowest rank writes
    it, with the shared documents and the marker, into its host's part."""
    src = dist.get_global_rank(group, 0) if group is not None else 0
    # The committed record rides along: thousands of ranks need not each ask the catalog.
    payload: list[Any] = [
        (writer.manifest_data, writer.checkpoint) if writer.is_coordinator else None
    ]
    dist.broadcast_object_list(payload, src=src, group=group)
    sent = payload[0]
    if not (isinstance(sent, tuple) and len(sent) == 2 and isinstance(sent[0], bytes)
            and isinstance(sent[1], Checkpoint)):
        raise IncompleteCheckpointError(
            f"the coordinator sent no manifest for checkpoint {writer.ckpt_id}")
    data, ck = sent
    if ck.id != writer.ckpt_id:
        raise IntegrityError(
            f"the coordinator sent checkpoint {ck.id}, this rank wrote {writer.ckpt_id}")
    digest = blake3.blake3(data).hexdigest()
    if digest != ck.manifest_digest:
        raise IntegrityError(
            f"the manifest broadcast for {ck.ref} has digest {digest}, the catalog records "
            f"{ck.manifest_digest}"
        )
    manifest = parse_verified(data, digest)
    part = writer.part
    if part is not None and part.leader:
        # Off the training path: every part is durable and the catalog holds the manifest;
        # the next save and store.close() wait for it.
        peers_for(store).start("manifest", lambda: materialize(store, ck, data=data))
    return ck, manifest


def _save_replicated(store: StoreCore, run: str, step: int, state: Any, group: Any,
                     options: SaveOptions) -> Checkpoint:
    rank = dist.get_rank(group)
    src = dist.get_global_rank(group, 0) if group is not None else 0
    payload: list[Any] = [None]
    failure: BaseException | None = None
    if rank == 0:
        try:
            payload = [("ok", save_checkpoint(store, run, step, state, options).id)]
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
    source: ChunkSource | None = None,
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
        source: Where the chunks come from (default: ``directory``).

    Returns:
        The state (``into`` itself when given).

    Raises:
        InvalidNameError: If ``keys`` is combined with ``into``, or a key matches nothing.
        IntegrityError: On damaged chunks.
        CkptError: If DCP fails on any rank (the class is the cause's where it is ours).
    """
    if into is None:
        return load_full(directory, manifest, keys=keys, threads=threads, source=source)
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

    # Several ranks loading a checkpoint saved across hosts share the downloads of the parts
    # no local disk holds (a node-loss restore): the lost part comes down at the bandwidth
    # of every node, not only the replacement's.
    share = (isinstance(source, PartsSource) and _dist_on()
             and dist.get_world_size(process_group) > 1)
    reader = ZarrStorageReader(directory, manifest, threads=threads, source=source,
                               share=share, share_group=process_group)
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


def load_parted(
    store: StoreCore,
    ck: Checkpoint,
    *,
    keys: Sequence[str] | None = None,
    into: Any | None = None,
    process_group: Any = None,
) -> Any:
    """Load a checkpoint saved across hosts, on any number of ranks and hosts.

    Each rank reads the chunks it needs from the best copy of their part this host reaches:
    this host's own part (or a neighbour's part it keeps) when present and intact, else the
    shared tiers (warm, cold, or a hot tier in object storage), chunk by chunk. A part that
    exists nowhere raises naming the host and the tensors; nothing reads as zeros.

    Raises:
        IncompleteCheckpointError: If a part needed has no copy this host can read.
        IntegrityError: If every copy of a needed chunk is damaged.
    """
    from ckptstore.ops.tiering.restore import unseal_parts_here

    # A part readable nowhere in the clear is decrypted from a sealed copy first.
    manifest, source = parts_source(store, ck, thaw=thawed_source, unseal=unseal_parts_here)
    if into is None:
        missing = source.missing()
        if missing:
            about = "; ".join(
                f"host {h}: {', '.join(items[:5])}{' ...' if len(items) > 5 else ''}"
                for h, items in missing.items()
            )
            raise IncompleteCheckpointError(
                f"checkpoint {ck.ref} ({ck.id}) cannot be loaded here: the parts of "
                f"{', '.join(missing)} exist on no tier this host can read ({about}); bring "
                "those hosts back or archive their parts (`ckpt archive` on them)"
            )
    threads = store.settings.threads
    if source.remote:
        threads = max(threads, REMOTE_READ_THREADS)
    return load_dcp(source.directory, manifest, keys=keys, into=into, threads=threads,
                    process_group=process_group, source=source)
