"""The process's one cache of parsed manifests, keyed by manifest digest.

A digest names one byte string, and identical bytes parse to an identical manifest, so a
parse can be shared by everything in the process that meets the same digest. Parsing and
validating a manifest of a few hundred tensors takes ~10 ms, hashing its bytes ~0.1 ms: a
delta save reads its base's and its keyframe's manifests, a load and a progressive load read
one, and retention, gc and doctor walk the manifests of every copy on every tier.

Two lookups, for two levels of trust:

* :func:`parse_verified`: the caller read the bytes and checked their blake3 against the
  commit marker (and the catalog); a hit skips only the parse.
* :func:`known_manifest`: the caller trusts a digest it already holds (the catalog's, for a
  copy it recorded as verified) and wants to skip the read as well.

Manifests are frozen: treat a shared one as read-only.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

from ckptstore.format.manifest.model import Manifest

__all__ = [
    "CACHE_SIZE",
    "clear_manifest_cache",
    "known_manifest",
    "parse_verified",
    "remember_manifest",
]

#: Parsed manifests kept, newest use last. Sized for the callers that walk a whole tier
#: (retention and doctor read every copy's manifest), not only for save and load.
CACHE_SIZE = 512

_parsed: OrderedDict[str, Manifest] = OrderedDict()
_lock = threading.Lock()


def parse_verified(data: bytes, digest: str) -> Manifest:
    """Parse manifest bytes whose blake3 the caller computed and checked as ``digest``.

    A digest seen before returns the manifest parsed then.

    Raises:
        IntegrityError: As :meth:`Manifest.from_json` (invalid bytes are never cached).
    """
    found = known_manifest(digest)
    if found is not None:
        return found
    manifest = Manifest.from_json(data)
    remember_manifest(manifest, digest)
    return manifest


def known_manifest(digest: str | None, ckpt_id: str | None = None) -> Manifest | None:
    """The manifest parsed earlier from the bytes with ``digest``, without reading anything.

    Args:
        digest: The digest the caller trusts (None: nothing is known).
        ckpt_id: When given, a manifest of another checkpoint is not returned (a catalog
            row naming another checkpoint's digest must lead to a read, which fails).

    Returns:
        The manifest, or None when this process has not parsed (or no longer keeps) it.
    """
    if digest is None:
        return None
    with _lock:
        found = _parsed.get(digest)
        if found is None or (ckpt_id is not None and found.id != ckpt_id):
            return None
        _parsed.move_to_end(digest)
        return found


def remember_manifest(manifest: Manifest, digest: str) -> None:
    """Cache ``manifest`` as the parse of the bytes with ``digest`` (its writer knows them)."""
    with _lock:
        _parsed[digest] = manifest
        _parsed.move_to_end(digest)
        while len(_parsed) > CACHE_SIZE:
            _parsed.popitem(last=False)


def clear_manifest_cache() -> None:
    """Forget every parsed manifest (the next read of each parses it again)."""
    with _lock:
        _parsed.clear()
