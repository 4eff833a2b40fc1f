"""One error hierarchy for everything ckptstore raises.

Every error says what failed and what to do about it. Subclasses also inherit the builtin
a caller would naturally catch (``LookupError`` for a missing checkpoint, ``ValueError`` for
a bad name), so generic handlers keep working.
"""

from __future__ import annotations

__all__ = [
    "CheckpointNotFoundError",
    "CkptError",
    "ConfigError",
    "ConflictError",
    "DecryptionError",
    "IncompleteCheckpointError",
    "IntegrityError",
    "InvalidNameError",
    "LeaseHeldError",
    "MissingBaseError",
    "MissingExtraError",
    "RemoteError",
    "SnapshotError",
    "StorageError",
    "StoreNotFoundError",
    "ThawPendingError",
    "UnsafeObjectError",
    "UsageError",
]


class CkptError(Exception):
    """Root of every error raised by ckptstore."""


class CheckpointNotFoundError(CkptError, LookupError):
    """A checkpoint reference does not resolve to a committed checkpoint."""


class IncompleteCheckpointError(CkptError):
    """The checkpoint exists but was never committed (a save died or is still running)."""


class IntegrityError(CkptError):
    """Stored bytes do not match their recorded hashes, or a chunk or manifest is missing."""


class DecryptionError(IntegrityError):
    """An encrypted copy cannot be opened: no key, a key it was not encrypted to, or an
    altered or truncated ciphertext (nothing of it is used)."""


class MissingBaseError(IntegrityError):
    """A delta checkpoint's base checkpoint (or one of its chunks) is gone."""


class ConflictError(CkptError):
    """Two writers raced for the same thing; the operation did nothing and may be retried."""


class LeaseHeldError(ConflictError):
    """Another flow holds a lease on the checkpoint; retry after the lease expires."""


class InvalidNameError(CkptError, ValueError):
    """A run name, tag, alias, reference or query field is not acceptable."""


class UsageError(InvalidNameError):
    """The request itself is malformed: a reference, expression, option value or format that
    cannot name anything (``run-a@v0``, ``--where 'loss<<2'``, ``--format onnx``).

    Told apart from a well-formed request that fails (a missing run, a damaged copy): the
    ``ckpt`` command exits 2 for this one, 1 for those.
    """


class UnsafeObjectError(CkptError, TypeError):
    """The state holds an object that could only be stored with pickle."""


class StorageError(CkptError, OSError):
    """A storage backend failed (disk full, permission denied, S3 error); the cause is chained."""


class ThawPendingError(StorageError):
    """The only copy is in an archival storage class (S3 GLACIER) and is being thawed.

    A restore request (S3 RestoreObject) went out for every object of that copy; the
    operation can be retried once they are readable (``ckpt thaw REF --wait`` polls until
    then and restores). Also a ``StorageError`` (an ``OSError``), so handlers of storage
    failures keep seeing it.

    Attributes:
        checkpoint_id: The thawing checkpoint.
        tier: The archival tier its copy is on.
        ready_in_s: Seconds until the objects are expected to be readable (0 when overdue).
    """

    def __init__(self, message: str, *, checkpoint_id: str, tier: str,
                 ready_in_s: float) -> None:
        super().__init__(message)
        self.checkpoint_id = checkpoint_id
        self.tier = tier
        self.ready_in_s = ready_in_s

    def __reduce__(self) -> tuple[object, ...]:
        # Prefect and multiprocessing pickle errors; the keyword-only fields must survive.
        return (_rebuild_thaw_error, (str(self), self.checkpoint_id, self.tier,
                                      self.ready_in_s))


def _rebuild_thaw_error(message: str, checkpoint_id: str, tier: str,
                        ready_in_s: float) -> ThawPendingError:
    return ThawPendingError(message, checkpoint_id=checkpoint_id, tier=tier,
                            ready_in_s=ready_in_s)


class SnapshotError(CkptError):
    """A snapshot's background copy or commit failed.

    Raised by the next wait for it (the next snapshot, ``CheckpointManager.wait_snapshot``,
    the optimizer pre-step hook, a durable save, ``close``). The slot it was written to
    stays invisible: readers keep the previous snapshot as the newest.
    """


class ConfigError(CkptError, ValueError):
    """The configuration file or environment holds an invalid value."""


class StoreNotFoundError(ConfigError, LookupError):
    """The path (or catalog URL) given as a store holds no store, or is not a directory.

    Raised instead of creating one where a command only reads (``ckpt ls --store ./typo``);
    ``ckpt init`` or a save through the API create a store.
    """


class RemoteError(ConfigError):
    """A remote store is unknown, named twice, or its config file cannot be read."""


class MissingExtraError(ConfigError, ImportError):
    """An optional dependency is not installed; the message names the extra that brings it.

    Also an ``ImportError``, so code that treats a missing optional package as "feature off"
    keeps working. Raised through :func:`ckptstore.extras.require`.

    Attributes:
        extra: The ``ckptstore[...]`` extra to install.
        module: The module that could not be imported.
    """

    def __init__(self, message: str, *, extra: str, module: str) -> None:
        super().__init__(message)
        self.extra = extra
        self.module = module
        # ImportError's own field, for handlers that read it (ValueError's __init__ runs
        # first in the MRO and does not take it as an argument).
        self.name = module
