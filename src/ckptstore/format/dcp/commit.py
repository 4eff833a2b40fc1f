"""The coordinator's commit of a DCP save: index, group documents, manifest, marker.

Runs in ``StorageWriter.finish`` — DCP calls it on the coordinator only, and only after
every rank's ``write_data`` returned (each rank fsynced its files before returning). The
order is the format's: group ``zarr.json`` documents → ``manifest.json`` (holding the index,
so the manifest digest covers it) → directories fsynced → ``COMMITTED`` marker (written
under a temporary name, then hard-linked: never partial, never overwritten). The caller
then flips the catalog row to COMMITTED.

The pieces are separate for saves across hosts: :func:`build_manifest` (pure), and
:func:`write_shared`, which every host that holds a part runs on its own directory with the
same manifest bytes (the coordinator at the commit, the others when they materialise their
part's copy; ``zarrdocs.shared_docs`` regenerates the root and group documents from the manifest).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.storage import WriteResult

from ckptstore.durable import fsync_dir, replace_file, storage_error, write_new_file
from ckptstore.errors import CkptError, IntegrityError
from ckptstore.format import FORMAT_VERSION, Manifest, flatten_state
from ckptstore.format.constants import (
    COMMIT_NAME,
    DCP_ARRAY_GROUP,
    DCP_PACK_GROUP,
    DCP_RANK_GROUP,
    MANIFEST_NAME,
    ZARR_JSON,
)
from ckptstore.format.dcp.layout import (
    ArrayInfo,
    BlobItem,
    DcpIndex,
    Piece,
    TensorItem,
)
from ckptstore.format.dcp.plan import ArraySpec, item_dtype_name
from ckptstore.format.dcp.write import FSYNC_THREADS, Stored
from ckptstore.format.dcp.zarrdocs import dcp_documents, group_doc, shared_docs
from ckptstore.format.manifest import FileEntry
from ckptstore.format.marker import write_marker
from ckptstore.format.zarrmeta import digest

__all__ = ["build_index", "build_manifest", "commit_files", "write_shared"]

logger = logging.getLogger(__name__)

def _planner_data(raw: Any) -> dict[str, tuple[str | int, ...]] | None:
    """DCP's flatten mapping if it is the plain ``{fqn: (key, index, ...)}`` kind, else None."""
    if not isinstance(raw, Mapping):
        return None
    out: dict[str, tuple[str | int, ...]] = {}
    for fqn, parts in raw.items():
        if not isinstance(fqn, str) or not isinstance(parts, Sequence) or isinstance(parts, str):
            return None
        clean: list[str | int] = []
        for part in parts:
            if isinstance(part, bool) or not isinstance(part, str | int):
                return None
            clean.append(part)
        out[fqn] = tuple(clean)
    return out


def build_index(
    metadata: Metadata,
    results: list[list[WriteResult]],
    specs: Mapping[str, ArraySpec],
    codec: str,
) -> tuple[DcpIndex, list[tuple[str, int]]]:
    """Assemble the index from DCP's global metadata and every rank's write results.

    Returns:
        The index, and ``(path, size)`` of every array ``zarr.json`` the ranks wrote.

    Raises:
        CkptError: If a result is not ours or an item has no result (a bug, or a planner
            that changed the plan after ``prepare_global_plan``).
    """
    arrays: dict[str, ArrayInfo] = {
        s.path: ArrayInfo(s.path, s.dtype, s.shape, s.chunk_shape, {}) for s in specs.values()
    }
    pieces: dict[str, list[Piece]] = {}
    blobs: dict[str, BlobItem] = {}
    meta_files: list[tuple[str, int]] = []
    for rank_results in results:
        for result in rank_results:
            stored = result.storage_data
            if not isinstance(stored, Stored):
                raise CkptError(
                    f"write result for {result.index.fqn!r} did not come from ZarrStorageWriter; "
                    "use the same storage writer on every rank"
                )
            if stored.report is not None:
                for pack in stored.report.packs:
                    arrays[pack.path] = pack
                meta_files.extend(stored.report.meta_files)
            if stored.piece is not None:
                pieces.setdefault(result.index.fqn, []).append(stored.piece)
                if stored.piece.origin is not None:
                    arrays[stored.piece.array].chunks.update(stored.chunks)
            if stored.blob is not None:
                blobs[stored.blob.fqn] = stored.blob
    tensors: dict[str, TensorItem] = {}
    for fqn, md in metadata.state_dict_metadata.items():
        if isinstance(md, TensorStorageMetadata):
            found = sorted(pieces.get(fqn, []), key=lambda p: p.offsets)
            tensors[fqn] = TensorItem(
                fqn, item_dtype_name(md.properties.dtype, fqn), tuple(md.size),
                bool(md.properties.requires_grad), tuple(found),
            )
        elif fqn not in blobs:
            raise CkptError(f"non-tensor item {fqn!r} has no write result; nothing was committed")
    planner_data = _planner_data(metadata.planner_data)
    if metadata.planner_data is not None and planner_data is None:
        logger.warning("the save planner's planner_data is not a flatten mapping; not stored")
    index = DcpIndex(
        world_size=len(results),
        codec=codec,
        arrays=arrays,
        tensors=tensors,
        blobs=blobs,
        planner_data=planner_data,
        dcp_version=metadata.version if isinstance(metadata.version, str) else None,
    )
    return index, meta_files


