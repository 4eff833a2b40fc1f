"""A tier on S3 (or any S3-compatible endpoint) through s3fs.

Objects are created with ``If-None-Match: *`` (s3fs ``mode="create"``), so a key is written
once even with several writers: the second one gets a 412 and we raise ConflictError. Every
listing or existence check first drops s3fs's listings cache, which would otherwise hide
objects written by other processes. Credentials never pass through here: s3fs takes them
from the environment or the AWS credential chain, and ``storage_options`` holding secrets
are refused.

S3 throttles per key prefix (about 3,500 writes and 5,500 reads per second each) and answers
``503 SlowDown`` beyond that. s3fs retries each request a few times on its own; when a
request still gets SlowDown, :class:`PrefixThrottle` pauses every request of this tier to
that prefix (the object's parent "directory": in the per-rank layout of saves across hosts,
one array of one rank) with exponential backoff, while requests to other prefixes go on.
Bounded: a request is tried at most :data:`SLOWDOWN_ATTEMPTS` times, waiting at most
:data:`SLOWDOWN_MAX_DELAY_S` between two.
"""

from __future__ import annotations

import enum
import errno
import logging
import os
import random
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any, ClassVar, TypeVar

from ckptstore.durable import TEMP_PREFIX
from ckptstore.errors import ConfigError, ConflictError, InvalidNameError, StorageError
from ckptstore.extras import require
from ckptstore.format.sealed import ENVELOPE_NAME
from ckptstore.records import SEALED_DIR
from ckptstore.redact import mask_url, split_userinfo
from ckptstore.storage.base import (
    COMMIT_NAME,
    MANIFEST_NAME,
    Tier,
    check_key,
    is_not_found,
    is_retryable,
    scrub_secrets,
)

__all__ = [
    "ARCHIVAL_STORAGE_CLASSES",
    "SLOWDOWN_ATTEMPTS",
    "SLOWDOWN_MAX_DELAY_S",
    "PrefixThrottle",
    "RestoreState",
    "S3Tier",
]

logger = logging.getLogger(__name__)

#: Storage classes whose objects cannot be read without a restore request first.
ARCHIVAL_STORAGE_CLASSES = frozenset({"GLACIER", "DEEP_ARCHIVE"})

_T = TypeVar("_T")

#: botocore's loaders of its bundled JSON (service models, endpoints), one per data path
#: (``AWS_DATA_PATH``): the first session's, handed to every later one.
_LOADERS: dict[str | None, Any] = {}
_LOADERS_LOCK = threading.Lock()


def _session(profile: str | None) -> Any:
    """A new botocore session for one tier's file system (its own credentials, resolved
    when its client is made), reading botocore's JSON through a loader shared by the
    process.

    A session parses the S3 service model and the endpoint data on its first client (about
    60 ms of CPU); every tier has a file system of its own, so a process with several tiers
    or remotes (or a ``ckpt`` command opening a store) paid that per tier. The loader only
    caches the files botocore ships, the same for every session reading the same data path.
    """
    from aiobotocore.session import AioSession

    session = AioSession(profile=profile)
    data_path = session.get_config_variable("data_path")
    with _LOADERS_LOCK:
        loader = _LOADERS.get(data_path)
        if loader is None:  # the first session's own loader, made for its data path
            _LOADERS[data_path] = session.get_component("data_loader")
        else:
            session.register_component("data_loader", loader)
    return session


class RestoreState(enum.StrEnum):
    """Whether one object can be read, as its ``HEAD`` says (storage class, ``Restore``)."""

    READABLE = "readable"
    """In a class that is read directly (STANDARD, STANDARD_IA...)."""
    ARCHIVED = "archived"
    """In an archival class, and no restore has been asked for (or it has expired)."""
    ONGOING = "ongoing"
    """A restore is in progress (``Restore: ongoing-request="true"``)."""
    RESTORED = "restored"
    """A restored copy is readable (``Restore: ongoing-request="false", expiry-date=...``)."""

# Option names that would carry credentials into config files, flow parameters and logs.
_FORBIDDEN_OPTIONS = frozenset(
    {"key", "secret", "token", "password", "aws_access_key_id", "aws_secret_access_key",
     "aws_session_token", "session_token"}
)
_BULK_DELETE = 1000
_ALWAYS_STANDARD = frozenset({COMMIT_NAME, MANIFEST_NAME})


