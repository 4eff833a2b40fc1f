"""Waiting for a thaw: poll an archival copy until it is readable, then restore it.

:mod:`ckptstore.ops.tiering.thaw` asks S3 to restore a GLACIER copy and raises
:class:`~ckptstore.errors.ThawPendingError`; this is what then finishes the job (the
``thaw`` flow, ``ckpt thaw REF --wait``, a prefetch with ``wait``): every ``poll_s`` it
looks at the copy's objects (HEAD requests), and once all are readable it restores the
checkpoint to the hot tier through the usual copy → verify → record path
(:func:`ckptstore.ops.tiering.restore.restore_checkpoint`; a sealed copy is decrypted with
the key given, ``$CKPT_DECRYPT_KEY`` or ``decrypt_key``).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

from ckptstore.core import StoreCore
from ckptstore.errors import CheckpointNotFoundError, InvalidNameError, ThawPendingError
from ckptstore.ops.tiering.restore import restore_checkpoint
from ckptstore.ops.tiering.thaw import archival_copy, thawed_source
from ckptstore.records import ReplicaState

__all__ = ["complete_thaw"]

logger = logging.getLogger(__name__)


def complete_thaw(
    core: StoreCore,
    ref: str,
    *,
    poll_s: float = 300.0,
    timeout_s: float | None = None,
    sleep: Callable[[float], None] = time.sleep,
    key: str | os.PathLike[str] | None = None,
) -> Path:
    """Thaw ``ref``'s archival copy if needed, wait until it is readable, restore it to hot.

    A checkpoint that another tier (or the hot tier) already holds is simply restored.

    Args:
        core: The open store.
        ref: Checkpoint reference.
        poll_s: Seconds between two looks at the objects.
        timeout_s: Give up after this long (None: wait as long as it takes).
        sleep: How to wait (tests pass a fake clock's).
        key: Private key that opens a sealed copy (an encrypted tier); default
            ``$CKPT_DECRYPT_KEY``, else ``decrypt_key``. Checked before the thaw is asked
            for.

    Returns:
        The restored hot directory.

    Raises:
        ThawPendingError: If ``timeout_s`` passed before every object was readable.
        CheckpointNotFoundError: If the reference does not resolve or no tier holds a copy.
        InvalidNameError: For a negative or non-finite ``poll_s`` / ``timeout_s``.
        DecryptionError: If the copy is sealed and no key, or a key it was not encrypted
            to, is given (before anything is asked of S3).
        IntegrityError, StorageError: As :func:`~ckptstore.ops.tiering.restore.restore_checkpoint`.
    """
    if not poll_s > 0 or poll_s == float("inf"):
        raise InvalidNameError(f"poll_s must be a positive number of seconds, not {poll_s!r}")
    if timeout_s is not None and not timeout_s >= 0:
        raise InvalidNameError(f"timeout_s must be >= 0 seconds, not {timeout_s!r}")
    ck = core.catalog.get(ref)
    hot = ck.replica("hot")
    if (hot is not None and hot.state == ReplicaState.PRESENT) or archival_copy(core, ck) is None:
        return restore_checkpoint(core, ck.id, key=key)
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while True:
        try:
            thawed = thawed_source(core, core.catalog.get(ck.id), check=True, key=key)
        except ThawPendingError as exc:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise
            logger.info("%s: %s; looking again in %.0fs", ck.ref, exc, poll_s)
            sleep(poll_s if left is None else min(poll_s, left))
            continue
        if thawed is None:
            raise CheckpointNotFoundError(
                f"{ck.ref} ({ck.id}) has no archival copy any more; `ckpt show {ck.id}` "
                "lists its copies"
            )
        return restore_checkpoint(core, ck.id, key=key)
