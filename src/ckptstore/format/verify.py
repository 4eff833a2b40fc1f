"""Check a checkpoint's files against its manifest, and list the files it owns."""

from __future__ import annotations

import logging
import os
import stat
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path

import blake3

from ckptstore.errors import IntegrityError, MissingBaseError, StorageError
from ckptstore.format.chunkio import ChunkReader, Locate
from ckptstore.format.constants import COMMIT_NAME, MANIFEST_NAME
from ckptstore.format.filecheck import check_file, not_regular
from ckptstore.format.manifest import ArrayEntry, Manifest
from ckptstore.format.zarrcheck import check_zarr_metadata
from ckptstore.numeric import counted

__all__ = ["check_chunk", "chunk_files", "verify_checkpoint"]

logger = logging.getLogger(__name__)

_VERIFY_THREADS = 2


def chunk_files(manifest: Manifest) -> list[str]:
    """Relative paths of every file this checkpoint owns, in a safe copy order.

    Chunks it wrote come first, then the array and group ``zarr.json``, then
    ``manifest.json``, then ``COMMITTED`` last: copying in this order (or deleting in the
    reverse order) never leaves a marked but incomplete checkpoint. Chunks held by other
    checkpoints (``src`` set) are not listed.
    """
    files = [
        array.chunk_path(chunk.i)
        for array in manifest.arrays.values()
        for chunk in array.chunks
        if chunk.src is None
    ]
    files += [entry.path for entry in manifest.files]
    # Array documents first, then subgroups, the root group last.
    files += list(reversed(manifest.metadata_files()))
    files += [MANIFEST_NAME, COMMIT_NAME]
    return files


def _label(manifest: Manifest, array: ArrayEntry, index: int) -> str:
    keys = manifest.tensors_in_chunk(array.name, index)
    shown = ", ".join(keys[:3]) + (f" (+{len(keys) - 3} more)" if len(keys) > 3 else "")
    return f"tensor {shown or '-'} chunk {array.chunk_path(index)}"


def verify_checkpoint(
    directory: Path,
    manifest: Manifest,
    *,
    locate: Locate | None = None,
    deep: bool = True,
    metadata: bool = True,
    committed: bool = True,
) -> list[str]:
    """Check that every file the checkpoint needs is present and intact.

    Args:
        directory: The checkpoint directory.
        manifest: Its manifest.
        locate: Finds base checkpoints' directories (for delta chunks).
        deep: Read every chunk and check its crc32c and blake3; otherwise only check that
            files exist with the recorded sizes.
        metadata: Also check every ``zarr.json`` against the manifest (False: a caller that
            reports metadata problems apart, like doctor).
        committed: Also require the commit marker (False: a copy checked before its marker
            is written, such as an import in progress).

    Returns:
        One line per problem, e.g. ``"tensor model/w chunk float32/c/3: crc32c mismatch"``;
        empty when the checkpoint is fine.
    """
    directory = Path(directory)
    problems: list[str] = []
    for rel in [*manifest.metadata_files(), MANIFEST_NAME, *([COMMIT_NAME] if committed else [])]:
        problem = not_regular(directory / rel)
        if problem is not None:
            problems.append(f"{rel}: {problem}")
    # Every zarr.json is under the manifest's digests (or rebuilt from it, version 1): a
    # plain Zarr reader trusts these documents, so an edited one is damage too.
    if metadata:
        problems += [p for p in check_zarr_metadata(directory, manifest)
                     if not p.endswith(": missing")]
    reader = ChunkReader(directory, manifest, locate)
    jobs = [(array, chunk.i) for array in manifest.arrays.values() for chunk in array.chunks]

    def check(job: tuple[ArrayEntry, int]) -> str | None:
        array, index = job
        try:
            return _check_chunk(reader, array, index, deep)
        except (IntegrityError, StorageError) as exc:
            # MissingBaseError is an IntegrityError too.
            return f"{_label(manifest, array, index)}: {exc}"

    with ThreadPoolExecutor(_VERIFY_THREADS, thread_name_prefix="ckpt-verify") as pool:
        problems += [p for p in pool.map(check, jobs) if p is not None]
        checker = partial(check_file, directory, deep)
        problems += [p for p in pool.map(checker, manifest.files) if p is not None]
    if problems:
        # For the log only: every caller reports (or raises on) the problems it gets back.
        logger.info("checkpoint %s at %s has %s: %s", manifest.id, directory,
                       counted(len(problems), "problem"), _problem_summary(problems))
    return problems


def check_chunk(reader: ChunkReader, array: ArrayEntry, index: int) -> str | None:
    """Deep-check one chunk as :func:`verify_checkpoint` (``deep``) does every chunk: read,
    crc32c, decode, blake3 against the manifest. For a caller that checks chunks one by one
    as they arrive (a progressive load from an encrypted tier).

    Returns:
        The problem, or None when the chunk is intact.
    """
    try:
        return _check_chunk(reader, array, index, True)
    except (IntegrityError, StorageError) as exc:
        return f"{_label(reader.manifest, array, index)}: {exc}"


def _problem_summary(problems: list[str], limit: int = 3) -> str:
    """The first ``limit`` problems, and how many more there are."""
    more = len(problems) - limit
    return "; ".join(problems[:limit]) + (f" (+{more} more)" if more > 0 else "")


def _check_chunk(reader: ChunkReader, array: ArrayEntry, index: int, deep: bool) -> str | None:
    chunk = array.chunks[index]
    label = _label(reader.manifest, array, index)
    try:
        path = reader.chunk_path(array, chunk)
    except MissingBaseError as exc:
        return f"{label}: {exc}"
    if not deep:
        try:
            # lstat: the deep read refuses a symlinked chunk file (O_NOFOLLOW); so does this.
            st = os.lstat(path)
        except FileNotFoundError:
            return f"{label}: missing ({path})"
        except OSError as exc:
            return f"{label}: cannot stat {path}: {exc}"
        if stat.S_ISLNK(st.st_mode):
            return f"{label}: is a symlink ({path})"
        if not stat.S_ISREG(st.st_mode):
            return f"{label}: is not a regular file ({path})"
        size = st.st_size
        if size != chunk.nbytes:
            return f"{label}: is {size} bytes, expected {chunk.nbytes}"
        return None
    # "verify" is a name read() never uses, so the buffer cannot alias its own scratch.
    raw = reader.buffer("verify", array.chunk_nbytes)
    reader.read(array, index, [(0, raw)])
    digest = blake3.blake3(raw.data).hexdigest()
    if digest != chunk.blake3:
        return f"{label}: blake3 {digest} differs from the manifest's {chunk.blake3}"
    return None
