"""The commit marker: the one file whose presence makes a checkpoint directory a checkpoint.

``COMMITTED`` holds the blake3 digest of ``manifest.json`` and is written last, after every
other file and directory of the checkpoint is durable. Every layout (packed arrays in
:mod:`ckptstore.format.writer`, DCP in :mod:`ckptstore.format.dcp.commit`) commits through
:func:`write_marker`, so the commit point is the same everywhere.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from ckptstore.durable import fsync_dir, storage_error, write_new_file
from ckptstore.format.constants import COMMIT_NAME, COMMIT_TMP_NAME

__all__ = ["write_marker"]

logger = logging.getLogger(__name__)


def write_marker(directory: Path, digest: str) -> None:
    """Publish the marker atomically: a crash or a full disk never leaves a partial one.

    The marker is written and flushed under a temporary name, then hard-linked to its final
    name (``link`` fails rather than overwrite, unlike ``rename``), and the directory is
    flushed.

    Args:
        directory: The checkpoint directory; everything else in it is already durable.
        digest: Hex blake3 of its ``manifest.json``.

    Raises:
        StorageError: If the marker cannot be written (it then does not exist) or the
            directory cannot be flushed.
    """
    tmp = directory / COMMIT_TMP_NAME
    final = directory / COMMIT_NAME
    write_new_file(tmp, (digest + "\n").encode("ascii"))
    try:
        os.link(tmp, final)
    except OSError as exc:
        raise storage_error(final, "create commit marker", exc) from exc
    try:
        os.unlink(tmp)
    except OSError as exc:
        # The checkpoint is committed; a stray temp file is harmless and `ckpt doctor`
        # removes it, so failing the save now would only misreport it.
        logger.warning("cannot remove %s: %s", tmp, exc)
    fsync_dir(directory)
