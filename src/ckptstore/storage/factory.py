"""Build the configured tiers from :class:`~ckptstore.config.Settings`."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any, Protocol

from ckptstore.errors import ConfigError
from ckptstore.storage.base import Tier
from ckptstore.storage.local import LocalTier
from ckptstore.storage.s3 import S3Tier

__all__ = ["TierSettings", "build_tiers", "tier_from_url"]

logger = logging.getLogger(__name__)


class TierSettings(Protocol):
    """The fields of :class:`ckptstore.config.Settings` that describe tiers."""

    @property
    def warm(self) -> str | None: ...

    @property
    def cold(self) -> str | None: ...

    @property
    def cold_storage_class(self) -> str | None: ...

    @property
    def storage_options(self) -> dict[str, Any]: ...

    def tier_urls(self) -> dict[str, str]: ...


def tier_from_url(
    name: str,
    url: str,
    *,
    storage_options: Mapping[str, Any] | None = None,
    storage_class: str | None = None,
) -> Tier:
    """Build one tier from its URL.

    Args:
        name: Tier name in the catalog.
        url: ``s3://bucket/prefix``, ``file:///path`` or a plain local path.
        storage_options: s3fs options (S3 only).
        storage_class: S3 storage class for new objects (S3 only).

    Returns:
        An :class:`~ckptstore.storage.s3.S3Tier` or a :class:`~ckptstore.storage.local.LocalTier`.

    Raises:
        ConfigError: For an unsupported URL scheme or invalid S3 options.
    """
    if url.startswith("s3://"):
        return S3Tier(url, storage_options, storage_class=storage_class, name=name)
    if url.startswith("file://") or "://" not in url:
        return LocalTier(url, name=name)
    scheme = url.split("://", 1)[0]
    raise ConfigError(
        f"tier {name}: unsupported URL scheme {scheme!r} in {url!r}; "
        "use a local path, file:// or s3://"
    )


def build_tiers(settings: TierSettings) -> dict[str, Tier]:
    """All configured tiers by name: ``hot`` always, ``warm``/``cold`` when configured.

    The cold tier uses ``settings.cold_storage_class`` for new S3 objects.

    Raises:
        ConfigError: If a tier URL or the storage options are invalid.
    """
    tiers: dict[str, Tier] = {}
    for name, url in settings.tier_urls().items():
        tiers[name] = tier_from_url(
            name,
            url,
            storage_options=settings.storage_options,
            storage_class=settings.cold_storage_class if name == "cold" else None,
        )
    logger.debug("tiers: %s", {name: tier.url for name, tier in tiers.items()})
    return tiers
