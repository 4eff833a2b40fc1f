"""Make a local copy of a checkpoint complete for any Zarr reader: hard-link shared chunks.

A copy restored from object storage holds only its own chunk files; the chunks it shares
with other checkpoints are restored into their owners' directories, and its arrays carry the
chunk-reference ``zarr.json`` that plain readers refuse. On a local file system the shared
chunk files can be hard-linked into the copy's own directory, after which each such array
gets its plain document back: the same state a fresh save leaves (docs/FORMAT.md, "Exact or
loud"). Where a link cannot be made (another file system), the array keeps its reference
document and nothing is lost.
"""

from __future__ import annotations

import logging
import os
import stat
from collections.abc import Callable
from pathlib import Path

from ckptstore.durable import fsync_dir, replace_file
from ckptstore.errors import IntegrityError
from ckptstore.format.constants import CHUNK_DIR, ZARR_JSON
from ckptstore.format.fsio import read_regular
from ckptstore.format.manifest import Manifest
from ckptstore.format.zarrmeta import digest, strip_refusing_codec

__all__ = ["link_shared_chunks"]

logger = logging.getLogger(__name__)

_MAX_DOC = 64 * 1024


def link_shared_chunks(
    directory: Path, manifest: Manifest, locate: Callable[[str], Path]
) -> set[str]:
    """Hard-link every chunk of another checkpoint into ``directory``; plain documents after.

    Args:
        directory: A local copy of the checkpoint (version 2; others are left as they are).
        manifest: Its manifest.
        locate: The directory of a checkpoint by id, on the same tier.

    Returns:
        The arrays that now hold every chunk file themselves and have their plain document.

    Raises:
        IntegrityError: If a document is neither of the two the manifest records.
        StorageError: If a document cannot be rewritten durably.
    """
    done: set[str] = set()
    for rel in manifest.metadata_ref:
        name = rel[: -len(ZARR_JSON) - 1]
        entry = manifest.arrays[name]
        linked = True
        for chunk in entry.chunks:
            own = directory / entry.chunk_path(chunk.i)
            if chunk.src is None or os.path.lexists(own):
                continue
            source = Path(locate(chunk.src)) / entry.chunk_path(chunk.i)
            try:
                if not stat.S_ISREG(os.lstat(source).st_mode):
                    linked = False
                    break
                os.link(source, own, follow_symlinks=False)
            except OSError as exc:
                logger.debug("cannot hard-link %s into %s (%s)", source, directory, exc)
                linked = False
                break
        if not linked:
            continue
        fsync_dir(directory / name / CHUNK_DIR)
        current = read_regular(directory / rel, _MAX_DOC)
        if digest(current) == manifest.metadata[rel]:
            done.add(name)
            continue
        if digest(current) != manifest.metadata_ref[rel]:
            raise IntegrityError(
                f"{directory / rel} is not a document the manifest of checkpoint "
                f"{manifest.id} records; run `ckpt verify` to repair the copy"
            )
        plain = strip_refusing_codec(current)
        if digest(plain) != manifest.metadata[rel]:
            continue  # written by another zarr version: the reference document stays
        replace_file(directory / rel, plain)
        done.add(name)
    return done
