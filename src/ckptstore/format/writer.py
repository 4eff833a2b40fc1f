"""Write one checkpoint directory: chunk files, zarr metadata, manifest, commit marker.

This module is the save transaction of the packed layout: it checks the arguments,
takes the flattened state (flattening it only if the caller has not), plans the arrays,
has :class:`~ckptstore.format.chunkwriter.ChunkWriter` write the chunks, then writes the
metadata and the manifest and commits. The state's tensors are read from their own memory,
or, for a :class:`~ckptstore.format.sources.StreamedState`, produced chunk by chunk by its
source.

Durability order: chunks (fsynced) -> array/group ``zarr.json``, ``manifest.json`` and the
directories (flushed together) -> ``COMMITTED``. A directory without ``COMMITTED`` is garbage
for ``ckpt gc``; nothing here ever removes files, and a failed save never leaves a marker.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import sys
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ckptstore.durable import fsync_many, storage_error, write_new_file
from ckptstore.errors import CkptError, InvalidNameError, UnsafeObjectError
from ckptstore.format.basecache import KeyframeCache
from ckptstore.format.casts import find_casts
from ckptstore.format.chunkwriter import ChunkWriter, ErrorStats
from ckptstore.format.codecs import (
    AUTO,
    AUTO_SAMPLE_BYTES,
    CodecSpec,
    auto_codec,
    auto_samples,
    check_codec_setting,
    codec_spec,
)
from ckptstore.format.constants import (
    CAST_FORMAT_VERSION,
    CHUNK_DIR,
    DEFAULT_CHUNK_BYTES,
    FORMAT_VERSION,
    MANIFEST_NAME,
    MAX_CHUNK_BYTES,
    MIN_CHUNK_BYTES,
    PER_TENSOR_MIN_BYTES,
)
from ckptstore.format.delta import DeltaSpec
from ckptstore.format.dtypes import dtype_info
from ckptstore.format.flatten import as_flat
from ckptstore.format.gcpause import without_gc
from ckptstore.format.layout import ArrayPlan, chunk_span, plan_layout
from ckptstore.format.manifest import (
    FORMAT_KEYS,
    ArrayEntry,
    BaseRef,
    ChunkEntry,
    DeltaInfo,
    Manifest,
    TensorEntry,
    is_checkpoint_id,
    manifest_digest,
    remember_manifest,
)
from ckptstore.format.marker import write_marker
from ckptstore.format.sources import ByteBuffer, MemorySource, StreamedState, TensorSource
from ckptstore.format.zarrmeta import ArrayMeta, build_metadata, document_variants

__all__ = ["PHASES", "write_checkpoint"]

logger = logging.getLogger(__name__)

#: Names passed to ``fault_point``, in order.
PHASES = ("chunks_started", "chunks_written", "metadata_written", "manifest_written", "committed")


@without_gc
def write_checkpoint(
    directory: Path,
    state: Any,
    *,
    ckpt_id: str,
    run: str,
    step: int,
    codec: str = "auto",
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    threads: int = 2,
    base: BaseRef | None = None,
    delta: DeltaSpec | None = None,
    depth: int = 0,
    extra: dict[str, Any] | None = None,
    fault_point: Callable[[str], None] | None = None,
    progress: Callable[[int], None] | None = None,
    base_cache: KeyframeCache | None = None,
) -> Manifest:
    """Write ``state`` as a committed checkpoint in ``directory``.

    Args:
        directory: Checkpoint directory; created (with parents) if absent, must be empty if
            present. Nothing in it is ever overwritten.
        state: The state (see :mod:`ckptstore.format.flatten` for what it may hold), the
            :class:`~ckptstore.format.flatten.FlatState` a caller already made of it, or a
            :class:`~ckptstore.format.sources.StreamedState` whose source produces the
            tensors' bytes as their chunks are written.
        ckpt_id: The checkpoint's uuid (canonical lower-case form).
        run: Run name, recorded in the manifest.
        step: Training step, recorded in the manifest.
        codec: One of :data:`~ckptstore.format.codecs.CODEC_PRESETS`: ``auto`` chooses per
            array (:func:`~ckptstore.format.codecs.auto_codec`), keeping the base's choice
            for an array the base has.
        chunk_bytes: Target chunk size in bytes.
        threads: Writer threads (one chunk per task); a streamed state may ask for more.
        base: Committed checkpoint to deduplicate against: a chunk with the same array,
            index, chunk length, codec and blake3 as the base's (raw) chunk is not written but
            referenced (``src``). With an xor or lossy ``delta``, the base is the keyframe and
            changed chunks are stored encoded against its chunks (see
            :mod:`ckptstore.format.delta`). The chunk files referenced must outlive this
            checkpoint.
        delta: The delta mode (None: dedup against ``base`` only, no delta record). A lossy
            mode packs the tensors its scope selects into ``<dtype>_lossy`` arrays, so its
            keyframes must be written with the same spec.
        depth: Position in the keyframe's chain (recorded in the manifest's ``delta``).
        extra: Free JSON metadata stored in the manifest (NaN allowed; keys become str).
        fault_point: Test hook called with each name in :data:`PHASES` as that phase ends.
        progress: Called from the calling thread with the logical bytes of each finished
            chunk.
        base_cache: Keyframe chunks kept in memory: a keyframe (an xor/lossy ``delta``
            without ``base``) copies its chunks into it, and a delta against the cached
            keyframe takes its base chunks from it instead of reading them back.

    Returns:
        The committed manifest.

    Raises:
        StorageError: On any OS error (path and cause included; ``COMMITTED`` not written).
        UnsafeObjectError: If the state holds an object that would need pickle.
        InvalidNameError: On a bad id, run, step, codec, chunk size or thread count.
    """
    started = time.perf_counter()
    directory = Path(directory)
    _check_args(ckpt_id, run, step, codec, chunk_bytes, threads, base, depth)
    if sys.byteorder != "little":
        raise CkptError("the checkpoint format stores little-endian bytes; this host is not")
    extra_doc = _normalise_extra(extra)
    if isinstance(state, StreamedState):
        flat = state.flat()
        threads = max(threads, state.threads)
    else:
        flat = as_flat(state)
    scope = delta.scope if delta is not None and delta.lossy else None
    # Narrow tensors that are exactly a wide one rounded (mixed precision's bf16 weights)
    # are stored as casts of its elements. Never against a lossily stored tensor, and not
    # for a streamed state, whose bytes exist only as its chunks are written.
    casts = (find_casts(flat.tensors)
             if scope is None and not isinstance(state, StreamedState) else {})
    stored = ({k: t for k, t in flat.tensors.items() if k not in casts} if casts
              else flat.tensors)
    plans = plan_layout(
        stored, chunk_bytes, lossy_scope=scope,
        per_tensor_bytes=PER_TENSOR_MIN_BYTES,
    )
    sources: TensorSource = (
        state.source if isinstance(state, StreamedState) else MemorySource(
            {key: _byte_view(t) for key, t in stored.items()},
            {key: t.element_size() for key, t in stored.items()},
        )
    )
    version = CAST_FORMAT_VERSION if casts else FORMAT_VERSION
    specs = {name: _array_codec(codec, plan, sources, base) for name, plan in plans.items()}
    docs: dict[str, bytes] = {}

    def make_documents() -> None:
        # Built while the pool writes the chunks: in a fresh process the first call costs
        # ~80 ms (zarr's import and event loop), ~10 % of a GPT-2-small save.
        docs.update(build_metadata(
            ckpt_id,
            [
                ArrayMeta(p.name, p.length, p.chunk_len, p.info, specs[p.name], p.tensor,
                          p.members[0].shape if p.tensor is not None else None)
                for p in plans.values()
            ],
            version,
        ))

    def fault(name: str) -> None:
        if fault_point is not None:
            fault_point(name)

    _make_dirs(directory, plans)
    fault("chunks_started")
    chunk_writer = ChunkWriter(directory, specs, sources, plans, base, delta,
                                ckpt_id=ckpt_id, cache=base_cache)
    chunks, stored_bytes = chunk_writer.run(threads, progress, meanwhile=make_documents)
    fault("chunks_written")

    # The documents as this copy needs them: an array with delta-encoded chunks, or with
    # chunks only referenced (not linked here), declares a codec plain readers refuse.
    on_disk, metadata, metadata_ref = document_variants(
        ckpt_id, docs, chunks, chunk_writer.incomplete
    )
    # Flushed below, all at once with the manifest and the directories: one by one, the
    # flushes of ~150 small documents cost as much as writing 300 MB of chunks.
    for rel, data in on_disk.items():
        write_new_file(directory / rel, data, sync=False)
    fault("metadata_written")

    manifest = _build_manifest(
        version,
        flat.tensors,
        casts,
        flat.tree,
        plans,
        chunks,
        chunk_bytes,
        stored_bytes,
        ckpt_id=ckpt_id,
        run=run,
        step=step,
        base=base,
        extra=extra_doc,
        delta=_delta_info(delta, depth, chunk_writer.errors),
        codec=codec,
        specs=specs,
        metadata=metadata,
        metadata_ref=metadata_ref,
    )
    manifest_bytes = manifest.to_json()
    write_new_file(directory / MANIFEST_NAME, manifest_bytes, sync=False)
    dirs = [d for plan in plans.values()
            for d in (directory / plan.name / CHUNK_DIR, directory / plan.name)]
    dirs += [directory / g for g in {p.name.rpartition("/")[0] for p in plans.values()} - {""}]
    fsync_many([directory / rel for rel in on_disk] + [directory / MANIFEST_NAME],
               [*dirs, directory, directory.parent])
    fault("manifest_written")

    digest = manifest_digest(manifest_bytes)
    write_marker(directory, digest)
    # The next save's base lookup and a load of this checkpoint read these same bytes.
    remember_manifest(manifest, digest)
    logger.info(
        "wrote checkpoint %s (%s step %s): %d tensors, %d logical bytes, %d stored, %.3fs",
        ckpt_id,
        run,
        step,
        len(manifest.tensors),
        manifest.logical_bytes,
        stored_bytes,
        time.perf_counter() - started,
    )
    fault("committed")
    return manifest


def _check_args(
    ckpt_id: str,
    run: str,
    step: int,
    codec: str,
    chunk_bytes: int,
    threads: int,
    base: BaseRef | None,
    depth: int,
) -> None:
    if not is_checkpoint_id(ckpt_id):
        raise InvalidNameError(f"checkpoint id {ckpt_id!r} must be a lower-case uuid string")
    if not isinstance(run, str) or not run or len(run) > 1024:
        raise InvalidNameError("run must be a non-empty string of at most 1024 characters")
    if not isinstance(step, int) or isinstance(step, bool) or not -(2**63) <= step < 2**63:
        raise InvalidNameError(f"step must be a 64-bit int, got {step!r}")
    if not isinstance(chunk_bytes, int) or not MIN_CHUNK_BYTES <= chunk_bytes <= MAX_CHUNK_BYTES:
        raise InvalidNameError(
            f"chunk_bytes must be between {MIN_CHUNK_BYTES} and {MAX_CHUNK_BYTES}"
        )
    if not isinstance(threads, int) or threads < 1:
        raise InvalidNameError(f"threads must be a positive int, got {threads!r}")
    if base is not None and base.manifest.id == ckpt_id:
        raise InvalidNameError("a checkpoint cannot be its own base")
    if not isinstance(depth, int) or depth < 0:
        raise InvalidNameError(f"depth must be a non-negative int, got {depth!r}")
    try:
        check_codec_setting(codec)
    except ValueError as exc:
        raise InvalidNameError(str(exc)) from None


def _array_codec(
    codec: str,
    plan: ArrayPlan,
    sources: TensorSource,
    base: BaseRef | None,
) -> CodecSpec:
    """The codec an array's chunks are stored with (``auto`` resolved for this array)."""
    if codec != AUTO:
        return codec_spec(codec)
    old = base.manifest.arrays.get(plan.name) if base is not None else None
    if old is not None and old.torch_dtype == plan.info.name:
        return codec_spec(old.codec)  # the base's choice, so unchanged chunks compare equal
    isz = plan.info.itemsize
    is_float = plan.info.torch_dtype.is_floating_point
    if not auto_samples(isz, is_float):
        # Decided by the dtype alone: a streamed source need not produce a sample.
        return codec_spec(auto_codec(isz, is_float, b""))
    ranges = []
    need = AUTO_SAMPLE_BYTES // isz
    for member in plan.members:
        if need <= 0:
            break
        take = min(member.numel, need)
        if take:
            ranges.append((member.key, 0, take))
        need -= take
    sample: list[ByteBuffer] = sources.read(ranges) if ranges else []
    joined = np.concatenate(sample) if len(sample) > 1 else (sample[0] if sample else b"")
    return codec_spec(auto_codec(isz, is_float, joined))


