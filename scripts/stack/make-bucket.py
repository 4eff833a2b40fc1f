#!/usr/bin/env python3
"""One-shot: create the S3 buckets of the configured warm and cold tiers (idempotent).

The bucket names come from the store's own configuration (``CKPT_WARM`` / ``CKPT_COLD``, or
the file named by ``CKPT_CONFIG``), resolved by :func:`ckptstore.config.load_settings` like
in every other ckptstore process, so they cannot drift from what the agents write to. The
endpoint is ``CKPT_S3_ENDPOINT_URL``; credentials are ``AWS_ACCESS_KEY_ID`` /
``AWS_SECRET_ACCESS_KEY`` (the AWS credential chain), never the configuration.

Exit status: 0 when every bucket exists afterwards, 1 otherwise.
"""

from __future__ import annotations

import sys
import time

from ckptstore.config import load_settings
from ckptstore.errors import CkptError
from ckptstore.storage import S3Tier, tier_from_url

#: How long to keep trying while the endpoint does not answer yet (MinIO still starting).
DEADLINE_S = 60.0


def _ensure_bucket(tier: S3Tier) -> bool:
    """Create ``tier``'s bucket; True when it was created now, False when it existed."""
    try:
        tier.fs.mkdir(tier.bucket)
    except FileExistsError:  # S3's BucketAlreadyOwnedByYou / BucketAlreadyExists
        return False
    return True


def main() -> int:
    """Create the buckets; returns the exit status."""
    tiers: list[S3Tier] = []
    try:
        settings = load_settings()
        # Only warm and cold: the hot tier is a local directory this process need not see.
        for name, url in (("warm", settings.warm), ("cold", settings.cold)):
            if not url:
                continue
            tier = tier_from_url(name, url, storage_options=settings.storage_options)
            if isinstance(tier, S3Tier):
                tiers.append(tier)
    except CkptError as exc:
        print(f"make-bucket: {exc}", file=sys.stderr)
        return 1
    if not tiers:
        print("make-bucket: no S3 tier configured (CKPT_WARM / CKPT_COLD); nothing to create")
        return 0
    deadline = time.monotonic() + DEADLINE_S
    for tier in tiers:
        while True:
            try:
                created = _ensure_bucket(tier)
                break
            except PermissionError as exc:  # wrong credentials: waiting will not help
                print(f"make-bucket: access denied creating s3://{tier.bucket}: {exc}",
                      file=sys.stderr)
                return 1
            except Exception as exc:  # botocore's connection errors are not OSErrors
                if time.monotonic() > deadline:
                    print(f"make-bucket: cannot create s3://{tier.bucket} for the "
                          f"{tier.name} tier: {type(exc).__name__}: {exc}", file=sys.stderr)
                    return 1
                time.sleep(1.0)
        verb = "created" if created else "exists:"
        print(f"make-bucket: {verb} s3://{tier.bucket} ({tier.name} tier)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
