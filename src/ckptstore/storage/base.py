"""The storage tier interface: a flat, write-once key space holding checkpoint directories.

A tier stores the files of checkpoints under keys ``<run>/<checkpoint id>/<relative path>``.
Backends implement :class:`Tier`; everything above (transfer, archive, restore, verify,
retention) talks to tiers only through it, so a backend is correct exactly when it passes the
contract tests in :mod:`ckptstore.testing.tiers`.
"""

from __future__ import annotations

import abc
import errno
import logging
import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, ClassVar

from ckptstore.errors import InvalidNameError

# The commit marker (written last, deleted first) and the manifest (written just before it):
# the format names them; tiers and transfers only need to know which files those are.
from ckptstore.format.constants import COMMIT_NAME, MANIFEST_NAME
from ckptstore.names import validate_name
from ckptstore.redact import is_secret_option, scrub

__all__ = [
    "COMMIT_NAME",
    "MANIFEST_NAME",
    "Tier",
    "check_checkpoint_id",
    "check_key",
    "is_not_found",
    "is_retryable",
    "is_secret_option",
    "scrub_secrets",
]

logger = logging.getLogger(__name__)


_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_BAD_KEY_CHARS = ("\\", "\x00", "\r", "\n")

def check_checkpoint_id(ckpt_id: str) -> str:
    """Check that a checkpoint id is safe to use as one path component.

    Raises:
        InvalidNameError: If the id is empty, too long or holds characters outside
            ``[A-Za-z0-9._-]`` (ids are uuids; anything else is a bug or an attack).
    """
    if not isinstance(ckpt_id, str) or not _ID_RE.match(ckpt_id) or ".." in ckpt_id:
        raise InvalidNameError(
            f"checkpoint id {ckpt_id!r} is not a valid id (expected a uuid-like token); "
            "pass the id the catalog returned"
        )
    return ckpt_id


def check_key(key: str, *, prefix: bool = False) -> str:
    """Check a tier key (or, with ``prefix=True``, a key prefix) and return it.

    A key is a ``/``-separated relative path with no empty, ``.`` or ``..`` segment and no
    backslash or control characters, so it maps to exactly one file under a local root and
    one object under an S3 prefix. A prefix may be empty or end with ``/``.

    Raises:
        InvalidNameError: If the key could escape the tier root or is malformed.
    """
    if not isinstance(key, str):
        raise InvalidNameError(f"storage key must be a string, got {type(key).__name__}")
    if prefix and key == "":
        return key
    body = key[:-1] if prefix and key.endswith("/") else key
    bad = (
        body == ""
        or body.startswith("/")
        or any(ch in body for ch in _BAD_KEY_CHARS)
        or any(part in ("", ".", "..") for part in body.split("/"))
    )
    if bad:
        raise InvalidNameError(
            f"storage key {key!r} is not a clean relative path; "
            "keys are '<run>/<checkpoint id>/<file>' without '..', '//' or backslashes"
        )
    return key


def scrub_secrets(text: str, storage_options: Mapping[str, Any] | None = None) -> str:
    """Replace credential values that could appear in ``text`` with ``***``.

    Backend error messages may echo request details; this removes the values of
    credential-like ``storage_options`` entries (at any nesting depth), of the AWS credential
    environment variables and any URL password (an ``endpoint_url`` with userinfo):
    :func:`ckptstore.redact.scrub` with the tier's options.
    """
    return scrub(text, storage_options)


def _chain(exc: BaseException) -> Iterable[BaseException]:
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen and len(seen) < 16:
        seen.add(id(current))
        yield current
        current = current.__cause__ or current.__context__


_RETRYABLE_CODES = frozenset(
    {
        "SlowDown",
        "ServiceUnavailable",
        "InternalError",
        "RequestTimeout",
        "RequestTimeTooSkewed",
        "ConditionalRequestConflict",
        "Throttling",
        "ThrottlingException",
    }
)
_RETRYABLE_ERRNOS = frozenset(
    {errno.EBUSY, errno.EAGAIN, errno.ETIMEDOUT, errno.ECONNRESET, errno.ECONNREFUSED,
     getattr(errno, "EREMOTEIO", 121)}
)