def _normalise_extra(extra: dict[str, Any] | None) -> dict[str, Any]:
    if extra is None:
        return {}
    if not isinstance(extra, dict):
        raise UnsafeObjectError(f"extra must be a dict, got {type(extra).__name__}")
    try:
        # A JSON round trip gives exactly what from_json will return (str keys, lists).
        doc = json.loads(json.dumps(extra))
    except (TypeError, ValueError) as exc:
        raise UnsafeObjectError(f"extra must be JSON-serialisable: {exc}") from exc
    assert isinstance(doc, dict)
    taken = [key for key in FORMAT_KEYS if doc.get(key)]
    if taken:
        # The format keeps its own data under these keys of manifest.json's "extra": a
        # caller's value there would be read back as (broken) format data.
        raise InvalidNameError(
            f"extra keys {taken} are reserved for the checkpoint format; use other names"
        )
    return doc


def _byte_view(tensor: torch.Tensor) -> np.ndarray[Any, np.dtype[np.uint8]]:
    """Bytes of a tensor's own elements, without copying when it is a contiguous CPU tensor.

    A non-contiguous view costs a copy of only its own elements, never of its storage.
    """
    t = tensor.detach()
    if t.device.type != "cpu":
        t = t.to("cpu")
    if t.is_conj():
        t = t.resolve_conj()
    if t.is_neg():
        t = t.resolve_neg()
    if not t.is_contiguous():
        t = t.contiguous()
    view: np.ndarray[Any, np.dtype[np.uint8]] = t.reshape(-1).view(torch.uint8).numpy()
    return view