def _backend_errors() -> tuple[type[BaseException], ...]:
    """The exception types a backend call may raise besides our own errors."""
    types: list[type[BaseException]] = [OSError]
    # s3fs's own dependencies, looked up rather than imported: an error of theirs can only
    # have been raised once s3fs loaded them, and ckptstore does not depend on them itself.
    botocore = sys.modules.get("botocore.exceptions")
    if botocore is not None:
        types += [botocore.BotoCoreError, botocore.ClientError]
    aiohttp = sys.modules.get("aiohttp")
    if aiohttp is not None:
        types.append(aiohttp.ClientError)
    return tuple(types)


def _check_options(options: Mapping[str, Any], where: str = "storage_options") -> None:
    for name, value in options.items():
        if name.lower() in _FORBIDDEN_OPTIONS and value not in (None, ""):
            raise ConfigError(
                f"{where}.{name} would put a credential into the configuration; remove it and "
                "provide credentials through the environment (AWS_ACCESS_KEY_ID, "
                "AWS_SECRET_ACCESS_KEY) or the AWS credential chain (profile, instance role)"
            )
        if isinstance(value, str) and (found := split_userinfo(value)) is not None \
                and (found.user or found.password is not None):
            raise ConfigError(
                f"{where}.{name} ({mask_url(value)}) carries credentials in its URL; remove "
                "them and provide credentials through the environment (AWS_ACCESS_KEY_ID, "
                "AWS_SECRET_ACCESS_KEY) or the AWS credential chain (profile, instance role)"
            )
        if isinstance(value, Mapping):
            _check_options(value, f"{where}.{name}")


#: Tries of one request that S3 keeps answering SlowDown (after s3fs's own retries).
SLOWDOWN_ATTEMPTS = 6
#: Longest pause of a prefix after a SlowDown, and the first one.
SLOWDOWN_MAX_DELAY_S = 20.0
_SLOWDOWN_FIRST_DELAY_S = 0.25
_THROTTLE_CODES = frozenset({"SlowDown", "503", "ServiceUnavailable", "Throttling",
                             "ThrottlingException", "RequestLimitExceeded"})


def _is_slowdown(exc: BaseException) -> bool:
    if _error_code(exc) in _THROTTLE_CODES:
        return True
    current: BaseException | None = exc
    for _ in range(8):
        if current is None:
            return False
        text = str(current)
        if "SlowDown" in text or "reduce your request rate" in text:
            return True
        current = current.__cause__ or current.__context__
    return False


