"""A DCP checkpoint's index, and the check of every file it lists (sizes, crc32c).

Torch-free, so the processes that only check or move the parts of a checkpoint saved across
hosts (and ``ckpt show``) never import it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path

from ckptstore.errors import IntegrityError
from ckptstore.format.constants import ZARR_JSON
from ckptstore.format.dcp.layout import DcpIndex
from ckptstore.format.filecheck import check_file
from ckptstore.format.manifest import Manifest
from ckptstore.numeric import counted

__all__ = ["index_of", "verify_dcp"]

logger = logging.getLogger(__name__)


def index_of(manifest: Manifest) -> DcpIndex:
    """The DCP index of a manifest (parsed and validated with the manifest).

    Raises:
        IntegrityError: If the manifest has no valid DCP index.
    """
    if manifest.dcp is None:
        raise IntegrityError(
            f"checkpoint {manifest.id} was not saved through DCP (no DCP index in its "
            "manifest); load it with store.load instead of a DCP storage reader"
        )
    return manifest.dcp


def verify_dcp(
    directory: Path,
    manifest: Manifest,
    *,
    deep: bool = True,
    include: Callable[[str], bool] | None = None,
) -> list[str]:
    """Check every file of a DCP checkpoint against the index.

    Args:
        directory: The checkpoint directory.
        manifest: Its manifest.
        deep: Read every chunk and check its crc32c; otherwise sizes only.
        include: Check only the files (relative paths) it accepts: the parts one host of a
            save across hosts holds.

    Returns:
        One line per problem; empty when intact.
    """
    directory = Path(directory)
    try:
        index = index_of(manifest)
    except IntegrityError as exc:
        return [str(exc)]
    problems: list[str] = []
    for path in index.arrays:
        doc = f"{path}/{ZARR_JSON}"
        if (include is None or include(doc)) and not (directory / doc).is_file():
            problems.append(f"{doc}: missing")

    with ThreadPoolExecutor(2, thread_name_prefix="ckpt-dcp-verify") as pool:
        files = [f for f in index.files() if include is None or include(f[0])]
        problems += [p for p in pool.map(partial(check_file, directory, deep), files)
                     if p is not None]
    if problems:
        logger.warning("checkpoint %s at %s has %s: %s", manifest.id, directory,
                       counted(len(problems), "problem"), "; ".join(problems[:3]))
    return problems