def _make_dirs(directory: Path, plans: dict[str, ArrayPlan]) -> None:
    try:
        if directory.exists():
            if any(directory.iterdir()):
                raise FileExistsError(17, "directory is not empty")
        else:
            directory.mkdir(parents=True)
    except OSError as exc:
        raise storage_error(directory, "create checkpoint directory", exc) from exc
    # Parents first, each made once: ``mkdir(parents=True)`` per array would first fail on
    # the missing parent (one more system call per array, ~200 arrays per save).
    needed: dict[str, None] = {}
    for plan in plans.values():
        parts = [*plan.name.split("/"), CHUNK_DIR]
        needed.update(("/".join(parts[:i]), None) for i in range(1, len(parts) + 1))
    for rel in needed:
        path = directory / rel
        try:
            path.mkdir()
        except OSError as exc:
            raise storage_error(path, "create directory", exc) from exc


def _build_manifest(
    version: int,
    tensors: dict[str, torch.Tensor],
    casts: dict[str, str],
    tree: Any,
    plans: dict[str, ArrayPlan],
    chunks: dict[str, list[ChunkEntry]],
    chunk_bytes: int,
    stored_bytes: int,
    *,
    ckpt_id: str,
    run: str,
    step: int,
    base: BaseRef | None,
    extra: dict[str, Any],
    delta: DeltaInfo | None,
    codec: str,
    specs: dict[str, CodecSpec],
    metadata: dict[str, str],
    metadata_ref: dict[str, str],
) -> Manifest:
    arrays = {
        name: ArrayEntry(
            name=name,
            torch_dtype=plan.info.name,
            zarr_dtype=plan.info.zarr_dtype,
            itemsize=plan.info.itemsize,
            length=plan.length,
            chunk_len=plan.chunk_len,
            codec=specs[name].name,
            chunks=tuple(chunks[name]),
        )
        for name, plan in plans.items()
    }
    placements = {m.key: m for plan in plans.values() for m in plan.members}
    entries: dict[str, TensorEntry] = {}
    cast_bytes = 0
    for key, tensor in tensors.items():
        wide = casts.get(key)
        place = placements[key if wide is None else wide]
        chunk_len = plans[place.array].chunk_len
        start, stop = chunk_span(place.offset, place.numel, chunk_len)
        dtype = plans[place.array].info.name
        if wide is not None:
            info = dtype_info(tensor.dtype)
            assert info is not None  # find_casts keeps float16 and bfloat16 only
            dtype = info.name
            cast_bytes += tensor.numel() * tensor.element_size()
        entries[key] = TensorEntry(
            key,
            place.array,
            place.offset,
            place.numel,
            place.shape,
            dtype,
            start,
            stop,
            wide is not None,
        )
    referenced = any(
        o is not None for a in arrays.values() for c in a.chunks for o in c.owners()
    )
    if delta is not None and not referenced and delta.depth:
        # Nothing ended up relative to the keyframe: this checkpoint is a keyframe itself.
        delta = dataclasses.replace(delta, depth=0)
    return Manifest(
        format_version=version,
        id=ckpt_id,
        run=run,
        step=step,
        created_at=datetime.now(UTC).isoformat(),
        kind="delta" if referenced else "full",
        base_id=base.manifest.id if (referenced and base is not None) else None,
        codec=codec,
        chunk_bytes=chunk_bytes,
        arrays=arrays,
        tensors=entries,
        tree=tree,
        logical_bytes=sum(p.length * p.info.itemsize for p in plans.values()) + cast_bytes,
        stored_bytes=stored_bytes,
        extra=extra,
        delta=delta,
        metadata=metadata,
        metadata_ref=metadata_ref,
    )


def _delta_info(
    spec: DeltaSpec | None,
    depth: int,
    errors: ErrorStats,
) -> DeltaInfo | None:
    if spec is None:
        return None
    lossy = errors.elements > 0
    return DeltaInfo(
        mode=spec.mode,
        depth=depth if spec.chained else 0,
        lossy=lossy,
        scope=spec.scope if spec.lossy else (),
        threshold=spec.threshold if spec.lossy else None,
        quantize=spec.quantize if spec.lossy else None,
        block=spec.block if spec.lossy and spec.quantize else None,
        max_abs_error=errors.max_abs,
        mean_abs_error=errors.sum_abs / errors.elements if lossy else 0.0,
        lossy_elements=errors.elements,
    )