def is_retryable(exc: BaseException) -> bool:
    """Whether a failure is transient (connection loss, throttling, 5xx) and worth retrying.

    Looks through the exception's cause chain, so it works on the :class:`StorageError`
    that wraps a botocore or OS error.
    """
    for err in _chain(exc):
        name = type(err).__name__
        module = type(err).__module__ or ""
        if isinstance(err, (ConnectionError, TimeoutError)):
            return True
        if module.startswith(("botocore", "aiobotocore", "aiohttp")) and any(
            word in name for word in ("Connection", "Timeout", "Endpoint", "ServerDisconnected")
        ):
            return True
        response = getattr(err, "response", None)
        if isinstance(response, Mapping):
            code = str(response.get("Error", {}).get("Code", ""))
            status = response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
            if code in _RETRYABLE_CODES or (isinstance(status, int) and status >= 500):
                return True
        # Our own StorageError carries the errno of what it wraps; an errno of 0 means "not
        # an OS error", so only the transient ones count.
        if isinstance(err, OSError) and err.errno in _RETRYABLE_ERRNOS:
            return True
    return False


def is_not_found(exc: BaseException) -> bool:
    """Whether a failure means the key (or bucket) does not exist."""
    for err in _chain(exc):
        if isinstance(err, FileNotFoundError):
            return True
        if isinstance(err, OSError) and err.errno == errno.ENOENT:
            return True
    return False