class PrefixThrottle:
    """Backs off per key prefix after ``503 SlowDown``; other prefixes are not slowed.

    Thread-safe. Each prefix keeps its current delay: doubled (from 0.25 s up to
    :data:`SLOWDOWN_MAX_DELAY_S`) on every SlowDown, halved on every success, forgotten
    once it drops below the first step.

    Attributes:
        slowdowns: SlowDown answers seen, by prefix.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._delay: dict[str, float] = {}
        self._until: dict[str, float] = {}
        self.slowdowns: dict[str, int] = {}

    @staticmethod
    def prefix(key: str) -> str:
        """The throttling prefix of a key: its parent "directory"."""
        return key.rsplit("/", 1)[0] if "/" in key else ""

    def wait(self, prefix: str) -> None:
        """Sleep while ``prefix`` is paused."""
        with self._lock:
            until = self._until.get(prefix, 0.0)
        pause = until - time.monotonic()
        if pause > 0:
            time.sleep(pause)

    def slowed(self, prefix: str) -> float:
        """Record a SlowDown on ``prefix``; return the pause now in force."""
        with self._lock:
            delay = min(max(self._delay.get(prefix, 0.0) * 2, _SLOWDOWN_FIRST_DELAY_S),
                        SLOWDOWN_MAX_DELAY_S)
            self._delay[prefix] = delay
            # Jitter: writers that were slowed together must not come back together.
            self._until[prefix] = time.monotonic() + delay * random.uniform(0.5, 1.0)
            self.slowdowns[prefix] = self.slowdowns.get(prefix, 0) + 1
            return delay

    def ok(self, prefix: str) -> None:
        """Record a success on ``prefix``."""
        with self._lock:
            delay = self._delay.get(prefix)
            if delay is None:
                return
            if delay / 2 < _SLOWDOWN_FIRST_DELAY_S:
                self._delay.pop(prefix, None)
                self._until.pop(prefix, None)
            else:
                self._delay[prefix] = delay / 2


def _error_code(exc: BaseException) -> str:
    current: BaseException | None = exc
    for _ in range(8):
        if current is None:
            break
        response = getattr(current, "response", None)
        if isinstance(response, Mapping):
            return str(response.get("Error", {}).get("Code", ""))
        current = current.__cause__ or current.__context__
    return ""


class S3Tier(Tier):
    """Checkpoint objects under ``s3://bucket/prefix/<run>/<id>/<file>``.

    Example:
        >>> tier = S3Tier("s3://ckpt/warm", {"endpoint_url": "http://127.0.0.1:9000"},
        ...               name="warm")                                # doctest: +SKIP
    """

    supports_rename: ClassVar[bool] = False
    is_local: ClassVar[bool] = False

    def __init__(
        self,
        url: str,
        storage_options: Mapping[str, Any] | None = None,
        storage_class: str | None = None,
        name: str = "warm",
    ) -> None:
        """Create the tier; no request is made until first use.

        Args:
            url: ``s3://bucket`` or ``s3://bucket/prefix``.
            storage_options: Options for ``s3fs.S3FileSystem`` (``endpoint_url``,
                ``client_kwargs``, ``config_kwargs``, ...); never credentials.
            storage_class: S3 storage class for new objects (``STANDARD_IA``, ``GLACIER``...);
                ``manifest.json``, ``COMMITTED`` and a sealed copy's ``envelope.json``
                always use the default class so they can be read without a restore request.
            name: The tier's name in the catalog.

        Raises:
            ConfigError: If the URL is not ``s3://bucket[/prefix]`` or the options hold
                credentials.
        """
        super().__init__(name)
        shown = mask_url(url)  # the URL may carry credentials it must not repeat
        if not url.startswith("s3://"):
            raise ConfigError(f"tier {name}: {shown!r} is not an s3:// URL")
        bucket, _, prefix = url[len("s3://") :].partition("/")
        prefix = prefix.strip("/")
        if "@" in bucket or ":" in bucket:
            raise ConfigError(
                f"tier {name}: {shown!r} carries credentials (or a port) before the bucket; "
                "use s3://bucket[/prefix] and provide credentials through the environment "
                "(AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY) or the AWS credential chain"
            )
        if not bucket or "//" in prefix:
            raise ConfigError(
                f"tier {name}: {shown!r} is not a valid S3 URL; use s3://bucket[/prefix]"
            )
        if prefix:
            try:
                check_key(prefix)
            except InvalidNameError as exc:
                raise ConfigError(f"tier {name}: bad prefix in {shown!r}: {exc}") from exc
        options = dict(storage_options or {})
        _check_options(options)
        # botocore checksums every upload and download (CRC32, in Python's binascii: about a
        # third of a CPU second per GB each way). Every object the store reads back is
        # checked against its own digests (crc32c per chunk, blake3 per manifest), end to end,
        # so the transport checksum is left to the operations S3 requires it for; a
        # ``config_kwargs`` of the caller's own wins.
        config = dict(options.get("config_kwargs") or {})
        for setting in ("request_checksum_calculation", "response_checksum_validation"):
            config.setdefault(setting, "when_required")
        options["config_kwargs"] = config
        self.bucket = bucket
        self.prefix = prefix
        self.storage_class = storage_class.upper() if storage_class else None
        self._options = options
        self._fs: Any = None
        self._lock = threading.Lock()
        self.throttle = PrefixThrottle()

    # ------------------------------------------------------------------ plumbing
    @property
    def url(self) -> str:
        """``s3://bucket/prefix`` (no endpoint, no credentials)."""
        return f"s3://{self.bucket}/{self.prefix}" if self.prefix else f"s3://{self.bucket}"

    @property
    def readable(self) -> bool:
        """False for archival storage classes (GLACIER, DEEP_ARCHIVE)."""
        return self.storage_class not in ARCHIVAL_STORAGE_CLASSES

    @property
    def fs(self) -> Any:
        """The s3fs file system (created on first use, never shared with other tiers)."""
        with self._lock:
            if self._fs is None:
                s3fs = require("s3fs", f"tier {self.name} ({self.url})")
                # skip_instance_cache: s3fs would otherwise hand every caller with the same
                # options one shared instance, listings cache and event loop included.
                own = {} if "session" in self._options else {
                    "session": _session(self._options.get("profile"))}
                self._fs = s3fs.S3FileSystem(skip_instance_cache=True, **own, **self._options)
            return self._fs

    def _path(self, key: str) -> str:
        head = f"{self.bucket}/{self.prefix}" if self.prefix else self.bucket
        return f"{head}/{key}" if key else head

    def _display(self, key: str) -> str:
        return f"s3://{self._path(key)}"

    def _error(self, action: str, key: str, exc: BaseException) -> StorageError:
        code = _error_code(exc)
        endpoint = mask_url(self._options.get("endpoint_url", "the default AWS endpoint"))
        if is_not_found(exc) or code in ("NoSuchKey", "NoSuchBucket", "404"):
            number = errno.ENOENT
            hint = (
                "the bucket does not exist: create it or fix the tier URL"
                if code == "NoSuchBucket"
                else "the object does not exist: the copy is incomplete or was deleted"
            )
        elif code == "InvalidObjectState":
            number = errno.EACCES
            hint = (
                f"the object is in an archival storage class ({self.storage_class or 'GLACIER'}); "
                "request a restore (S3 RestoreObject) and retry once it has completed"
            )
        elif isinstance(exc, PermissionError) or code in ("AccessDenied", "403",
                                                            "InvalidAccessKeyId",
                                                            "SignatureDoesNotMatch"):
            number = errno.EACCES
            hint = (
                "access denied: check the credentials in the environment or AWS credential "
                "chain and the bucket policy"
            )
        elif is_retryable(exc):
            number = errno.ECONNREFUSED if "onnect" in type(exc).__name__ else errno.EAGAIN
            hint = (
                f"S3 at {endpoint} is unreachable or busy: check the endpoint and network, "
                "then retry (nothing was recorded as archived)"
            )
        else:
            number = getattr(exc, "errno", None) or errno.EIO
            hint = "check the endpoint, bucket and permissions, then retry"
        reason = scrub_secrets(f"{type(exc).__name__}: {exc}", self._options)
        err = StorageError(
            number,
            f"{self.name} tier: cannot {action} {self._display(key)}: {reason}; {hint}",
        )
        err.filename = self._display(key)
        return err

    @contextmanager
    def _wrap(self, action: str, key: str) -> Iterator[None]:
        try:
            yield
        except (StorageError, ConflictError, ConfigError, InvalidNameError):
            raise
        except _backend_errors() as exc:
            raise self._error(action, key, exc) from exc

    def _call(self, action: str, key: str, func: Callable[[], _T]) -> _T:
        with self._wrap(action, key):
            return func()
        raise AssertionError("unreachable")  # pragma: no cover - keeps mypy happy

    def _throttled(self, action: str, key: str, func: Callable[[], _T]) -> _T:
        """:meth:`_call` under the prefix's SlowDown backoff (see :class:`PrefixThrottle`)."""
        prefix = self.throttle.prefix(key)
        for attempt in range(1, SLOWDOWN_ATTEMPTS + 1):
            self.throttle.wait(prefix)
            try:
                result = self._call(action, key, func)
            except StorageError as exc:
                if attempt == SLOWDOWN_ATTEMPTS or not _is_slowdown(exc):
                    raise
                delay = self.throttle.slowed(prefix)
                logger.info("%s tier: SlowDown on %s/ (try %d); pausing that prefix %.2fs",
                            self.name, prefix, attempt, delay)
                continue
            self.throttle.ok(prefix)
            return result
        raise AssertionError("unreachable")  # pragma: no cover - the loop returns or raises

    def _put_kwargs(self, key: str) -> dict[str, Any]:
        # The manifest and the marker stay in the default class: they are tiny, and tools
        # (verify, retention's reference scan) must read them without a restore request.
        # So does a sealed copy's cleartext envelope (format/sealed.py), for the same
        # reason: its recipients and object count are read (a key is checked against it
        # before a thaw is asked for, verify counts the objects) without a restore.
        name = key.rsplit("/", 1)[-1]
        if not self.storage_class or name in _ALWAYS_STANDARD or (
                name == ENVELOPE_NAME and key.startswith(f"{SEALED_DIR}/")):
            return {}
        return {"StorageClass": self.storage_class}

    def _conflict(self, key: str, exc: BaseException) -> ConflictError:
        return ConflictError(
            f"{self.name} tier: {self._display(key)} already exists and objects are written "
            "once; delete the incomplete copy first (or let the archive flow redo it)"
        )

    # ------------------------------------------------------------------ Tier API
    def put_bytes(self, key: str, data: bytes) -> int:
        """Create object ``key`` with ``data`` (``If-None-Match: *``)."""
        check_key(key)
        path = self._path(key)
        try:
            extra = self._put_kwargs(key)
            self._throttled(
                "write", key,
                lambda: self.fs.pipe_file(path, bytes(data), mode="create", **extra),
            )
        except StorageError as exc:
            if isinstance(exc.__cause__, FileExistsError):
                raise self._conflict(key, exc) from exc.__cause__
            raise
        return len(data)

    def put_file(self, local: Path, key: str) -> int:
        """Upload local file ``local`` as new object ``key`` (``If-None-Match: *``)."""
        check_key(key)
        path = self._path(key)
        try:
            size = os.path.getsize(local)
            self._call(
                "write", key,
                lambda: self.fs.put_file(str(local), path, mode="create", **self._put_kwargs(key)),
            )
        except StorageError as exc:
            if isinstance(exc.__cause__, FileExistsError):
                raise self._conflict(key, exc) from exc.__cause__
            raise
        except OSError as exc:  # the local file
            raise StorageError(
                exc.errno or errno.EIO, f"cannot read {local} to upload it: {exc.strerror}"
            ) from exc
        return size

    def get_bytes(self, key: str) -> bytes:
        """Download object ``key``."""
        check_key(key)
        # max_concurrency=1: one GET, without the HEAD s3fs sends to plan ranged reads.
        data = self._throttled("read", key,
                               lambda: self.fs.cat_file(self._path(key), max_concurrency=1))
        return bytes(data)

    def get_file(self, key: str, local: Path) -> int:
        """Download object ``key`` into ``local`` (via a temp file and a rename)."""
        check_key(key)
        local.parent.mkdir(parents=True, exist_ok=True)
        tmp = local.parent / f"{TEMP_PREFIX}{uuid.uuid4().hex}"
        try:
            self._call("read", key, lambda: self.fs.get_file(self._path(key), str(tmp)))
            os.replace(tmp, local)
        finally:
            if tmp.exists():
                tmp.unlink()
        return local.stat().st_size

    def _head(self, key: str) -> dict[str, Any] | None:
        """HEAD one object (never from cache); None when it does not exist."""
        check_key(key)
        bucket_key = self._path(key)[len(self.bucket) + 1 :]
        try:
            out: dict[str, Any] = self.fs.call_s3("head_object", Bucket=self.bucket,
                                                  Key=bucket_key)
        except FileNotFoundError:
            return None
        return out

    def exists(self, key: str) -> bool:
        """Whether object ``key`` exists (one HEAD request; no cached answer)."""
        return self._call("stat", key, lambda: self._head(key) is not None)

    def size(self, key: str) -> int:
        """Size of object ``key``."""

        def head() -> int:
            found = self._head(key)
            if found is None:
                raise FileNotFoundError(errno.ENOENT, "no such object", self._display(key))
            return int(found["ContentLength"])

        return self._call("stat", key, head)

    def list_prefix(self, prefix: str) -> list[str]:
        """Keys under ``prefix`` (fresh listing, never from cache), sorted."""
        check_key(prefix, prefix=True)
        head = self._path("") + "/"
        base = self._path(prefix.rstrip("/")) if prefix else self._path("")

        def listing() -> list[str]:
            self.fs.invalidate_cache()
            try:
                found = self.fs.find(base)
            except FileNotFoundError:
                return []
            keys = [p[len(head) :] for p in found if p.startswith(head)]
            return sorted(k for k in keys if k.startswith(prefix) and not k.endswith("/"))

        return self._call("list", prefix, listing)

    def delete(self, key: str) -> bool:
        """Delete object ``key`` (S3 does not say whether it existed; True unless missing)."""
        check_key(key)
        path = self._path(key)

        def remove() -> bool:
            try:
                self.fs.rm_file(path)
            except FileNotFoundError:
                return False
            return True

        return self._call("delete", key, remove)

    def delete_keys(self, keys: Iterable[str]) -> int:
        """Delete keys with bulk requests of up to 1,000 keys."""
        batch = [check_key(k) for k in keys]
        for start in range(0, len(batch), _BULK_DELETE):
            part = [self._path(k) for k in batch[start : start + _BULK_DELETE]]
            with self._wrap("delete", batch[start]):
                self.fs.rm(part)
        return len(batch)

    def abort_multipart_uploads(self, prefix: str) -> int:
        """Abort unfinished multipart uploads under ``prefix``; return how many."""
        check_key(prefix, prefix=True)
        key_prefix = self._path(prefix)[len(self.bucket) + 1 :] if prefix or self.prefix else ""

        def abort() -> int:
            count = 0
            kwargs: dict[str, Any] = {"Bucket": self.bucket, "Prefix": key_prefix}
            for _ in range(1000):  # bounded pagination
                out = self.fs.call_s3("list_multipart_uploads", **kwargs)
                for upload in out.get("Uploads", []) or []:
                    self.fs.call_s3(
                        "abort_multipart_upload",
                        Bucket=self.bucket,
                        Key=upload["Key"],
                        UploadId=upload["UploadId"],
                    )
                    count += 1
                if not out.get("IsTruncated"):
                    break
                kwargs["KeyMarker"] = out.get("NextKeyMarker", "")
                kwargs["UploadIdMarker"] = out.get("NextUploadIdMarker", "")
            return count

        count = self._call("abort multipart uploads under", prefix, abort)
        if count:
            logger.info("%s tier: aborted %s unfinished multipart uploads under %s",
                        self.name, count, self._display(prefix))
        return count

    # ------------------------------------------------------------------ archival classes
    def restore_state(self, key: str) -> RestoreState:
        """Whether object ``key`` is readable now, archived, or being restored (one HEAD).

        Raises:
            StorageError: If the object does not exist or S3 fails.
        """

        def head() -> RestoreState:
            found = self._head(key)
            if found is None:
                raise FileNotFoundError(errno.ENOENT, "no such object", self._display(key))
            if str(found.get("StorageClass") or "STANDARD") not in ARCHIVAL_STORAGE_CLASSES:
                return RestoreState.READABLE
            restore = str(found.get("Restore") or "")
            if 'ongoing-request="true"' in restore:
                return RestoreState.ONGOING
            if 'ongoing-request="false"' in restore:
                return RestoreState.RESTORED
            return RestoreState.ARCHIVED

        return self._call("stat", key, head)

    def request_restore(self, key: str, *, days: int, retrieval: str) -> None:
        """Ask S3 to make archived object ``key`` readable for ``days`` (RestoreObject).

        Asking again while a restore is in progress is harmless: S3 answers
        ``RestoreAlreadyInProgress``, which is taken as success.

        Args:
            key: The object.
            days: How long the restored copy stays readable.
            retrieval: ``Expedited``, ``Standard`` or ``Bulk``.

        Raises:
            StorageError: If S3 refuses (an object in a directly readable class included).
        """
        check_key(key)
        bucket_key = self._path(key)[len(self.bucket) + 1 :]

        def restore() -> None:
            try:
                self.fs.call_s3(
                    "restore_object", Bucket=self.bucket, Key=bucket_key,
                    RestoreRequest={"Days": days, "GlacierJobParameters": {"Tier": retrieval}},
                )
            except _backend_errors() as exc:
                if _error_code(exc) != "RestoreAlreadyInProgress":
                    raise

        self._throttled("restore", key, restore)

    def thawed(self) -> S3Tier:
        """The same tier, treated as readable: for reading objects whose restore completed.

        The view writes nothing (its storage class is unset, so it must not be used to
        create objects) and shares no s3fs instance with this one.
        """
        view = S3Tier(self.url, self._options, storage_class=None, name=self.name)
        view.throttle = self.throttle
        return view

    def close(self) -> None:
        """Forget the s3fs instance (its connections close with it)."""
        with self._lock:
            self._fs = None
