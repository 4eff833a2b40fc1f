"""Health of the configured storage tiers: reachable, free space, contents, throughput.

Used by ``ckpt tiers`` and the catalog browser. A probe writes one blob of random bytes
under ``.ckpt-probe/<uuid>/`` through the tier's own API (the same path checkpoints take:
temp file + fsync + link locally, a create-once PUT on S3), reads it back, compares and
deletes it, and flags the measured rates against what the tier's role needs.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from ckptstore.errors import CkptError, IntegrityError, StorageError
from ckptstore.records import UsageRow
from ckptstore.storage import LocalTier, S3Tier, Tier, build_tiers, scrub_secrets
from ckptstore.storage.factory import TierSettings

__all__ = [
    "PROBE_PREFIX",
    "REQUIRED_BYTES_PER_S",
    "ProbeResult",
    "TierStatus",
    "probe_tier",
    "scan_tier",
    "tier_status",
    "tier_statuses",
]

logger = logging.getLogger(__name__)

#: Key prefix of probe blobs (dot-prefixed: ``gc`` and listings of runs skip it).
PROBE_PREFIX = ".ckpt-probe/"
#: Throughput a tier must reach in its role: the hot tier is on the training path (a save
#: blocks or stages); archive tiers only need to keep up with the save rate.
REQUIRED_BYTES_PER_S: Mapping[str, float] = {"hot": 1e9, "archive": 1e8}
_DEFAULT_PROBE_BYTES = {"local": 64 * 2**20, "s3": 16 * 2**20}


@dataclass(frozen=True)
class ProbeResult:
    """One measured write/read of a probe blob.

    Attributes:
        size_bytes: Bytes written and read.
        write_bytes_per_s: Measured write rate (durable: fsync locally, PUT acknowledged).
        read_bytes_per_s: Measured read rate; None when the tier cannot be read directly
            (archival storage class).
        required_bytes_per_s: What the tier's role needs.
        cache_dropped: The local read came from the device, not the page cache.
        ok: Both rates meet the requirement.
        verdict: ``ok``, or what is too slow.
    """

    size_bytes: int
    write_bytes_per_s: float
    read_bytes_per_s: float | None
    required_bytes_per_s: float
    cache_dropped: bool
    ok: bool
    verdict: str


@dataclass(frozen=True)
class TierStatus:
    """What ``ckpt tiers`` reports for one tier.

    Attributes:
        name: Tier name (``hot``, ``warm``, ``cold``).
        url: Where it lives (no credentials).
        backend: ``local`` or ``s3``.
        role: ``hot`` or ``archive``.
        reachable: The backend answered.
        error: Why it is not reachable (None when it is).
        free_bytes: Free space (local tiers), else None.
        objects: Files/objects found by a listing (None if not listed or unreachable).
        listed_bytes: Their total size (None if unknown).
        catalog_checkpoints: PRESENT replicas the catalog records on this tier.
        catalog_bytes: Bytes of those replicas.
        probe: Throughput probe result, if one ran.
    """

    name: str
    url: str
    backend: str
    role: str
    reachable: bool
    error: str | None
    free_bytes: int | None
    objects: int | None
    listed_bytes: int | None
    catalog_checkpoints: int
    catalog_bytes: int
    probe: ProbeResult | None = None

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return asdict(self)


def _backend(tier: Tier) -> str:
    if isinstance(tier, S3Tier):
        return "s3"
    return "local" if tier.is_local else type(tier).__name__


def _role(name: str) -> str:
    return "hot" if name == "hot" else "archive"


def scan_tier(tier: Tier) -> tuple[int, int | None]:
    """Count the objects of a tier and their bytes by listing it (probe blobs excluded).

    Args:
        tier: The tier.

    Returns:
        ``(objects, bytes)``; bytes is None for backends that list names only.

    Raises:
        StorageError: If the listing fails.
    """
    if isinstance(tier, LocalTier):
        return _scan_local(tier)
    if isinstance(tier, S3Tier):
        return _scan_s3(tier)
    keys = [k for k in tier.list_prefix("") if not k.startswith(PROBE_PREFIX)]
    return len(keys), None


def _scan_local(tier: LocalTier) -> tuple[int, int]:
    count = total = 0
    if not tier.root.is_dir():
        return 0, 0
    probe_dir = PROBE_PREFIX.rstrip("/")
    for dirpath, dirnames, filenames in os.walk(tier.root):
        if dirpath == str(tier.root) and probe_dir in dirnames:
            dirnames.remove(probe_dir)
        for fname in filenames:
            try:
                total += os.lstat(os.path.join(dirpath, fname)).st_size
            except FileNotFoundError:  # deleted while we walked: a prune is running
                continue
            count += 1
    return count, total


def _scan_s3(tier: S3Tier) -> tuple[int, int]:
    # The Tier API lists names only; sizes come with the same LIST requests through s3fs,
    # whereas tier.size() would cost one HEAD per object.
    base = f"{tier.bucket}/{tier.prefix}" if tier.prefix else tier.bucket
    try:
        fs = tier.fs
        fs.invalidate_cache()
        if not fs.exists(tier.bucket):
            raise StorageError(
                errno.ENOENT,
                f"{tier.name} tier: bucket {tier.bucket!r} does not exist; create it or fix "
                f"the tier URL {tier.url}",
            )
        try:
            found = fs.find(base, detail=True)
        except FileNotFoundError:
            return 0, 0
    except StorageError:
        raise
    except Exception as exc:  # botocore/aiohttp errors are not OSErrors
        reason = scrub_secrets(f"{type(exc).__name__}: {exc}")
        raise StorageError(
            errno.EIO,
            f"{tier.name} tier: cannot list {tier.url}: {reason}; check the endpoint, "
            "credentials and bucket",
        ) from exc
    count = total = 0
    skip = f"{base}/{PROBE_PREFIX}"
    for path, info in found.items():
        if path.startswith(skip) or info.get("type") == "directory":
            continue
        count += 1
        total += int(info.get("size") or info.get("Size") or 0)
    return count, total


def _drop_cache(path: str) -> bool:
    # The read half of a local probe must measure the device, not the page cache that the
    # write just filled; POSIX_FADV_DONTNEED drops the (already fsynced) clean pages.
    if not hasattr(os, "posix_fadvise"):
        return False
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return False
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    except OSError:
        return False
    finally:
        os.close(fd)
    return True


def _rate(text_bytes_per_s: float) -> str:
    return f"{text_bytes_per_s / 1e6:.0f} MB/s"


def probe_tier(
    tier: Tier, *, size_bytes: int | None = None, role: str | None = None
) -> ProbeResult:
    """Measure write and read throughput with one blob, then delete it.

    Args:
        tier: The tier to probe.
        size_bytes: Blob size (default 64 MiB locally, 16 MiB on S3).
        role: ``hot`` or ``archive`` (default from the tier's name).

    Returns:
        The :class:`ProbeResult`.

    Raises:
        StorageError: If writing, reading or deleting fails.
        IntegrityError: If the bytes read back differ from those written.
    """
    backend = _backend(tier)
    size = size_bytes or _DEFAULT_PROBE_BYTES.get(backend, 16 * 2**20)
    role = role or _role(tier.name)
    required = REQUIRED_BYTES_PER_S[role]
    prefix = f"{PROBE_PREFIX}{uuid.uuid4().hex}/"
    key = prefix + "blob"
    data = os.urandom(size)
    cache_dropped = False
    read_rate: float | None = None
    try:
        started = time.perf_counter()
        tier.put_bytes(key, data)
        write_rate = size / max(time.perf_counter() - started, 1e-9)
        if tier.readable:
            if isinstance(tier, LocalTier):
                cache_dropped = _drop_cache(str(tier.root / key))
            started = time.perf_counter()
            back = tier.get_bytes(key)
            read_rate = size / max(time.perf_counter() - started, 1e-9)
            if back != data:
                raise IntegrityError(
                    f"{tier.name} tier: the probe blob read back from {tier.url} differs from "
                    "what was written; the storage is corrupting data, stop using it and "
                    "check the device or endpoint"
                )
    finally:
        try:
            tier.delete_prefix(prefix)
        except CkptError:
            logger.warning("could not delete probe blob %s on %s", key, tier.url, exc_info=True)
        if isinstance(tier, LocalTier):
            # Leave no empty .ckpt-probe folder behind (another probe may be using it).
            with contextlib.suppress(OSError):
                (tier.root / PROBE_PREFIX.rstrip("/")).rmdir()
    slow = [f"write {_rate(write_rate)}"] if write_rate < required else []
    if read_rate is not None and read_rate < required:
        slow.append(f"read {_rate(read_rate)}")
    verdict = "ok" if not slow else (
        f"slow for the {role} role: {', '.join(slow)} < {_rate(required)} needed"
    )
    return ProbeResult(
        size_bytes=size,
        write_bytes_per_s=write_rate,
        read_bytes_per_s=read_rate,
        required_bytes_per_s=required,
        cache_dropped=cache_dropped,
        ok=not slow,
        verdict=verdict,
    )


def tier_status(
    tier: Tier,
    usage: Sequence[UsageRow] = (),
    *,
    listing: bool = True,
    probe: bool = False,
    probe_bytes: int | None = None,
) -> TierStatus:
    """Check one tier.

    Args:
        tier: The tier.
        usage: The catalog's usage rows (``store.usage()``); this tier's rows are summed.
        listing: Count objects and bytes by listing the tier (one LIST pass on S3).
        probe: Also measure throughput with :func:`probe_tier`.
        probe_bytes: Probe blob size (default by backend).

    Returns:
        The :class:`TierStatus`; failures are reported in it, never raised.
    """
    rows = [r for r in usage if r.tier == tier.name]
    error: str | None = None
    free = objects = listed = None
    result: ProbeResult | None = None
    try:
        free = tier.free_bytes()
        if listing:
            objects, listed = scan_tier(tier)
        elif not tier.is_local:
            tier.exists(f"{PROBE_PREFIX}reachability")  # one cheap request proves the endpoint
        if probe:
            result = probe_tier(tier, size_bytes=probe_bytes)
    except (CkptError, OSError) as exc:
        error = str(exc)
        logger.info("tier %s (%s) failed its check: %s", tier.name, tier.url, error)
    if tier.is_local and isinstance(tier, LocalTier) and not tier.root.is_dir() and error is None:
        error = f"{tier.root} does not exist yet (it is created by the first save)"
    return TierStatus(
        name=tier.name,
        url=tier.url,
        backend=_backend(tier),
        role=_role(tier.name),
        reachable=error is None,
        error=error,
        free_bytes=free,
        objects=objects,
        listed_bytes=listed,
        catalog_checkpoints=sum(r.checkpoints for r in rows),
        catalog_bytes=sum(r.bytes for r in rows),
        probe=result,
    )


def tier_statuses(
    settings: TierSettings,
    usage: Sequence[UsageRow] = (),
    *,
    listing: bool = True,
    probe: bool = False,
    probe_bytes: int | None = None,
) -> list[TierStatus]:
    """Check every configured tier (``ckpt tiers`` and the browser's tiers page).

    The tiers are opened for this check and closed afterwards, so a probe never shares
    connections or caches with a store's own tiers.

    Args:
        settings: The store's settings (tier URLs, storage options).
        usage: The catalog's usage rows (``store.usage()``).
        listing: Count objects and bytes by listing each tier.
        probe: Also measure throughput with :func:`probe_tier`.
        probe_bytes: Probe blob size (default by backend).

    Returns:
        One :class:`TierStatus` per configured tier, ``hot`` first; a tier's failures are
        reported in its status.

    Raises:
        ConfigError: If a tier URL or the storage options are invalid.
    """
    tiers = build_tiers(settings)
    try:
        return [
            tier_status(tier, usage, listing=listing, probe=probe, probe_bytes=probe_bytes)
            for tier in tiers.values()
        ]
    finally:
        for tier in tiers.values():
            tier.close()