def build_manifest(
    *,
    ckpt_id: str,
    run: str,
    step: int,
    chunk_bytes: int,
    index: DcpIndex,
    meta_files: list[tuple[str, int]],
) -> Manifest:
    """The manifest of a DCP save (pure: nothing is written).

    Raises:
        IntegrityError: If the assembled index is inconsistent (a rank's shards missing).
    """
    try:
        # The reader's checks, before anything is published.
        DcpIndex.from_json(index.to_json(), index.tensor_entries())
    except IntegrityError as exc:
        raise IntegrityError(f"refusing to commit checkpoint {ckpt_id}: {exc}") from None
    groups = [f"{DCP_ARRAY_GROUP}/{ZARR_JSON}", f"{DCP_PACK_GROUP}/{ZARR_JSON}"]
    if any(path.startswith(DCP_RANK_GROUP + "/") for path in index.arrays):
        groups.append(f"{DCP_RANK_GROUP}/{ZARR_JSON}")
    # Every file the checkpoint owns beyond the root documents, data files first: tier
    # copies, verify and bundles go by this list (Manifest.files).
    files = [FileEntry(p, n, c) for p, n, c in index.files()]
    files += [FileEntry(p, n, None) for p, n in sorted(meta_files)]
    files += [FileEntry(p, len(group_doc()), None) for p in groups]
    return Manifest(
        format_version=FORMAT_VERSION,
        id=ckpt_id,
        run=run,
        step=step,
        created_at=datetime.now(UTC).isoformat(),
        kind="full",
        base_id=None,
        codec=index.codec,
        chunk_bytes=chunk_bytes,
        arrays={},
        tensors={},
        tree=flatten_state({}).tree,
        logical_bytes=index.logical_bytes,
        stored_bytes=index.stored_bytes,
        dcp=index,
        files=tuple(files),
        # Every zarr.json under the manifest's digests: the ranks wrote the array and rank
        # group documents with the same functions (format/dcp/zarrdocs.py).
        metadata={rel: digest(doc) for rel, doc in dcp_documents(ckpt_id, index).items()},
    )


def _put_doc(path: Path, data: bytes, exist_ok: bool) -> None:
    if exist_ok:
        try:
            if path.read_bytes() == data:
                return  # an earlier materialisation of the same part got this far
        except FileNotFoundError:
            pass
        except OSError as exc:
            raise storage_error(path, "read", exc) from exc
        replace_file(path, data)
        return
    write_new_file(path, data)


def write_shared(
    directory: Path,
    manifest: Manifest,
    data: bytes,
    *,
    fault: Any = None,
    exist_ok: bool = False,
) -> None:
    """Write the shared documents, ``manifest.json`` (``data``) and the marker into
    ``directory``, in the format's order; everything else in it must already be durable.

    Args:
        directory: The checkpoint directory (on one host: that host's part).
        manifest: The manifest.
        data: Its bytes (``manifest.to_json()``; a host materialising its part passes the
            bytes it got from the catalog, already checked against the digest).
        fault: Called with ``"dcp.manifest_written"`` before the marker (crash tests).
        exist_ok: Files already there with the same bytes are kept, others replaced (a
            host materialising its part again after an interrupted attempt). The marker is
            never replaced: once there, it holds this digest.

    Raises:
        StorageError: On OS errors; the marker is then not written.
    """
    docs = shared_docs(manifest)
    for group in (DCP_ARRAY_GROUP, DCP_PACK_GROUP, DCP_RANK_GROUP):
        if f"{group}/{ZARR_JSON}" in docs:
            try:
                (directory / group).mkdir(exist_ok=True)
            except OSError as exc:
                raise storage_error(directory / group, "create directory", exc) from exc
    with ThreadPoolExecutor(FSYNC_THREADS, thread_name_prefix="ckpt-dcp-commit") as pool:
        list(pool.map(lambda kv: _put_doc(directory / kv[0], kv[1], exist_ok), docs.items()))
    _put_doc(directory / MANIFEST_NAME, data, exist_ok)
    for group in (DCP_ARRAY_GROUP, DCP_PACK_GROUP, DCP_RANK_GROUP):
        if f"{group}/{ZARR_JSON}" in docs:
            fsync_dir(directory / group)
    fsync_dir(directory)
    fsync_dir(directory.parent)
    if fault is not None:
        fault("dcp.manifest_written")
    if exist_ok and (directory / COMMIT_NAME).is_file():
        return
    write_marker(directory, manifest.digest)


def commit_files(
    directory: Path,
    *,
    ckpt_id: str,
    run: str,
    step: int,
    chunk_bytes: int,
    index: DcpIndex,
    meta_files: list[tuple[str, int]],
    fault: Any = None,
) -> Manifest:
    """Write the group documents, the manifest and the commit marker.

    Args:
        directory: The checkpoint directory.
        ckpt_id: Its id.
        run: Run name.
        step: Training step.
        chunk_bytes: Chunk size target of the save (recorded in the manifest).
        index: The DCP index.
        meta_files: Array ``zarr.json`` files the ranks wrote.
        fault: Called with ``"dcp.manifest_written"`` before the marker (crash tests).

    Returns:
        The committed manifest.

    Raises:
        IntegrityError: If the assembled index is inconsistent (a rank's shards missing);
            nothing is committed.
        StorageError: On OS errors; nothing is committed.
    """
    manifest = build_manifest(ckpt_id=ckpt_id, run=run, step=step, chunk_bytes=chunk_bytes,
                              index=index, meta_files=meta_files)
    write_shared(directory, manifest, manifest.to_json(), fault=fault)
    return manifest
