"""Read repair: a read that finds the hot copy damaged is served from the next verified copy.

A load, export or conversion that meets a damaged chunk in the hot copy (a flipped bit, a
truncated or missing file, in the checkpoint's own chunks or in a chunk it shares with an
older checkpoint) does not fail while another verified copy exists:

1. the hot copy is marked DAMAGED with a ``damaged`` event naming what was found
   (:mod:`ckptstore.ops.tiering.damage`), unless the catalog shows it changed meanwhile (a
   retention run or another reader's repair: then the reader only reads again);
2. it is restored from the fastest verified copy (warm, then cold; an archival copy is
   thawed first, ``ThawPendingError`` until it is readable) over the damaged one, under the
   ``restore:hot`` lease, so concurrent readers wait for one restore instead of racing:
   files that differ are replaced, shared chunks of other checkpoints are checked and
   replaced too, and the copy is re-hashed before it is PRESENT again (a ``restored``
   event);
3. the reader reads again, from the start of whatever it had not finished: a destination
   it was filling (``load(into=...)``) is filled again whole, so it ends exact.

Only a copy the catalog still lists as PRESENT and unchanged counts as damaged. When no
other verified copy exists, or every one is damaged too, the reader's own error (naming
checkpoint, tensor and chunk) is raised, with a note of what was tried, and the hot copy is
left as it was for reads that do not touch the damaged chunk (``keys=...``). ``ckpt verify``
repairs what a read could not.
"""

from __future__ import annotations

import logging
from pathlib import Path

from ckptstore.core import StoreCore
from ckptstore.errors import (
    CheckpointNotFoundError,
    CkptError,
    IncompleteCheckpointError,
    IntegrityError,
    ThawPendingError,
)
from ckptstore.ops.tiering.damage import mark_damaged, other_copies
from ckptstore.ops.tiering.restore import ensure_hot
from ckptstore.records import Checkpoint

__all__ = ["is_repairable", "read_repair"]

logger = logging.getLogger(__name__)


def is_repairable(exc: BaseException) -> bool:
    """Whether a failed read of a PRESENT hot copy means the copy is damaged: its bytes, a
    file or its marker are wrong or missing (not a storage outage, not a bad argument)."""
    return isinstance(exc, IntegrityError | IncompleteCheckpointError | CheckpointNotFoundError)


def read_repair(core: StoreCore, ck: Checkpoint, exc: CkptError, *, found_by: str) -> Path:
    """Replace the damaged hot copy a read of ``ck`` just failed on, and return its directory.

    Args:
        core: The open store.
        ck: The checkpoint as the reader saw it before reading (its hot replica PRESENT).
        exc: What the read raised (see :func:`is_repairable`).
        found_by: What was reading (``load``, ``export``, ...), for the audit log.

    Returns:
        The hot directory, holding a copy restored from the next verified copy (or one that
        another reader restored meanwhile): read it again.

    Raises:
        CkptError: ``exc`` itself, with a note, when no other verified copy exists or the
            restore from every one failed; ``ThawPendingError`` when the only other copy
            is archival and is being thawed.
    """
    current = core.catalog.get_any(ck.id)
    others = other_copies(core, current, "hot")
    if not others:
        exc.add_note(
            f"no other verified copy of {ck.ref} exists to read instead (replicas: "
            + (", ".join(f"{r.tier}:{r.state}" for r in current.replicas) or "none")
            + f"); `ckpt verify {ck.ref}` says what else is damaged"
        )
        raise exc
    marked = mark_damaged(core, current, "hot", [str(exc)], found_by=found_by,
                          seen=ck.replica("hot"))
    logger.warning("reading %s: its hot copy is damaged (%s); reading the %s copy instead",
                   ck.ref, exc, others[0])
    try:
        return ensure_hot(core, core.catalog.get_any(ck.id))
    except ThawPendingError as thawing:
        thawing.add_note(f"the hot copy of {ck.ref} is damaged: {exc}")
        raise
    except CkptError as failure:
        exc.add_note(f"reading another copy of {ck.ref} failed too ({failure}); "
                     + ("the hot copy is marked DAMAGED; " if marked else "")
                     + f"`ckpt verify {ck.ref}` says which copies are intact")
        raise exc from failure