class Tier(abc.ABC):
    """One place checkpoints are stored: the local hot directory, an S3 prefix, ...

    Keys are ``/``-separated paths relative to the tier root; a checkpoint's files live under
    :meth:`prefix_for` ``(run, ckpt_id)``. Every key is **write-once**: putting a key that
    exists raises :class:`~ckptstore.errors.ConflictError`, so two writers can never mix
    their bytes and a replica is never rewritten in place.

    Call order (the contract that makes a tier crash-safe without transactions):

    1. **Writers** put every data file of a checkpoint first (in any order, in parallel),
       then ``manifest.json``, and the ``COMMITTED`` marker **last**, only after the data on
       this tier has been read back and verified.
    2. **Readers** trust only the catalog (a PRESENT replica) plus the marker; a prefix
       without the marker is an unfinished or half-deleted copy, never a checkpoint.
    3. **Deletes** remove the marker **first**, then the other files, so a half-deleted copy
       is never mistaken for a complete one.

    Errors: every backend failure is raised as :class:`~ckptstore.errors.StorageError`
    naming the tier and the key, with the backend exception chained as the cause and no
    credentials in the message. Use :func:`is_retryable` / :func:`is_not_found` to classify.

    Attributes:
        supports_rename: The backend can rename a key atomically (local files can, S3 cannot).
        is_local: Keys are plain files on this machine (:meth:`local_dir` returns a path).
    """

    supports_rename: ClassVar[bool] = False
    is_local: ClassVar[bool] = False

    def __init__(self, name: str) -> None:
        """Create the tier.

        Args:
            name: The tier's name in the catalog (``hot``, ``warm``, ``cold``, ...).
        """
        self._name = name

    @property
    def name(self) -> str:
        """The tier's name in the catalog."""
        return self._name

    @property
    @abc.abstractmethod
    def url(self) -> str:
        """Where the tier lives (a path or ``s3://bucket/prefix``); never holds credentials."""

    @property
    def readable(self) -> bool:
        """Whether objects can be read back right after writing (False for archival classes
        such as S3 GLACIER, which need a restore request first)."""
        return True

    def prefix_for(self, run: str, ckpt_id: str) -> str:
        """Key prefix (ending in ``/``) of one checkpoint's files.

        Raises:
            InvalidNameError: If the run name or checkpoint id is unsafe.
        """
        return f"{validate_name(run)}/{check_checkpoint_id(ckpt_id)}/"

    def key_for(self, run: str, ckpt_id: str, rel: str) -> str:
        """Key of file ``rel`` (e.g. ``float32/c/0``) of a checkpoint.

        Raises:
            InvalidNameError: If any part is unsafe.
        """
        return self.prefix_for(run, ckpt_id) + check_key(rel)

    def uri_for(self, run: str, ckpt_id: str) -> str:
        """The URI recorded in the catalog for a replica on this tier."""
        return f"{self.url.rstrip('/')}/{self.prefix_for(run, ckpt_id).rstrip('/')}"

    @abc.abstractmethod
    def put_file(self, local: Path, key: str) -> int:
        """Store the contents of local file ``local`` under ``key``.

        Returns:
            The number of bytes stored.

        Raises:
            ConflictError: If ``key`` exists.
            StorageError: If the backend fails.
        """

    @abc.abstractmethod
    def put_bytes(self, key: str, data: bytes) -> int:
        """Store ``data`` under ``key``; same contract as :meth:`put_file`."""

    @abc.abstractmethod
    def get_file(self, key: str, local: Path) -> int:
        """Copy ``key`` into local file ``local`` (replaced atomically if it exists).

        Returns:
            The number of bytes copied.

        Raises:
            StorageError: If the key is missing (``errno.ENOENT``) or the backend fails.
        """

    @abc.abstractmethod
    def get_bytes(self, key: str) -> bytes:
        """Return the contents of ``key``.

        Raises:
            StorageError: If the key is missing (``errno.ENOENT``) or the backend fails.
        """

    @abc.abstractmethod
    def exists(self, key: str) -> bool:
        """Whether ``key`` exists (always asks the backend; no cached answer)."""

    @abc.abstractmethod
    def size(self, key: str) -> int:
        """Size of ``key`` in bytes.

        Raises:
            StorageError: If the key is missing (``errno.ENOENT``) or the backend fails.
        """

    @abc.abstractmethod
    def list_prefix(self, prefix: str) -> list[str]:
        """All keys that start with ``prefix`` (``""`` or ending in ``/``), sorted."""

    @abc.abstractmethod
    def delete(self, key: str) -> bool:
        """Delete one key; return False if it did not exist."""

    def delete_prefix(self, prefix: str) -> int:
        """Delete every key under ``prefix``: ``COMMITTED`` markers first, then the rest.

        Args:
            prefix: A key prefix ending in ``/`` (never ``""``: refusing to wipe a tier).

        Returns:
            The number of keys deleted.

        Raises:
            InvalidNameError: If the prefix is empty or malformed.
            StorageError: If the backend fails (what was deleted stays deleted).
        """
        if not prefix or not prefix.endswith("/"):
            raise InvalidNameError(
                f"refusing to delete prefix {prefix!r}: give a '<run>/<id>/' prefix"
            )
        check_key(prefix, prefix=True)
        keys = self.list_prefix(prefix)
        markers = [k for k in keys if k.rsplit("/", 1)[-1] == COMMIT_NAME]
        rest = [k for k in keys if k.rsplit("/", 1)[-1] != COMMIT_NAME]
        # The marker goes first and alone: if we die after this, what is left is visibly
        # incomplete and nobody can mistake it for a checkpoint.
        count = sum(1 for k in markers if self.delete(k))
        count += self.delete_keys(rest)
        logger.debug("%s tier: deleted %s keys under %s", self.name, count, prefix)
        return count

    def delete_keys(self, keys: Iterable[str]) -> int:
        """Delete several keys (no ordering guarantee); return how many existed."""
        return sum(1 for k in keys if self.delete(k))

    def local_dir(self, run: str, ckpt_id: str) -> Path | None:
        """The checkpoint's directory on this machine, or None for remote tiers."""
        return None

    def free_bytes(self) -> int | None:
        """Free space left on the tier, or None when unbounded or unknown."""
        return None

    def abort_multipart_uploads(self, prefix: str) -> int:
        """Abort unfinished multipart uploads under ``prefix`` (no-op where there are none).

        Returns:
            The number of uploads aborted.
        """
        return 0

    def close(self) -> None:  # noqa: B027 - optional hook, most backends hold nothing
        """Release backend resources (connections); the tier must not be used afterwards."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, url={self.url!r})"
