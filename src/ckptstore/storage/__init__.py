"""Storage tiers (local directory, S3) and verified transfers between them.

Importing this package imports neither s3fs nor prefect; the S3 backend loads s3fs on first
use.
"""

from __future__ import annotations

from ckptstore.storage.base import (
    COMMIT_NAME,
    MANIFEST_NAME,
    Tier,
    check_key,
    is_not_found,
    is_retryable,
    scrub_secrets,
)
from ckptstore.storage.factory import build_tiers, tier_from_url
from ckptstore.storage.local import LocalTier
from ckptstore.storage.s3 import S3Tier
from ckptstore.storage.transfer import (
    ChunkRef,
    copy_checkpoint,
    copy_keys,
    foreign_chunks,
    iter_chunks,
)

__all__ = [
    "COMMIT_NAME",
    "MANIFEST_NAME",
    "ChunkRef",
    "LocalTier",
    "S3Tier",
    "Tier",
    "build_tiers",
    "check_key",
    "copy_checkpoint",
    "copy_keys",
    "foreign_chunks",
    "is_not_found",
    "is_retryable",
    "iter_chunks",
    "scrub_secrets",
    "tier_from_url",
]
